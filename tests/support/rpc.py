"""The skip mark of every test that needs llama.cpp's RPC backend (issue 19's model groups):
the probe runs once, however many test modules ask."""

from __future__ import annotations

import pytest

from desktop_worker.groups.rpc_backend import LlamaRpc

__all__ = ["needs_rpc"]

needs_rpc = pytest.mark.skipif(not LlamaRpc().probe().available,
                               reason="llama.cpp built without its RPC backend")
