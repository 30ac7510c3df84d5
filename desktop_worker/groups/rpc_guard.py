"""The validating gate's core (issue 34): a sans-I/O guard of one connection between a group's
head and this member's llama.cpp RPC server, for RPC protocol 7.0.0 (``rpc_wire.py``).

llama.cpp's RPC server trusts its client: it has had out-of-bounds reads and writes, a
use-after-free in ``GRAPH_RECOMPUTE``, and it runs any op a graph names, ``GGML_OP_CUSTOM``'s
function pointers included. So every byte from the head passes through ``RpcGuard.from_head``
first, which parses each command and lets through only what an honest head sends:

- ``HELLO`` first, once, of protocol 7's size and with no transport upgrade (RDMA would take
  the bytes past the gate); the member's answer must be 7.0.0 exactly.
- Only llama.cpp's RPC client's own commands, one reply outstanding at a time (the client
  waits for each; a head that pipelines is not llama.cpp's client).
- ``ALLOC_BUFFER`` within the share the queen granted each device (``GuardPolicy``): every live
  buffer of this connection is counted, ``FREE_BUFFER`` gives its bytes back (the server frees
  all of a connection's buffers when it ends, so a new connection starts from nothing).
- Every tensor a command names: a known type, strides that reach no further than its buffer
  (``rpc_wire.extent``), a buffer of this connection whose base the head was told; offsets and
  sizes of ``SET_TENSOR``, ``GET_TENSOR``, ``MEMSET_TENSOR`` and ``COPY_TENSOR`` inside the
  tensor itself.
- Graphs: bounded nodes, tensors and depth (the server recurses through sources), every node
  and source present, views inside their source's buffer, only the ops of ``rpc_ops`` with the
  shapes ggml would give them; ``GRAPH_RECOMPUTE`` only of a graph checked on this connection
  since the last ``FREE_BUFFER``.

Anything else raises ``RpcRefused`` naming the command and why; the caller ends the connection.
``from_member`` reads the replies the guard must learn from (buffer handles and sizes, base
addresses, the row padding a GPU backend reports through ``GET_ALLOC_SIZE``, kept per gate in
``MemberFacts``) and refuses a reply it did not expect.

Large payloads are not copied: a ``SET_TENSOR``'s data (gigabytes at load) and a
``GET_TENSOR``'s answer pass through as slices of the bytes read (``memoryview``); only
headers and small commands are buffered. The output of both methods is the list of chunks to
write, in order.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from desktop_worker.errors import RpcRefused
from desktop_worker.groups.rpc_ops import ALLOWED_OPS, chain_problem, node_problem
from desktop_worker.groups.rpc_wire import (
    CONN_CAPS,
    GRAPH_HEAD,
    PROTOCOL,
    REPLY_SIZE,
    REQUEST_SIZE,
    ROW_PADDING,
    SET_TENSOR_HEAD,
    TENSOR,
    TYPES,
    U32,
    U64,
    Command,
    Tensor,
    extent,
    nbytes,
    op_name,
    parse_tensor,
    row_bytes,
    tensor_problem,
)

__all__ = ["Chunks", "GuardLimits", "GuardPolicy", "MemberFacts", "RpcGuard"]

Chunks = list[bytes | memoryview]
HEADER = 1 + 8  # command, payload size
REPLY_HEADER = 8
MAX_FACTS = 4096
MAX_CHECKED = 4096  # tensors remembered as checked (a token sets the same few inputs each time)


@dataclass(frozen=True)
class GuardLimits:
    """Bounds on what one connection may ask: live buffers, and a graph's nodes, tensors and
    depth (a chain of sources the server follows recursively; 8,192 is far above any model's
    layers and far below its stack)."""

    max_buffers: int = 4096
    max_graph_nodes: int = 32768
    max_graph_tensors: int = 65536
    max_graph_depth: int = 8192

    @property
    def max_graph_bytes(self) -> int:
        return GRAPH_HEAD + 8 * self.max_graph_nodes + 4 + TENSOR.size * self.max_graph_tensors


@dataclass(frozen=True)
class GuardPolicy:
    """What the head may do on this member: ``share_bytes[d]`` the most it may allocate on
    device ``d`` (the queen's grant; its device count is the member's)."""

    share_bytes: tuple[int, ...]
    limits: GuardLimits = field(default_factory=GuardLimits)

    @classmethod
    def from_mb(cls, share_mb: Sequence[int], limits: GuardLimits | None = None) -> GuardPolicy:
        return cls(tuple(max(0, int(mb)) * 1024 * 1024 for mb in share_mb),
                   limits or GuardLimits())


class MemberFacts:
    """What this member's server said that holds for every connection of one gate: the bytes a
    backend pads after a quantized tensor whose rows are not a multiple of 512 (CUDA zeroes
    them in ``INIT_TENSOR`` and its matrix kernels read them), per (device, type, row length),
    learned from ``GET_ALLOC_SIZE`` answers. Unknown ones count as CUDA's padding, the
    largest any backend keeps. A CPU server pads nothing."""

    def __init__(self) -> None:
        self._pads: dict[tuple[int, int, int], int] = {}
        self.version = 0  # bumped on every change: a tensor checked before is checked again

    def pad(self, device: int, t: Tensor) -> int:
        if t.view_src or not _padded(t):
            return 0
        known = self._pads.get((device, t.type, t.ne[0]))
        return known if known is not None else _worst_pad(t)

    def learn(self, device: int, t: Tensor, alloc_size: int) -> None:
        if t.view_src or not _padded(t) or len(self._pads) >= MAX_FACTS:
            return
        key = (device, t.type, t.ne[0])
        pad = max(self._pads.get(key, 0), max(0, alloc_size - nbytes(t)))
        if self._pads.get(key) != pad:
            self._pads[key] = pad
            self.version += 1


def _padded(t: Tensor) -> bool:
    return TYPES[t.type].quantized and t.ne[0] % ROW_PADDING != 0


def _worst_pad(t: Tensor) -> int:
    return row_bytes(t.type, ROW_PADDING - t.ne[0] % ROW_PADDING)


@dataclass(eq=False)
class _Buffer:
    device: int
    size: int
    base: int | None = None


@dataclass(frozen=True)
class _Pending:
    """A reply the member owes: for which command, how long, and what to learn from it."""

    command: Command
    size: int
    device: int = 0
    requested: int = 0
    handle: int = 0
    tensor: Tensor | None = None


class _GraphTensors:
    """A graph's tensors by id and its nodes' positions (``rpc_ops.Graph``)."""

    def __init__(self, tensors: dict[int, Tensor], positions: dict[int, int]) -> None:
        self.tensors = tensors
        self.positions = positions
        self.nodes = list(positions)  # ids, in order

    def node_at(self, position: int) -> Tensor:
        return self.tensors[self.nodes[position]]

    def tensor(self, tensor_id: int) -> Tensor | None:
        return self.tensors.get(tensor_id)

    def position(self, tensor_id: int) -> int | None:
        return self.positions.get(tensor_id)


class _Stream:
    """One direction's reassembly: a unit (a header, then its body) is buffered until whole
    and handed to ``unit``, which appends what passes to the output; a payload the unit lets
    through (``passing`` bytes) goes out as slices of the bytes read, never copied."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.buf = bytearray()
        self.need = first
        self.passing = 0

    def feed(self, data: bytes, unit: Callable[[Chunks], None], *,
             starting: Callable[[], None] = lambda: None,
             passed: Callable[[], None] = lambda: None) -> Chunks:
        """``starting`` runs before a new unit's first byte is taken, ``passed`` once a
        passed-through payload is all out."""
        out: Chunks = []
        view = memoryview(data)
        pos, end = 0, len(view)
        while pos < end:
            if self.passing:
                take = min(self.passing, end - pos)
                out.append(view[pos:pos + take])
                pos += take
                self.passing -= take
                if not self.passing:
                    passed()
                continue
            if not self.buf:
                starting()
            take = min(self.need - len(self.buf), end - pos)
            self.buf += view[pos:pos + take]
            pos += take
            if len(self.buf) == self.need:
                unit(out)
        return out

    def done(self, out: Chunks, passing: int = 0) -> None:
        """The unit passes whole; ``passing`` bytes of payload follow it."""
        out.append(bytes(self.buf))
        self.buf.clear()
        self.need = self.first
        self.passing = passing


class RpcGuard:
    """One connection's guard. Not thread-safe: one event loop feeds both directions."""

    def __init__(self, policy: GuardPolicy, facts: MemberFacts | None = None) -> None:
        self.policy = policy
        self.facts = facts if facts is not None else MemberFacts()
        self.allocated = [0] * len(policy.share_bytes)  # bytes per device, reserved included
        self._buffers: dict[int, _Buffer] = {}
        self._graphs: set[int] = set()  # devices with a checked graph the server keeps
        # a serialized tensor already checked, as sent: (tensor, facts' version, needed a buffer)
        self._checked: dict[bytes, tuple[Tensor, int, bool]] = {}
        self._hello = False  # HELLO sent
        self._pending: _Pending | None = None
        self._head = _Stream(HEADER)  # SET_TENSOR's data passes through
        self._command: Command | None = None  # the head's command being read
        self._member = _Stream(REPLY_HEADER)  # GET_TENSOR's answer passes through
        self._reply_body = False  # a reply's header was read, its body is next

    @property
    def buffers(self) -> int:
        return len(self._buffers)

    # --- head to member ----------------------------------------------------------------------

    def from_head(self, data: bytes) -> Chunks:
        """The chunks of ``data`` (and of what came before it) to pass to the member; raises
        ``RpcRefused`` on the first thing an honest head would not send."""
        return self._head.feed(data, self._head_unit)

    def _head_unit(self, out: Chunks) -> None:
        stream = self._head
        if self._command is None:
            self._head_header()
            if stream.need > HEADER:
                return  # its body next
        command = self._command
        assert command is not None
        body = memoryview(stream.buf)[HEADER:]
        try:
            self._check(command, body)
        finally:
            body.release()
        size = U64.unpack_from(stream.buf, 1)[0]
        stream.done(out, size - SET_TENSOR_HEAD if command is Command.SET_TENSOR else 0)
        self._command = None

    def _head_header(self) -> None:
        code = self._head.buf[0]
        size = U64.unpack_from(self._head.buf, 1)[0]
        try:
            command = Command(code)
        except ValueError:
            self._refuse(f"command {code}", "unknown_command",
                         f"no RPC command {code} in protocol 7")
        name = command.name
        if not self._hello and command is not Command.HELLO:
            self._refuse(name, "no_hello", "the first command must be HELLO")
        if self._hello and command is Command.HELLO:
            self._refuse(name, "forbidden_command", "HELLO comes once")
        if self._pending is not None:
            self._refuse(name, "pipelined", f"sent before the reply to "
                         f"{self._pending.command.name} (llama.cpp's client waits for it)")
        if command is Command.SET_TENSOR:
            if size < SET_TENSOR_HEAD:
                self._refuse(name, "bad_size", f"{size} bytes is shorter than its header")
            need = SET_TENSOR_HEAD
        elif command is Command.GRAPH_COMPUTE:
            limit = self.policy.limits.max_graph_bytes
            if not GRAPH_HEAD + 4 <= size <= limit:
                self._refuse(name, "graph_too_large", f"{size} bytes (at most {limit})")
            need = size
        else:
            expected = REQUEST_SIZE[command]
            if size != expected:
                code_word = "bad_version" if command is Command.HELLO else "bad_size"
                self._refuse(name, code_word, f"{size} bytes, protocol 7.0.0 sends {expected}")
            need = size
        self._command = command
        self._head.need = HEADER + need

    # --- the commands ----------------------------------------------------------------------

    def _check(self, command: Command, body: memoryview) -> None:
        name = command.name
        reply = REPLY_SIZE.get(command)
        if command is Command.HELLO:
            if any(body):
                self._refuse(name, "transport", "asks for a transport upgrade (RDMA) past "
                             "the gate")
            self._hello = True
        elif command in (Command.GET_ALIGNMENT, Command.GET_MAX_SIZE,
                         Command.GET_DEVICE_MEMORY):
            self._device(name, U32.unpack_from(body)[0])
        elif command is Command.ALLOC_BUFFER:
            self._alloc(body)
            return
        elif command is Command.BUFFER_GET_BASE:
            handle = U64.unpack_from(body)[0]
            self._buffer(name, handle)
            self._pending = _Pending(command, 8, handle=handle)
            return
        elif command is Command.FREE_BUFFER:
            self._free(U64.unpack_from(body)[0])
        elif command is Command.BUFFER_CLEAR:
            self._buffer(name, U64.unpack_from(body)[0])
        elif command in (Command.INIT_TENSOR, Command.MEMSET_TENSOR, Command.SET_TENSOR,
                         Command.SET_TENSOR_HASH, Command.GET_TENSOR, Command.COPY_TENSOR):
            reply = self._tensor_command(command, body)
        elif command is Command.GET_ALLOC_SIZE:
            self._alloc_size(body)
            return
        elif command is Command.GRAPH_COMPUTE:
            self._graph(body)
        elif command is Command.GRAPH_RECOMPUTE:
            device = self._device(name, U32.unpack_from(body)[0])
            if device not in self._graphs:
                self._refuse(name, "no_graph", f"device {device} keeps no checked graph")
        if reply is not None:
            self._pending = _Pending(command, reply)

    def _device(self, command: str, device: int) -> int:
        if device >= len(self.policy.share_bytes):
            self._refuse(command, "bad_device", f"device {device}; this member serves "
                         f"{len(self.policy.share_bytes)}")
        return device

    def _buffer(self, command: str, handle: int) -> _Buffer:
        found = self._buffers.get(handle)
        if found is None:
            self._refuse(command, "unknown_buffer",
                         f"buffer {handle:#x} is not one of this connection's")
        return found

    def _alloc(self, body: memoryview) -> None:
        name = Command.ALLOC_BUFFER.name
        device = self._device(name, U32.unpack_from(body)[0])
        size = U64.unpack_from(body, 4)[0]
        if len(self._buffers) >= self.policy.limits.max_buffers:
            self._refuse(name, "too_many_buffers",
                         f"{len(self._buffers)} buffers are live already")
        share = self.policy.share_bytes[device]
        if self.allocated[device] + size > share:
            self._refuse(name, "over_share", f"{size} bytes on device {device} with "
                         f"{self.allocated[device]} of its {share} in use")
        self.allocated[device] += size  # reserved until the reply says what it got
        self._pending = _Pending(Command.ALLOC_BUFFER, 16, device=device, requested=size)

    def _free(self, handle: int) -> None:
        buffer = self._buffer(Command.FREE_BUFFER.name, handle)
        del self._buffers[handle]
        self.allocated[buffer.device] -= buffer.size
        self._graphs.clear()  # the server drops its kept graphs too
        self._checked.clear()

    def _tensor_command(self, command: Command, body: memoryview) -> int | None:
        """INIT, MEMSET, SET(_HASH), GET and COPY_TENSOR: the tensor(s), and the range inside
        the tensor; returns the reply's size (None: no reply)."""
        name = command.name
        t = self._tensor(name, body)
        size = 0
        if command is Command.INIT_TENSOR:
            return None
        if command is Command.COPY_TENSOR:
            dst = self._tensor(name, body[TENSOR.size:])
            if nbytes(t) > nbytes(dst):
                self._refuse(name, "out_of_bounds", f"{nbytes(t)} bytes into a tensor of "
                             f"{nbytes(dst)}")
            return REPLY_SIZE[command]
        if command is Command.SET_TENSOR:
            flag, offset = body[TENSOR.size], U64.unpack_from(body, TENSOR.size + 1)[0]
            if flag > 1:
                self._refuse(name, "bad_message", f"cache flag {flag}")
            size = U64.unpack_from(self._head.buf, 1)[0] - SET_TENSOR_HEAD
        else:
            offset = U64.unpack_from(body, TENSOR.size)[0]
            if command is not Command.SET_TENSOR_HASH:
                size = U64.unpack_from(body, TENSOR.size + 8)[0]
        room = nbytes(t)
        if command is Command.SET_TENSOR_HASH:
            if offset >= room:
                self._refuse(name, "out_of_bounds", f"offset {offset} past {room} bytes")
            return REPLY_SIZE[command]
        if size == 0 or offset + size > room:
            self._refuse(name, "out_of_bounds", f"{size} bytes at offset {offset} of a "
                         f"tensor of {room}")
        if command is Command.GET_TENSOR:
            return size
        return None

    def _alloc_size(self, body: memoryview) -> None:
        name = Command.GET_ALLOC_SIZE.name
        device = self._device(name, U32.unpack_from(body)[0])
        t = self._tensor(name, body[4:], need_buffer=False)
        for i in range(1, 11):
            at = 4 + i * TENSOR.size
            if U64.unpack_from(body, at)[0]:  # the server skips a source with id 0
                self._tensor(name, body[at:], need_buffer=False)
        self._pending = _Pending(Command.GET_ALLOC_SIZE, 8, device=device, tensor=t)

    # --- tensors and graphs -------------------------------------------------------------------

    def _tensor(self, command: str, raw: memoryview | bytes, *,
                need_buffer: bool = True) -> Tensor:
        """A serialized tensor, checked. ``need_buffer=False`` (GET_ALLOC_SIZE, which only
        sizes it): no buffer, or one the server does not know (another member's, which the
        server ignores as it does), is allowed; one of this connection's is checked."""
        key = bytes(raw[:TENSOR.size])
        known = self._checked.get(key)
        if known is not None and known[1] == self.facts.version and known[2] >= need_buffer:
            return known[0]
        t = parse_tensor(key)
        self._tensor_checks(command, t, need_buffer=need_buffer)
        if len(self._checked) >= MAX_CHECKED:
            self._checked.clear()
        self._checked[key] = (t, self.facts.version, need_buffer)
        return t

    def _tensor_checks(self, command: str, t: Tensor, *, need_buffer: bool) -> _Buffer | None:
        problem = tensor_problem(t)
        if problem is not None:
            self._refuse(command, "bad_tensor", problem)
        if t.op not in ALLOWED_OPS:
            self._refuse(command, "forbidden_op", f"op {op_name(t.op)} is not allowed")
        if t.buffer == 0:
            if need_buffer:
                self._refuse(command, "no_buffer", "a tensor in no buffer of this member")
            if t.data != 0:
                self._refuse(command, "bad_tensor", "an address without a buffer")
            return None
        buffer = self._buffers.get(t.buffer)
        if buffer is None:
            if need_buffer:
                self._refuse(command, "unknown_buffer",
                             f"buffer {t.buffer:#x} is not one of this connection's")
            return None
        if buffer.base is None:
            self._refuse(command, "unknown_buffer", "a tensor in a buffer whose base was "
                         "never asked for")
        reach = extent(t, self.facts.pad(buffer.device, t))
        if not buffer.base <= t.data or t.data + reach > buffer.base + buffer.size:
            self._refuse(command, "out_of_bounds",
                         f"{reach} bytes at {t.data:#x} outside its buffer "
                         f"[{buffer.base:#x}, +{buffer.size})")
        return buffer

    def _graph(self, body: memoryview) -> None:
        name = Command.GRAPH_COMPUTE.name
        limits = self.policy.limits
        device, n_nodes = struct.unpack_from("<II", body)
        self._device(name, device)
        if not 1 <= n_nodes <= limits.max_graph_nodes:
            self._refuse(name, "graph_too_large", f"{n_nodes} nodes (1 to "
                         f"{limits.max_graph_nodes})")
        at = GRAPH_HEAD + 8 * n_nodes
        if len(body) < at + 4:
            self._refuse(name, "bad_size", "shorter than its node list")
        n_tensors = U32.unpack_from(body, at)[0]
        if n_tensors > limits.max_graph_tensors:
            self._refuse(name, "graph_too_large", f"{n_tensors} tensors (at most "
                         f"{limits.max_graph_tensors})")
        if len(body) != at + 4 + n_tensors * TENSOR.size:
            self._refuse(name, "bad_size", f"{len(body)} bytes for {n_nodes} nodes and "
                         f"{n_tensors} tensors")
        tensors: dict[int, Tensor] = {}
        for i in range(n_tensors):
            t = parse_tensor(body, at + 4 + i * TENSOR.size)
            if t.id == 0 or t.id in tensors:
                self._refuse(name, "bad_graph", f"tensor id {t.id:#x} is zero or twice")
            tensors[t.id] = t
        positions: dict[int, int] = {}
        for i, node in enumerate(struct.unpack_from(f"<{n_nodes}Q", body, GRAPH_HEAD)):
            if node not in tensors or node in positions:
                self._refuse(name, "bad_graph", f"node {i} ({node:#x}) is missing or twice")
            positions[node] = i
        for t in tensors.values():
            self._tensor_checks(name, t, need_buffer=True)
            for source in (*t.src, t.view_src):
                if source and source not in tensors:
                    self._refuse(name, "bad_graph", f"a source ({source:#x}) of "
                                 f"{_label(t)} is not in the graph")
            if t.view_src:
                base = tensors[t.view_src]
                if base.buffer != t.buffer or t.data != base.data + t.view_offs:
                    self._refuse(name, "bad_graph", f"view {_label(t)} is not where its "
                                 "source is")
        problem = chain_problem(tensors, limits.max_graph_depth)
        if problem is not None:
            self._refuse(name, "graph_too_large" if "deeper" in problem else "bad_graph",
                         problem)
        graph = _GraphTensors(tensors, positions)
        for node in positions:
            t = tensors[node]
            sources = tuple(tensors[s] if s else None for s in t.src)
            problem = node_problem(t, sources, graph)
            if problem is not None:
                code = "forbidden_op" if "not allowed" in problem else "bad_shape"
                self._refuse(name, code, f"{op_name(t.op)} node {_label(t)}: {problem}")
        self._graphs.add(device)

    # --- member to head ----------------------------------------------------------------------

    def from_member(self, data: bytes) -> Chunks:
        """The chunks of the member's ``data`` to pass to the head; raises ``RpcRefused``
        (``by="member"``) on a reply nobody asked for or of the wrong size."""
        return self._member.feed(data, self._member_unit, starting=self._expecting,
                                 passed=self._answered)

    def _expecting(self) -> None:
        if self._pending is None:
            self._refuse("reply", "unexpected_reply", "the member sent bytes no command "
                         "asked for", by="member")

    def _answered(self) -> None:
        self._pending = None

    def _member_unit(self, out: Chunks) -> None:
        pending, stream = self._pending, self._member
        assert pending is not None
        if not self._reply_body:
            size = U64.unpack_from(stream.buf)[0]
            if size != pending.size:
                self._refuse(pending.command.name, "bad_reply", f"a reply of {size} bytes, "
                             f"expected {pending.size}", by="member")
            if pending.command is Command.GET_TENSOR:
                stream.done(out, size)  # the data passes through; ``_answered`` at its end
                return
            self._reply_body = True
            stream.need = REPLY_HEADER + size
            return
        self._learn(pending, memoryview(stream.buf)[REPLY_HEADER:])
        stream.done(out)
        self._reply_body = False
        self._pending = None

    def _learn(self, pending: _Pending, body: memoryview) -> None:
        command = pending.command
        if command is Command.HELLO:
            version = tuple(body[:3])
            if version != PROTOCOL:
                self._refuse("HELLO", "bad_version", "the member's RPC server speaks "
                             f"{'.'.join(map(str, version))}, the gate "
                             f"{'.'.join(map(str, PROTOCOL))}", by="member")
            if any(body[4:4 + CONN_CAPS]):
                self._refuse("HELLO", "transport", "the member's server offers a transport "
                             "upgrade", by="member")
        elif command is Command.ALLOC_BUFFER:
            handle, size = struct.unpack_from("<QQ", body)
            self.allocated[pending.device] -= pending.requested
            if handle == 0:
                return  # the server could not allocate it
            if handle in self._buffers:
                self._refuse("ALLOC_BUFFER", "bad_reply", "a buffer handle given twice",
                             by="member")
            self._buffers[handle] = _Buffer(pending.device, size)
            self.allocated[pending.device] += size
            share = self.policy.share_bytes[pending.device]
            if self.allocated[pending.device] > share:
                self._refuse("ALLOC_BUFFER", "over_share", f"the server gave {size} bytes, "
                             f"past device {pending.device}'s share of {share}")
        elif command is Command.BUFFER_GET_BASE:
            buffer = self._buffers.get(pending.handle)
            if buffer is not None:
                buffer.base = U64.unpack_from(body)[0]
        elif command is Command.GET_ALLOC_SIZE and pending.tensor is not None:
            self.facts.learn(pending.device, pending.tensor, U64.unpack_from(body)[0])

    def _refuse(self, command: str, code: str, detail: str, *, by: str = "head") -> NoReturn:
        raise RpcRefused(command, code, detail, by=by)


def _label(t: Tensor) -> str:
    name = t.name.split(b"\0", 1)[0].decode("ascii", "replace")[:48]
    return repr(name) if name else f"{t.id:#x}"
