"""The queen's own reading of the models its workers serve: each hub model's pinned file and its
size from the GGUF header, which is what prices it (never a worker's word)."""

from queen_server.catalog.catalog import FileReader, ModelCatalog, Reading
from queen_server.catalog.facts import ModelFacts, RemoteFile, RepoFiles, hub_name

__all__ = ["FileReader", "ModelCatalog", "ModelFacts", "Reading", "RemoteFile", "RepoFiles",
           "hub_name"]
