"""Apiary's desktop worker: lends a GPU to the swarm and earns sats for its tokens."""

__version__ = "0.1.0"
