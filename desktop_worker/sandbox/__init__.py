"""The engine boundary (issue 34): llama.cpp runs only in confined child processes.

The worker's own process holds what a volunteer must not lose (the worker's key, the payout
address, the settings, the queen's connection, the app) and never loads llama.cpp. Model
files, prompts, grammars and a group head's RPC commands are strangers' bytes: they are read
only by engine children, each confined before it reads one (``confine``: rlimits, no new
privileges, Landlock, a system call filter), each speaking one narrow protocol to the worker
(``ipc``, ``shared_schema.engine_ipc``). A child that crashes or misbehaves ends alone.

- ``ipc``: the protocol's sans-I/O core (framing, the worker's state machine).
- ``policy``: what a child may touch (pure); ``confine``, ``landlock``, ``seccomp``: applying it.
- ``process``: the worker's handle on one child (the child's entry point is
  ``desktop_worker/engine_child.py``, above this package and the engine and groups it runs).
- ``context``: a context in a child behind ``LlamaContext``'s interface, and the pool's
  factory of them (``groups/rpc_probe.py`` asks a child for llama.cpp's build and devices).
"""
