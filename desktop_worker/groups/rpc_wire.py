"""llama.cpp's RPC protocol 7.0.0, as the gate reads it (issue 34): the commands, their sizes,
the serialized tensor, and ggml's types and ops, for exactly the llama.cpp that llama-cpp-python
0.3.36 vendors (``ggml/src/ggml-rpc/ggml-rpc.cpp``, ``ggml/include/ggml.h``, ``ggml-rpc.h``).
Nothing here reads a socket: ``rpc_guard.py`` feeds it bytes.

On the wire a command is ``cmd (1 byte) | size (u64) | payload (size bytes)``; a reply, sent
only by the commands listed in ``REPLY_SIZE``, is ``size (u64) | payload``. Integers are
little-endian (llama.cpp copies its packed structs as they are in memory; every platform it
serves is little-endian). A tensor is ``rpc_tensor``, 296 bytes.

A tensor's *extent* is every byte a kernel may touch through it: ``ggml_nbytes`` (the furthest
element its strides reach), at least its elements packed densely (a kernel that treats it as
contiguous), and, for a quantized weight whose rows a GPU backend pads, the padding its backend
reported (``rpc_guard.MemberFacts``). Python's integers do not overflow, so a shape whose size
would wrap around in C is simply too large here.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

__all__ = [
    "GGML_OPS", "MAX_DIMS", "MAX_SRC", "PROTOCOL", "REPLY_SIZE", "REQUEST_SIZE", "TENSOR",
    "TYPES", "Command", "Tensor", "TypeInfo", "dense_bytes", "extent", "nbytes", "nelements",
    "op_name", "parse_tensor", "row_bytes", "tensor_problem",
]

PROTOCOL = (7, 0, 0)  # RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_SRC = 10  # GGML_MAX_SRC
CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities in HELLO (RDMA); zero for TCP
ROW_PADDING = 512  # MATRIX_ROW_PADDING: CUDA pads a quantized row to a multiple of it
FLAGS = 0x1F  # GGML_TENSOR_FLAG_{INPUT,OUTPUT,PARAM,LOSS,COMPUTE}

# id, type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10], view_src, view_offs, data,
# name[64], use_count
TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


class Command(IntEnum):
    """``enum rpc_cmd``."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17


T = TENSOR.size
# The exact payload of each fixed-size command (SET_TENSOR and GRAPH_COMPUTE vary).
REQUEST_SIZE: dict[Command, int] = {
    Command.HELLO: CONN_CAPS,
    Command.DEVICE_COUNT: 0,
    Command.ALLOC_BUFFER: 4 + 8,
    Command.GET_ALIGNMENT: 4,
    Command.GET_MAX_SIZE: 4,
    Command.BUFFER_GET_BASE: 8,
    Command.FREE_BUFFER: 8,
    Command.BUFFER_CLEAR: 8 + 1,
    Command.MEMSET_TENSOR: T + 8 + 8 + 1,
    Command.SET_TENSOR_HASH: T + 8 + 8,
    Command.GET_TENSOR: T + 8 + 8,
    Command.COPY_TENSOR: 2 * T,
    Command.GET_DEVICE_MEMORY: 4,
    Command.INIT_TENSOR: T,
    Command.GET_ALLOC_SIZE: 4 + T * (1 + MAX_SRC),
    Command.GRAPH_RECOMPUTE: 4,
}
SET_TENSOR_HEAD = T + 1 + 8  # rpc_tensor, cache_flag, offset; then the data
GRAPH_HEAD = 4 + 4  # device, n_nodes; then node ids, n_tensors, tensors

# The reply each command gets, by its exact size (GET_TENSOR's is the size it asked for).
REPLY_SIZE: dict[Command, int | None] = {
    Command.HELLO: 4 + CONN_CAPS,
    Command.DEVICE_COUNT: 4,
    Command.ALLOC_BUFFER: 16,
    Command.GET_ALIGNMENT: 8,
    Command.GET_MAX_SIZE: 8,
    Command.BUFFER_GET_BASE: 8,
    Command.SET_TENSOR_HASH: 1,
    Command.GET_TENSOR: None,
    Command.COPY_TENSOR: 1,
    Command.GET_DEVICE_MEMORY: 16,
    Command.GET_ALLOC_SIZE: 8,
}


class TypeInfo(NamedTuple):
    name: str
    block: int  # elements per block
    size: int  # bytes per block

    @property
    def quantized(self) -> bool:
        return self.block > 1


# ``enum ggml_type`` with ggml's block sizes and type sizes (removed types are left out).
TYPES: dict[int, TypeInfo] = {
    0: TypeInfo("f32", 1, 4), 1: TypeInfo("f16", 1, 2), 2: TypeInfo("q4_0", 32, 18),
    3: TypeInfo("q4_1", 32, 20), 6: TypeInfo("q5_0", 32, 22), 7: TypeInfo("q5_1", 32, 24),
    8: TypeInfo("q8_0", 32, 34), 9: TypeInfo("q8_1", 32, 36), 10: TypeInfo("q2_K", 256, 84),
    11: TypeInfo("q3_K", 256, 110), 12: TypeInfo("q4_K", 256, 144),
    13: TypeInfo("q5_K", 256, 176), 14: TypeInfo("q6_K", 256, 210),
    15: TypeInfo("q8_K", 256, 292), 16: TypeInfo("iq2_xxs", 256, 66),
    17: TypeInfo("iq2_xs", 256, 74), 18: TypeInfo("iq3_xxs", 256, 98),
    19: TypeInfo("iq1_s", 256, 50), 20: TypeInfo("iq4_nl", 32, 18),
    21: TypeInfo("iq3_s", 256, 110), 22: TypeInfo("iq2_s", 256, 82),
    23: TypeInfo("iq4_xs", 256, 136), 24: TypeInfo("i8", 1, 1), 25: TypeInfo("i16", 1, 2),
    26: TypeInfo("i32", 1, 4), 27: TypeInfo("i64", 1, 8), 28: TypeInfo("f64", 1, 8),
    29: TypeInfo("iq1_m", 256, 56), 30: TypeInfo("bf16", 1, 2),
    34: TypeInfo("tq1_0", 256, 54), 35: TypeInfo("tq2_0", 256, 66),
    39: TypeInfo("mxfp4", 32, 17), 40: TypeInfo("nvfp4", 64, 36),
    41: TypeInfo("q1_0", 128, 18), 42: TypeInfo("q2_0", 64, 18),
}
F32, F16, I32, I64, BF16 = 0, 1, 26, 27, 30

# ``enum ggml_op``, in order (GGML_OP_COUNT is 101 in this build).
GGML_OPS: tuple[str, ...] = (
    "NONE", "DUP", "ADD", "ADD_ID", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT", "LOG",
    "SIN", "COS", "SUM", "SUM_ROWS", "CUMSUM", "MEAN", "ARGMAX", "COUNT_EQUAL", "REPEAT",
    "REPEAT_BACK", "CONCAT", "SILU_BACK", "NORM", "RMS_NORM", "RMS_NORM_BACK", "GROUP_NORM",
    "L2_NORM", "MUL_MAT", "MUL_MAT_ID", "OUT_PROD", "SCALE", "SET", "CPY", "CONT", "RESHAPE",
    "VIEW", "PERMUTE", "TRANSPOSE", "GET_ROWS", "GET_ROWS_BACK", "SET_ROWS", "DIAG",
    "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "SOFT_MAX_BACK", "ROPE", "ROPE_BACK", "CLAMP",
    "CONV_TRANSPOSE_1D", "IM2COL", "IM2COL_BACK", "IM2COL_3D", "COL2IM_1D", "CONV_2D", "CONV_3D",
    "CONV_2D_DW", "CONV_TRANSPOSE_2D", "POOL_1D", "POOL_2D", "POOL_2D_BACK", "UPSCALE", "PAD",
    "PAD_REFLECT_1D", "ROLL", "ARANGE", "TIMESTEP_EMBEDDING", "ARGSORT", "TOP_K", "LEAKY_RELU",
    "TRI", "FILL", "FLASH_ATTN_EXT", "FLASH_ATTN_BACK", "SSM_CONV", "SSM_SCAN", "WIN_PART",
    "WIN_UNPART", "GET_REL_POS", "ADD_REL_POS", "RWKV_WKV6", "GATED_LINEAR_ATTN", "RWKV_WKV7",
    "SOLVE_TRI", "GATED_DELTA_NET", "LIGHTNING_INDEXER", "DSV4_HC_COMB", "DSV4_HC_PRE",
    "DSV4_HC_POST", "UNARY", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3", "CUSTOM",
    "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK", "OPT_STEP_ADAMW", "OPT_STEP_SGD", "GLU",
)
assert len(GGML_OPS) == 101, "GGML_OP_COUNT of the vendored ggml is 101"
UNARY_OPS = 22  # GGML_UNARY_OP_COUNT
GLU_OPS = 7  # GGML_GLU_OP_COUNT


def op_name(op: int) -> str:
    return GGML_OPS[op] if 0 <= op < len(GGML_OPS) else f"op {op}"


class Tensor(NamedTuple):
    """One ``rpc_tensor`` as sent: ``buffer`` is the member's handle (0: none) and ``data`` an
    address in the member's memory, both as the head claims them."""

    id: int
    type: int
    buffer: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int
    op_params: tuple[int, ...]
    flags: int
    src: tuple[int, ...]
    view_src: int
    view_offs: int
    data: int
    name: bytes
    use_count: int


def parse_tensor(raw: bytes | bytearray | memoryview, offset: int = 0) -> Tensor:
    f = TENSOR.unpack_from(raw, offset)
    return Tensor(f[0], f[1], f[2], f[3:7], f[7:11], f[11], f[12:28], f[28], f[29:39],
                  f[39], f[40], f[41], f[42], f[43])


def nelements(t: Tensor) -> int:
    ne = t.ne
    return ne[0] * ne[1] * ne[2] * ne[3]


def row_bytes(type_id: int, n: int) -> int:
    """``ggml_row_size``: the bytes of ``n`` elements of a type packed densely."""
    info = TYPES[type_id]
    return info.size * n // info.block


def nbytes(t: Tensor) -> int:
    """``ggml_nbytes``: one past the last byte any element reaches (0 for an empty tensor)."""
    if 0 in t.ne:
        return 0
    info = TYPES[t.type]
    ne, nb = t.ne, t.nb
    first = info.size + (ne[0] - 1) * nb[0] if info.block == 1 else ne[0] * nb[0] // info.block
    return first + (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3]


def dense_bytes(t: Tensor) -> int:
    return row_bytes(t.type, nelements(t))


def extent(t: Tensor, pad: int = 0) -> int:
    """The bytes from ``t.data`` that a kernel may touch: ``pad`` is the row padding the
    member's backend keeps after a quantized tensor (see the module's docstring)."""
    return max(nbytes(t), dense_bytes(t)) + pad


def tensor_problem(t: Tensor) -> str | None:
    """Why ``t`` is not a tensor ggml could have made (None: it could): an unknown type, a
    quantized row that is not whole blocks, a stride below one element, unknown flags, an
    unterminated name, an op past ggml's list."""
    info = TYPES.get(t.type)
    if info is None:
        return f"unknown ggml type {t.type}"
    if info.block > 1 and (t.ne[0] % info.block or t.nb[0] != info.size):
        return (f"a {info.name} tensor's rows must be whole blocks of {info.block} "
                f"(ne0 {t.ne[0]}, nb0 {t.nb[0]})")
    if nelements(t) and min(t.nb) < info.size:
        return f"a stride below one {info.name} element ({min(t.nb)} bytes)"
    if t.flags & ~FLAGS:
        return f"unknown tensor flags {t.flags:#x}"
    if b"\0" not in t.name:
        return "a tensor name without its terminating NUL"
    if not 0 <= t.op < len(GGML_OPS):
        return f"unknown ggml op {t.op}"
    return None
