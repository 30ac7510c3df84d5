"""Which ggml ops a head may run on a member, and the shapes each must have (issue 34).

The list is what llama.cpp's transformer graphs use (``src/llama-graph.cpp`` and the common
``src/models``: llama, qwen, mistral, gemma, phi, gpt-oss, mixtral-style MoE): no custom op
(``GGML_OP_CUSTOM``, ``MAP_CUSTOM1..3`` carry function pointers in their parameters), no
training op, no convolution, state-space or image op. Views (``NONE``, ``RESHAPE``, ``VIEW``,
``PERMUTE``, ``TRANSPOSE``) run no kernel, so their own bounds are all that matters; every
other op runs a kernel that indexes one tensor by another's shape, and ggml's CPU kernels
check those relations with ``assert``, which a release build drops. So each compute node must
have the shape and type ggml's constructor (``ggml.c``) gives it from its sources, plus the
relations the kernels read past (a mask as wide as the keys, for instance): a graph ggml itself
could have built. Expert ids (``MUL_MAT_ID``, ``ADD_ID``) index weights with values the gate
cannot see, and the CPU kernel does not check them, so they must come from an ``ARGSORT`` or
``TOP_K`` computed earlier in the same graph over no more values than there are experts, and
nothing else may write there in between.

``node_problem`` is pure: the graph it asks about is a ``Graph`` (ids to tensors, and each
node's position).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from desktop_worker.groups.rpc_wire import (
    BF16,
    F16,
    F32,
    GGML_OPS,
    GLU_OPS,
    I32,
    I64,
    TYPES,
    UNARY_OPS,
    Tensor,
    extent,
    nelements,
)

__all__ = ["ALLOWED_OPS", "VIEW_OPS", "Graph", "chain_problem", "node_problem"]

Sources = tuple[Tensor | None, ...]


class Graph(Protocol):
    def tensor(self, tensor_id: int) -> Tensor | None: ...

    def position(self, tensor_id: int) -> int | None:
        """Where the tensor is in the graph's node list (None: a leaf)."""
        ...

    def node_at(self, position: int) -> Tensor: ...


Rule = Callable[[Tensor, Sources, Graph], str | None]
OP = {name: i for i, name in enumerate(GGML_OPS)}
VIEW_OPS = frozenset(OP[n] for n in ("NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"))


# --- ggml's shape predicates ---------------------------------------------------------------


def _contiguous(t: Tensor, n: int = 0) -> bool:
    """``ggml_is_contiguous_n``: dims above ``n`` packed, the rest may be strided."""
    info = TYPES[t.type]
    next_nb = info.size
    if t.ne[0] != info.block and t.nb[0] != next_nb:
        return False
    next_nb *= t.ne[0] // info.block
    for i in range(1, 4):
        if t.ne[i] != 1:
            if i > n:
                if t.nb[i] != next_nb:
                    return False
                next_nb *= t.ne[i]
            else:
                next_nb = t.ne[i] * t.nb[i]
    return True


def _rows(t: Tensor) -> bool:
    """``ggml_is_contiguous_rows``."""
    info = TYPES[t.type]
    return t.ne[0] == info.block or t.nb[0] == info.size


def _repeats(small: Tensor, big: Tensor) -> bool:
    """``ggml_can_repeat(small, big)``, with no empty ``small`` (nothing to divide by)."""
    return all(s > 0 and b % s == 0 for s, b in zip(small.ne, big.ne, strict=True))


def _shape(t: Tensor, ne: tuple[int, ...], what: str = "") -> str | None:
    if t.ne != tuple(ne):
        return f"shape {list(t.ne)}, ggml makes {list(ne)}{what}"
    return None


def _same(t: Tensor, a: Tensor) -> str | None:
    """``ggml_dup_tensor(a)`` or a view of it: a's shape and type."""
    if t.type != a.type:
        return f"type {TYPES[t.type].name}, its source is {TYPES[a.type].name}"
    return _shape(t, a.ne)


def _need(s: Sources, count: int) -> str | None:
    if any(x is None for x in s[:count]):
        return f"needs {count} source(s)"
    if any(x is not None for x in s[count:]):
        return f"takes at most {count} source(s)"
    return None


def _take(s: Sources, count: int) -> tuple[Tensor, ...] | str:
    """Exactly the first ``count`` sources, or why not."""
    problem = _need(s, count)
    return problem if problem is not None else tuple(x for x in s[:count] if x is not None)


def _first(*checks: Callable[[], str | None]) -> str | None:
    for check in checks:
        problem = check()
        if problem is not None:
            return problem
    return None


# --- the rules -------------------------------------------------------------------------------


def _unary_like(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 1)
    return got if isinstance(got, str) else _same(t, got[0])


def _unary(t: Tensor, s: Sources, g: Graph) -> str | None:
    if not 0 <= t.op_params[0] < UNARY_OPS:
        return f"unknown unary op {t.op_params[0]}"
    got = _take(s, 1)
    if isinstance(got, str):
        return got
    return _same(t, got[0]) or (None if _rows(got[0]) else "source rows not contiguous")


def _binary(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 2)
    if isinstance(got, str):
        return got
    a, b = got
    if not _repeats(b, a):
        return f"{list(b.ne)} does not repeat into {list(a.ne)}"
    if t.op == OP["ADD"] and t.type in (F32, F16, BF16):  # ggml_add_cast may change the type
        return _shape(t, a.ne)
    return _same(t, a)


def _copy(t: Tensor, s: Sources, g: Graph) -> str | None:
    """DUP, CONT: the elements of the source, any layout; CPY: into its destination."""
    got = _take(s, 2 if t.op == OP["CPY"] else 1)
    if isinstance(got, str):
        return got
    a = got[0]
    if nelements(t) != nelements(a):
        return f"{nelements(t)} elements from {nelements(a)}"
    if t.op == OP["CPY"]:
        return _same(t, got[1])
    if t.op == OP["DUP"]:
        return _same(t, a)
    return None if t.type == a.type else "CONT keeps its source's type"


def _norm(t: Tensor, s: Sources, g: Graph) -> str | None:
    return _unary_like(t, s, g)


def _fill(t: Tensor, s: Sources, g: Graph) -> str | None:
    if problem := _unary_like(t, s, g):
        return problem
    a = s[0]
    return (None if a is not None and a.type in (F32, F16) and _contiguous(a)
            else "FILL takes a packed f32/f16")


def _sum_rows(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 1)
    if isinstance(got, str):
        return got
    a, = got
    if t.op == OP["MEAN"] and t.type != F32:
        return "MEAN makes f32"
    if t.op == OP["SUM_ROWS"] and t.type != a.type:
        return "SUM_ROWS keeps its source's type"
    return _shape(t, (1, a.ne[1], a.ne[2], a.ne[3]))


def _repeat(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 1)
    if isinstance(got, str):
        return got
    a, = got
    if t.type != a.type:
        return "REPEAT keeps its source's type"
    return None if _repeats(a, t) else f"{list(a.ne)} does not repeat into {list(t.ne)}"


def _concat(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 2)
    if isinstance(got, str):
        return got
    a, b = got
    dim = t.op_params[0]
    if not 0 <= dim < 4 or a.type != b.type or t.type != a.type:
        return "CONCAT joins two tensors of its type along dims 0-3"
    ne = []
    for d in range(4):
        if d != dim and a.ne[d] != b.ne[d]:
            return f"CONCAT's sources differ in dim {d}"
        ne.append(a.ne[d] + b.ne[d] if d == dim else a.ne[d])
    return _shape(t, tuple(ne))


def _glu(t: Tensor, s: Sources, g: Graph) -> str | None:
    if not 0 <= t.op_params[0] < GLU_OPS or t.op_params[1] not in (0, 1):
        return f"unknown glu op {t.op_params[0]}"
    a, b = s[0], s[1]
    if a is None or any(x is not None for x in s[2:]):
        return "GLU takes one or two sources"
    if not _contiguous(a, 1):
        return "GLU's source rows must be packed"
    if b is None:
        return _first(lambda: None if t.type == a.type else "GLU keeps its type",
                      lambda: _shape(t, (a.ne[0] // 2, a.ne[1], a.ne[2], a.ne[3])))
    if not _contiguous(b, 1) or b.ne != a.ne or b.type != a.type:
        return "GLU's two sources must match"
    return _same(t, a)


def _mul_mat(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 2)
    if isinstance(got, str):
        return got
    a, b = got
    if a.ne[0] != b.ne[0] or b.ne[2] % max(a.ne[2], 1) or b.ne[3] % max(a.ne[3], 1):
        return f"cannot multiply {list(a.ne)} by {list(b.ne)}"
    if 0 in a.ne[2:] or a.nb[0] > a.nb[1]:
        return "MUL_MAT's first source is transposed or empty"
    if t.type != F32:
        return "MUL_MAT makes f32"
    return _shape(t, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]))


def _expert_ids(ids: Tensor, experts: int, t: Tensor, g: Graph) -> str | None:
    """Expert ids must be an ARGSORT or TOP_K of at most ``experts`` values, through views and
    copies computed in order before ``t`` in this graph, and no other node between the sort
    and ``t`` may write where any of them lies (a hostile graph could overwrite the ids)."""
    chain: list[Tensor] = []
    current: Tensor | None = ids
    while current is not None and len(chain) < 64:
        chain.append(current)
        if current.op in (OP["ARGSORT"], OP["TOP_K"]):
            break
        if current.op in (OP["CONT"], OP["CPY"]):
            follow = current.src[0]  # the values come from its source
        elif current.op in VIEW_OPS:
            follow = current.view_src or current.src[0]
        else:
            break
        current = g.tensor(follow) if follow else None
    sort = chain[-1]
    if sort.op not in (OP["ARGSORT"], OP["TOP_K"]):
        return "expert ids must come from an ARGSORT or TOP_K in the same graph"
    values = g.tensor(sort.src[0])
    if values is None or values.ne[0] > experts:
        return f"expert ids must sort at most {experts} values, one per expert"
    last = g.position(t.id)
    for step in chain:
        if step.op in VIEW_OPS:
            continue
        at = g.position(step.id)
        if at is None or last is None or at >= last:
            return "expert ids must be computed, in order, before they are used"
        last = at
    first, here = g.position(sort.id), g.position(t.id)
    if first is None or here is None:  # both found above
        return "expert ids must be computed before they are used"
    regions = [(step.data, step.data + extent(step)) for step in chain]
    steps = {step.id for step in chain}
    for i in range(first + 1, here):
        node = g.node_at(i)
        if node.id in steps or node.op in VIEW_OPS:
            continue
        low, high = node.data, node.data + extent(node)
        if any(low < end and start < high for start, end in regions):
            return f"node {i} writes over the expert ids before they are used"
    return None


def _mul_mat_id(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 3)
    if isinstance(got, str):
        return got
    a, b, ids = got
    if (ids.type != I32 or a.ne[3] != 1 or b.ne[3] != 1 or ids.ne[2:] != (1, 1)
            or ids.ne[1] != b.ne[2] or a.ne[0] != b.ne[0] or b.ne[1] == 0
            or ids.ne[0] % b.ne[1] or a.nb[0] > a.nb[1]):
        return f"MUL_MAT_ID cannot take {list(a.ne)}, {list(b.ne)}, ids {list(ids.ne)}"
    if t.type != F32:
        return "MUL_MAT_ID makes f32"
    return (_shape(t, (a.ne[1], ids.ne[0], b.ne[2], 1))
            or _expert_ids(ids, a.ne[2], t, g))


def _add_id(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 3)
    if isinstance(got, str):
        return got
    a, b, ids = got
    if (a.ne[0] != b.ne[0] or a.ne[1] != ids.ne[0] or a.ne[2] != ids.ne[1]
            or ids.type != I32):
        return f"ADD_ID cannot take {list(a.ne)}, {list(b.ne)}, ids {list(ids.ne)}"
    return _same(t, a) or _expert_ids(ids, b.ne[1], t, g)


def _get_rows(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 2)
    if isinstance(got, str):
        return got
    a, b = got
    if a.ne[2] != b.ne[1] or a.ne[3] != b.ne[2] or b.ne[3] != 1 or b.type != I32:
        return f"GET_ROWS cannot take {list(a.ne)} by {list(b.ne)}"
    if t.type != (I32 if a.type == I32 else F32):
        return "GET_ROWS makes f32"
    return _shape(t, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]))


def _set_rows(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 3)
    if isinstance(got, str):
        return got
    b, c, a = got  # values, row ids, destination (ggml's order)
    if (a.ne[0] != b.ne[0] or a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3] or b.ne[1] != c.ne[0]
            or c.ne[1] == 0 or c.ne[2] == 0 or b.ne[2] % c.ne[1] or b.ne[3] % c.ne[2]
            or c.ne[3] != 1):
        return f"SET_ROWS cannot put {list(b.ne)} by {list(c.ne)} into {list(a.ne)}"
    if b.type not in (F32, F16) or c.type not in (I64, I32):
        return "SET_ROWS takes f32/f16 rows and i32/i64 row ids"
    if not (_rows(a) and _rows(b) and _rows(t)):
        return "SET_ROWS's rows must be packed"
    return _same(t, a)


def _soft_max(t: Tensor, s: Sources, g: Graph) -> str | None:
    a, mask, sinks = s[0], s[1], s[2]
    if a is None or any(x is not None for x in s[3:]):
        return "SOFT_MAX takes a source, a mask and sinks"
    if not _contiguous(a):
        return "SOFT_MAX's source must be packed"
    if mask is not None and (
            mask.type not in (F16, F32) or not _contiguous(mask) or mask.ne[0] != a.ne[0]
            or mask.ne[1] < a.ne[1] or 0 in mask.ne[2:]
            or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]):
        return f"SOFT_MAX's mask {list(mask.ne)} does not cover {list(a.ne)}"
    if sinks is not None and (sinks.type != F32 or sinks.ne[0] != a.ne[2]):
        return "SOFT_MAX's sinks must be one f32 per head"
    return _same(t, a)


def _rope(t: Tensor, s: Sources, g: Graph) -> str | None:
    a, pos, factors = s[0], s[1], s[2]
    if a is None or pos is None or any(x is not None for x in s[3:]):
        return "ROPE takes a source, positions and frequency factors"
    n_dims, mode = t.op_params[1], t.op_params[2]
    if mode & 1 or not 0 < n_dims <= a.ne[0] or n_dims % 2:
        return f"ROPE mode {mode} over {n_dims} of {a.ne[0]} dims"
    if pos.type != I32 or pos.ne[1:] != (1, 1, 1):
        return "ROPE's positions must be one i32 vector"
    per_token = 4 if mode & 8 else 1  # GGML_ROPE_TYPE_MROPE: four positions per token
    if pos.ne[0] != a.ne[2] * per_token:
        return f"ROPE has {pos.ne[0]} positions for {a.ne[2]} tokens"
    if factors is not None and (factors.type != F32 or factors.ne[0] < n_dims // 2):
        return "ROPE's frequency factors must be f32, one per rotated pair"
    return _same(t, a)


def _flash_attn(t: Tensor, s: Sources, g: Graph) -> str | None:
    q, k, v, mask, sinks = s[0], s[1], s[2], s[3], s[4]
    if q is None or k is None or v is None or any(x is not None for x in s[5:]):
        return "FLASH_ATTN_EXT takes q, k, v, a mask and sinks"
    if (q.ne[0] != k.ne[0] or 0 in k.ne[2:] or 0 in v.ne[2:] or q.ne[2] % k.ne[2]
            or q.ne[2] % v.ne[2] or q.ne[3] != k.ne[3] or q.ne[3] != v.ne[3]
            or v.ne[1] != k.ne[1]):
        return f"FLASH_ATTN_EXT cannot take q {list(q.ne)}, k {list(k.ne)}, v {list(v.ne)}"
    if mask is not None and (
            mask.type != F16 or not _contiguous(mask) or mask.ne[0] < k.ne[1]
            or mask.ne[1] < q.ne[1] or 0 in mask.ne[2:]
            or q.ne[2] % mask.ne[2] or q.ne[3] % mask.ne[3]):
        return f"FLASH_ATTN_EXT's mask {list(mask.ne)} does not cover its keys and queries"
    if sinks is not None and (sinks.type != F32 or sinks.ne[0] != q.ne[2]):
        return "FLASH_ATTN_EXT's sinks must be one f32 per head"
    if t.type != F32:
        return "FLASH_ATTN_EXT makes f32"
    return _shape(t, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]))


def _argsort(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 1)
    if isinstance(got, str):
        return got
    a, = got
    if t.type != I32:
        return f"{GGML_OPS[t.op]} makes i32"
    if t.op == OP["ARGSORT"]:
        return _shape(t, a.ne) or (None if t.op_params[0] in (0, 1) else "unknown sort order")
    return _shape(t, (t.ne[0], a.ne[1], a.ne[2], a.ne[3])) or (
        None if t.ne[0] <= a.ne[0] else "TOP_K picks more than it sorts")


def _argmax(t: Tensor, s: Sources, g: Graph) -> str | None:
    got = _take(s, 1)
    if isinstance(got, str):
        return got
    a, = got
    if a.ne[2:] != (1, 1) or t.type != I32:
        return "ARGMAX takes a matrix and makes i32"
    return _shape(t, (a.ne[1], 1, 1, 1))


def _scale(t: Tensor, s: Sources, g: Graph) -> str | None:
    return _unary_like(t, s, g)


RULES: dict[int, Rule] = {
    OP["DUP"]: _copy, OP["CONT"]: _copy, OP["CPY"]: _copy,
    OP["ADD"]: _binary, OP["SUB"]: _binary, OP["MUL"]: _binary, OP["DIV"]: _binary,
    OP["ADD_ID"]: _add_id,
    OP["SQR"]: _unary_like, OP["SQRT"]: _unary_like, OP["CLAMP"]: _unary_like,
    OP["SCALE"]: _scale, OP["NORM"]: _norm, OP["RMS_NORM"]: _norm, OP["L2_NORM"]: _norm,
    OP["FILL"]: _fill, OP["UNARY"]: _unary, OP["GLU"]: _glu,
    OP["SUM_ROWS"]: _sum_rows, OP["MEAN"]: _sum_rows, OP["ARGMAX"]: _argmax,
    OP["REPEAT"]: _repeat, OP["CONCAT"]: _concat,
    OP["MUL_MAT"]: _mul_mat, OP["MUL_MAT_ID"]: _mul_mat_id,
    OP["GET_ROWS"]: _get_rows, OP["SET_ROWS"]: _set_rows,
    OP["SOFT_MAX"]: _soft_max, OP["ROPE"]: _rope, OP["FLASH_ATTN_EXT"]: _flash_attn,
    OP["ARGSORT"]: _argsort, OP["TOP_K"]: _argsort,
}
ALLOWED_OPS = VIEW_OPS | frozenset(RULES)


def chain_problem(tensors: dict[int, Tensor], limit: int) -> str | None:
    """Why a graph's chains of sources cannot be followed (None: they can): longer than
    ``limit`` (llama.cpp's server follows them recursively, on its stack) or a cycle. A tensor
    may name itself: ``ggml_cast`` does."""
    depth: dict[int, int] = {}
    for root in tensors:
        stack: list[tuple[int, bool]] = [(root, False)]
        open_: set[int] = set()  # the path being followed
        while stack:
            tid, done = stack.pop()
            t = tensors[tid]
            links = [s for s in (*t.src, t.view_src) if s and s != tid]
            if done:
                open_.discard(tid)
                depth[tid] = 1 + max((depth[s] for s in links), default=0)
                if depth[tid] > limit:
                    return f"sources chained deeper than {limit}"
                continue
            if tid in depth:
                continue
            open_.add(tid)
            stack.append((tid, True))
            for s in links:
                if s in open_:
                    return "the sources form a cycle"
                if s not in depth:
                    stack.append((s, False))
    return None


def node_problem(t: Tensor, sources: Sources, graph: Graph) -> str | None:
    """Why compute node ``t`` (its ``sources`` resolved from ``t.src``) is not one ggml could
    have built, or None. Views check nothing here: they run no kernel."""
    if t.op in VIEW_OPS:
        return None
    rule = RULES.get(t.op)
    if rule is None:
        return f"op {GGML_OPS[t.op]} is not allowed"
    return rule(t, sources, graph)
