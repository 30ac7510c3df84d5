"""The validating gate's core on its own (issue 34): ``RpcGuard`` fed the bytes of llama.cpp's
RPC protocol 7.0.0 as an honest head and a hostile one would send them, and the member's replies
as its server sends them. Pure: no socket, no server (``test_hostile_head.py`` has those)."""

from __future__ import annotations

import ctypes
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from desktop_worker.errors import RpcRefused
from desktop_worker.groups.rpc_guard import GuardLimits, GuardPolicy, MemberFacts, RpcGuard
from desktop_worker.groups.rpc_wire import GGML_OPS, TYPES, parse_tensor
from tests.desktop_worker.groups.rpc_script import (
    F16,
    F32,
    I32,
    OP,
    Q4_0,
    alloc,
    command,
    copy_tensor,
    device_count,
    free,
    get_base,
    get_tensor,
    graph,
    hello,
    init_tensor,
    recompute,
    reply,
    set_tensor,
    tensor,
)

SHARE = 1 << 20  # 1 MiB on device 0
HANDLE, BASE = 0x5000, 0x7F00_0000_0000
HELLO_REPLY = reply(bytes((7, 0, 0, 0)) + bytes(24))


def passed(chunks: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


class Session:
    """A guard and the member's side of the conversation, for one connection."""

    def __init__(self, share: int = SHARE, limits: GuardLimits | None = None,
                 facts: MemberFacts | None = None) -> None:
        self.guard = RpcGuard(GuardPolicy((share,), limits or GuardLimits()), facts)

    def head(self, data: bytes) -> bytes:
        out = passed(self.guard.from_head(data))
        assert out == data  # what passes, passes unchanged
        return out

    def member(self, data: bytes) -> bytes:
        out = passed(self.guard.from_member(data))
        assert out == data
        return out

    def hello(self) -> Session:
        self.head(hello())
        self.member(HELLO_REPLY)
        return self

    def buffer(self, size: int = 4096, handle: int = HANDLE, base: int = BASE) -> Session:
        self.head(alloc(size))
        self.member(reply(struct.pack("<QQ", handle, size)))
        self.head(get_base(handle))
        self.member(reply(struct.pack("<Q", base)))
        return self


def refused(session: Session, data: bytes) -> RpcRefused:
    with pytest.raises(RpcRefused) as caught:
        session.guard.from_head(data)
    assert caught.value.by == "head"
    return caught.value


def floats(n: int, *, at: int = 0, tid: int = 1, **fields: object) -> bytes:
    return tensor(tid, buffer=HANDLE, data=BASE + at, ne=(n,), **fields)  # type: ignore[arg-type]


# --- the tables are the build's -------------------------------------------------------------


def test_types_and_ops_are_those_of_the_llama_cpp_this_project_builds() -> None:
    import llama_cpp.llama_cpp as bindings  # the real library, read through ctypes

    lib = bindings._lib
    block, size, op_name = lib.ggml_blck_size, lib.ggml_type_size, lib.ggml_op_name
    block.restype, block.argtypes = ctypes.c_int64, [ctypes.c_int]
    size.restype, size.argtypes = ctypes.c_size_t, [ctypes.c_int]
    op_name.restype, op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    live = {t: (block(t), size(t)) for t in range(43) if block(t) > 0}
    assert live == {t: (info.block, info.size) for t, info in TYPES.items()}
    assert [op_name(i).decode() for i in range(len(GGML_OPS))] == list(GGML_OPS)


# --- an honest head ---------------------------------------------------------------------------


def test_an_honest_conversation_passes_byte_for_byte_and_is_counted() -> None:
    s = Session().hello()
    s.head(device_count())
    s.member(reply(struct.pack("<I", 1)))
    s.buffer(4096)
    assert s.guard.allocated == [4096]
    assert s.guard.buffers == 1
    data = bytes(range(256))
    s.head(set_tensor(floats(64), data))
    s.head(get_tensor(floats(64), 0, 256))
    s.member(reply(data))
    s.head(free(HANDLE))
    assert s.guard.allocated == [0]
    assert s.guard.buffers == 0


def test_a_large_payload_passes_as_slices_of_what_was_read_not_copies() -> None:
    s = Session().hello().buffer(4096)
    message = set_tensor(floats(1024), b"\xab" * 4096)
    head, payload = message[:400], message[400:]
    first = s.guard.from_head(head)
    assert passed(first) == head
    assert len(first) == 2
    assert isinstance(first[1], memoryview)
    assert first[1].obj is head
    chunks = s.guard.from_head(payload)
    assert len(chunks) == 1
    assert isinstance(chunks[0], memoryview)
    assert chunks[0].obj is payload  # the very bytes read, not a copy
    s.head(get_tensor(floats(1024), 0, 4096))
    answer = reply(b"\xab" * 4096)
    back = s.guard.from_member(answer)
    assert passed(back) == answer
    assert back[1].obj is answer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=40))
def test_any_chunking_of_an_honest_stream_passes_it_unchanged(cuts: list[int]) -> None:
    """TCP cuts a stream anywhere: the guard's output is the input, however it arrives."""
    s = Session().hello().buffer(4096)
    stream = (set_tensor(floats(64), bytes(256)) + init_tensor(floats(64))
              + set_tensor(floats(8, at=64), bytes(range(32)), offset=0))
    out, pos = bytearray(), 0
    for cut in cuts:
        out += passed(s.guard.from_head(stream[pos:pos + cut]))
        pos += cut
    out += passed(s.guard.from_head(stream[pos:]))
    assert bytes(out) == stream


# --- protocol and version -----------------------------------------------------------------------


@pytest.mark.parametrize(("first", "code"), [
    (command(14, b""), "bad_version"),  # protocol 3's HELLO: no transport caps
    (command(14, bytes(20)), "bad_version"),
    (hello(caps=b"\x01" + bytes(23)), "transport"),  # RDMA would carry bytes past the gate
    (device_count(), "no_hello"),
    (bytes((0xEE,)) + bytes(8), "unknown_command"),
    (command(18, b""), "unknown_command"),  # RPC_CMD_NONE is never sent
])
def test_the_first_command_must_be_protocol_7s_hello(first: bytes, code: str) -> None:
    assert refused(Session(), first).code == code


def test_a_member_of_another_protocol_version_is_refused_at_hello() -> None:
    s = Session()
    s.head(hello())
    with pytest.raises(RpcRefused) as caught:
        s.guard.from_member(reply(bytes((6, 1, 0, 0)) + bytes(24)))
    assert (caught.value.code, caught.value.by) == ("bad_version", "member")


def test_hello_comes_once_and_commands_wait_for_their_reply() -> None:
    assert refused(Session().hello(), hello()).code == "forbidden_command"
    s = Session().hello()
    s.head(device_count())
    assert refused(s, device_count()).code == "pipelined"


def test_a_reply_nobody_asked_for_or_of_the_wrong_size_is_the_members_fault() -> None:
    s = Session().hello()
    with pytest.raises(RpcRefused) as caught:
        s.guard.from_member(reply(b"1234"))
    assert caught.value.by == "member"
    s.head(device_count())
    with pytest.raises(RpcRefused, match="expected 4"):
        s.guard.from_member(reply(b"12345678"))


def test_fixed_size_commands_must_have_their_exact_size() -> None:
    s = Session().hello()
    assert refused(s, command(0, bytes(13))).code == "bad_size"  # ALLOC_BUFFER is 12


# --- the share --------------------------------------------------------------------------------


def test_allocation_past_the_share_is_refused_and_freeing_gives_it_back() -> None:
    s = Session().hello().buffer(SHARE // 2)
    error = refused(s, alloc(SHARE // 2 + 1))
    assert (error.command, error.code) == ("ALLOC_BUFFER", "over_share")
    s = Session().hello().buffer(SHARE // 2)
    s.head(free(HANDLE))
    s.buffer(SHARE, handle=HANDLE + 1)  # the whole share again
    assert s.guard.allocated == [SHARE]


def test_a_failed_allocation_gives_its_reservation_back() -> None:
    s = Session().hello()
    s.head(alloc(SHARE))
    s.member(reply(bytes(16)))  # handle 0: the server could not
    assert s.guard.allocated == [0]
    s.buffer(SHARE)


def test_a_device_past_the_members_is_refused() -> None:
    assert refused(Session().hello(), alloc(16, device=1)).code == "bad_device"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=SHARE)),
                max_size=30))
def test_live_buffers_never_exceed_the_share(steps: list[tuple[bool, int]]) -> None:
    s = Session().hello()
    live: dict[int, int] = {}
    handle = 0x1000
    for allocate, size in steps:
        if allocate or not live:
            if sum(live.values()) + size > SHARE:
                assert refused(s, alloc(size)).code == "over_share"
                return
            handle += 0x10
            s.buffer(size, handle=handle)
            live[handle] = size
        else:
            victim = next(iter(live))
            s.head(free(victim))
            del live[victim]
        assert s.guard.allocated == [sum(live.values())] <= [SHARE]


# --- tensors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("message", "code"), [
    (set_tensor(floats(16, at=4096 - 32), bytes(64)), "out_of_bounds"),  # past the buffer
    (set_tensor(tensor(1, buffer=HANDLE, data=BASE - 64, ne=(16,)), bytes(64)), "out_of_bounds"),
    (set_tensor(floats(16), bytes(68)), "out_of_bounds"),  # more than the tensor holds
    (set_tensor(floats(16), bytes(8), offset=60), "out_of_bounds"),
    (set_tensor(floats(16), b""), "out_of_bounds"),
    (get_tensor(floats(16), 32, 64), "out_of_bounds"),
    (copy_tensor(floats(32), floats(16, at=1024, tid=2)), "out_of_bounds"),
    (set_tensor(tensor(1, buffer=0x9999, data=BASE, ne=(4,)), bytes(16)), "unknown_buffer"),
    (set_tensor(tensor(1, data=BASE, ne=(4,)), bytes(16)), "no_buffer"),
    (init_tensor(tensor(1, type_=4, buffer=HANDLE, data=BASE)), "bad_tensor"),  # Q4_2: gone
    (init_tensor(tensor(1, type_=Q4_0, buffer=HANDLE, data=BASE, ne=(33,))), "bad_tensor"),
    (init_tensor(floats(4, nb=(0, 16, 16, 16))), "bad_tensor"),  # a stride below one element
    (init_tensor(floats(4, name=b"x" * 64)), "bad_tensor"),  # no NUL
    (init_tensor(floats(4, op=OP["CUSTOM"])), "forbidden_op"),
    # strides whose product wraps around 64 bits in C
    (init_tensor(tensor(1, buffer=HANDLE, data=BASE, ne=(2, 2**31, 2**31, 8),
                        nb=(4, 2**31, 2**31, 2**31))), "out_of_bounds"),
    (set_tensor(floats(4), bytes(16), flag=2), "bad_message"),
])
def test_a_tensor_or_range_outside_this_connections_buffers_is_refused(
        message: bytes, code: str) -> None:
    assert refused(Session().hello().buffer(4096), message).code == code


def test_a_tensor_in_a_buffer_whose_base_was_never_asked_is_refused() -> None:
    s = Session().hello()
    s.head(alloc(4096))
    s.member(reply(struct.pack("<QQ", HANDLE, 4096)))
    assert refused(s, init_tensor(floats(4))).code == "unknown_buffer"


def test_a_freed_buffer_is_gone() -> None:
    s = Session().hello().buffer()
    s.head(set_tensor(floats(4), bytes(16)))  # checked once (and remembered as checked)
    s.head(free(HANDLE))
    assert refused(s, set_tensor(floats(4), bytes(16))).code == "unknown_buffer"
    assert refused(Session().hello().buffer(), free(HANDLE + 1)).code == "unknown_buffer"


def _elements(ne: tuple[int, ...], nb: tuple[int, ...]) -> list[int]:
    """Every element's offset, by brute force (the oracle ``extent`` must cover)."""
    offsets = [0]
    for n, stride in zip(ne, nb, strict=True):
        offsets = [o + i * stride for o in offsets for i in range(n)]
    return offsets


@settings(max_examples=200, deadline=None)
@given(ne=st.tuples(*[st.integers(1, 6)] * 4), nb=st.tuples(*[st.integers(0, 300)] * 4),
       at=st.integers(0, 4096), type_=st.sampled_from([F32, F16, I32]))
def test_whatever_tensor_passes_has_every_element_inside_its_buffer(
        ne: tuple[int, ...], nb: tuple[int, ...], at: int, type_: int) -> None:
    s = Session().hello().buffer(4096)
    t = tensor(1, type_=type_, buffer=HANDLE, data=BASE + at, ne=ne, nb=nb)
    size = TYPES[type_].size
    try:
        s.guard.from_head(init_tensor(t))
    except RpcRefused:
        return
    for offset in _elements(ne, nb):
        assert at + offset >= 0
        assert at + offset + size <= 4096
    assert at + size * ne[0] * ne[1] * ne[2] * ne[3] <= 4096  # read as if packed, too


def test_a_cuda_style_padded_weight_needs_its_padding_inside_the_buffer() -> None:
    """A quantized row not a multiple of 512 is padded by CUDA (INIT_TENSOR zeroes the
    padding): unless the member said it pads nothing, the padding must fit in the buffer."""
    q = tensor(1, type_=Q4_0, buffer=HANDLE, data=BASE, ne=(576, 2))  # 2 rows of 18 blocks
    nbytes = 2 * 18 * 18
    assert refused(Session().hello().buffer(nbytes), init_tensor(q)).code == "out_of_bounds"
    facts = MemberFacts()  # what the member's server answered GET_ALLOC_SIZE: no padding
    s = Session(facts=facts).hello()
    s.head(command(13, struct.pack("<I", 0) + tensor(9, type_=Q4_0, ne=(576, 2))
                   + bytes(296 * 10)))
    s.member(reply(struct.pack("<Q", nbytes)))
    s.buffer(nbytes)
    s.head(init_tensor(q))


# --- graphs ----------------------------------------------------------------------------------


def _mul_mat_graph(*, node_ne: tuple[int, ...] = (4, 1), op: int = OP["MUL_MAT"],
                   extra: bytes = b"") -> bytes:
    a = tensor(1, buffer=HANDLE, data=BASE, ne=(8, 4), name=b"w")
    b = tensor(2, buffer=HANDLE, data=BASE + 128, ne=(8, 1), name=b"x")
    out = tensor(3, buffer=HANDLE, data=BASE + 160, ne=node_ne, op=op, src=(1, 2),
                 name=b"y")
    return graph([3], [a, b, out])


def test_an_honest_graph_passes_and_may_be_recomputed_until_a_buffer_is_freed() -> None:
    s = Session().hello().buffer(4096)
    s.head(_mul_mat_graph())
    s.head(recompute())
    s.head(recompute())
    s.buffer(64, handle=HANDLE + 1, base=BASE + 8192)
    s.head(free(HANDLE + 1))
    assert refused(s, recompute()).code == "no_graph"  # GRAPH_RECOMPUTE's use-after-free


def test_recompute_before_any_graph_is_refused() -> None:
    assert refused(Session().hello().buffer(), recompute()).code == "no_graph"


@pytest.mark.parametrize("op", ["CUSTOM", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3",
                                "OPT_STEP_ADAMW", "CROSS_ENTROPY_LOSS", "SSM_SCAN", "IM2COL"])
def test_ops_off_the_list_are_refused_in_a_graph(op: str) -> None:
    s = Session().hello().buffer(4096)
    error = refused(s, _mul_mat_graph(op=OP[op]))
    assert (error.command, error.code) == ("GRAPH_COMPUTE", "forbidden_op")
    assert op in str(error)


def test_a_node_of_the_wrong_shape_is_refused() -> None:
    """MUL_MAT of [8,4] by [8,1] is [4,1]; a bigger node would be written past its kernel."""
    error = refused(Session().hello().buffer(4096), _mul_mat_graph(node_ne=(8, 1)))
    assert error.code == "bad_shape"


def test_get_rows_writing_past_its_destination_is_refused() -> None:
    """ggml's CPU kernel checks these shapes only with ``assert`` (gone in release builds)."""
    src = tensor(1, buffer=HANDLE, data=BASE, ne=(8, 4), name=b"rows")
    ids = tensor(2, type_=I32, buffer=HANDLE, data=BASE + 128, ne=(3,), name=b"ids")
    out = tensor(3, buffer=HANDLE, data=BASE + 256, ne=(4, 3), op=OP["GET_ROWS"], src=(1, 2))
    assert refused(Session().hello().buffer(4096), graph([3], [src, ids, out])).code == "bad_shape"


@pytest.mark.parametrize(("nodes", "tensors", "code"), [
    ([0], [tensor(1, buffer=HANDLE, data=BASE)], "bad_graph"),  # a null node crashes compute
    ([3], [tensor(3, buffer=HANDLE, data=BASE, op=OP["ADD"], src=(1, 2))], "bad_graph"),
    ([1, 1], [tensor(1, buffer=HANDLE, data=BASE)], "bad_graph"),
    ([1], [tensor(1, buffer=HANDLE, data=BASE), tensor(1, buffer=HANDLE, data=BASE)],
     "bad_graph"),
    ([1], [tensor(1, data=0)], "no_buffer"),
    ([2], [tensor(1, buffer=HANDLE, data=BASE, ne=(4,)),
           tensor(2, buffer=HANDLE, data=BASE + 64, ne=(4,), op=OP["VIEW"], view_src=1)],
     "bad_graph"),  # a view not where its source is
    ([1, 2], [tensor(1, buffer=HANDLE, data=BASE, op=OP["ADD"], src=(2, 2)),
              tensor(2, buffer=HANDLE, data=BASE, op=OP["ADD"], src=(1, 1))], "bad_graph"),
])
def test_malformed_graphs_are_refused(nodes: list[int], tensors: list[bytes], code: str) -> None:
    assert refused(Session().hello().buffer(4096), graph(nodes, tensors)).code == code


def test_a_huge_graph_is_refused_from_its_header_before_its_body_arrives() -> None:
    s = Session().hello().buffer(4096)
    header = bytes((10,)) + struct.pack("<Q", 1 << 40)
    assert refused(s, header).code == "graph_too_large"


def test_more_nodes_or_a_deeper_chain_than_allowed_is_refused() -> None:
    limits = GuardLimits(max_graph_nodes=8, max_graph_tensors=16, max_graph_depth=5)
    x = [tensor(1, buffer=HANDLE, data=BASE, ne=(4,))]
    chain = x + [tensor(i, buffer=HANDLE, data=BASE + 16 * i, ne=(4,), op=OP["SQR"],
                        src=(i - 1,)) for i in range(2, 8)]
    s = Session(limits=limits).hello().buffer(4096)
    assert refused(s, graph(list(range(2, 8)), chain)).code == "graph_too_large"  # depth 7
    s = Session(limits=limits).hello().buffer(4096)
    s.head(graph(list(range(2, 6)), chain[:5]))  # depth 5
    nine = x + [tensor(i, buffer=HANDLE, data=BASE + 16 * i, ne=(4,), op=OP["SQR"], src=(1,))
                for i in range(2, 11)]
    s = Session(limits=limits).hello().buffer(4096)
    assert refused(s, graph(list(range(2, 11)), nine)).code == "graph_too_large"


EXPERTS = tensor(1, buffer=HANDLE, data=BASE, ne=(8, 2, 4), name=b"experts")
X = tensor(2, buffer=HANDLE, data=BASE + 1024, ne=(8, 1, 1), name=b"x")
ROUTER = tensor(3, buffer=HANDLE, data=BASE + 1100, ne=(4, 1), name=b"router")
SORT = tensor(4, type_=I32, buffer=HANDLE, data=BASE + 1200, ne=(4, 1), op=OP["ARGSORT"],
              src=(3,), op_params=(1,))
IDS = tensor(5, type_=I32, buffer=HANDLE, data=BASE + 1200, ne=(2, 1), nb=(4, 16, 16, 16),
             op=OP["VIEW"], view_src=4)
MOE = tensor(6, buffer=HANDLE, data=BASE + 1300, ne=(2, 2, 1), op=OP["MUL_MAT_ID"],
             src=(1, 2, 5))


def test_expert_ids_sorted_earlier_in_the_same_graph_pass() -> None:
    Session().hello().buffer(4096).head(graph([4, 6], [EXPERTS, X, ROUTER, SORT, IDS, MOE]))


@pytest.mark.parametrize(("nodes", "tensors", "why"), [
    # ids the head wrote itself (MUL_MAT_ID's CPU kernel does not check them)
    ([6], [EXPERTS, X, tensor(5, type_=I32, buffer=HANDLE, data=BASE + 1200, ne=(2, 1)), MOE],
     "ARGSORT"),
    ([6, 4], [EXPERTS, X, ROUTER, SORT, IDS, MOE], "before"),  # sorted after their use
    # sorted, then overwritten by a node writing where the ids are
    ([4, 7, 6], [EXPERTS, X, ROUTER, SORT, IDS, MOE,
                 tensor(7, type_=I32, buffer=HANDLE, data=BASE + 1200, ne=(4,), op=OP["SQR"],
                        src=(7,))], "writes over"),
    # a sort of more values (4) than there are experts (3)
    ([4, 6], [X, ROUTER, SORT, IDS,
              tensor(6, buffer=HANDLE, data=BASE + 1300, ne=(2, 2, 1), op=OP["MUL_MAT_ID"],
                     src=(8, 2, 5)),
              tensor(8, buffer=HANDLE, data=BASE, ne=(8, 2, 3), name=b"3 experts")],
     "at most 3"),
])
def test_expert_ids_the_head_could_choose_are_refused(
        nodes: list[int], tensors: list[bytes], why: str) -> None:
    """MUL_MAT_ID's CPU kernel indexes the experts by ids it does not check."""
    error = refused(Session().hello().buffer(4096), graph(nodes, tensors))
    assert error.code == "bad_shape"
    assert why in str(error)


def test_an_argsort_node_smaller_than_its_source_is_refused() -> None:
    small = tensor(4, type_=I32, buffer=HANDLE, data=BASE + 1200, ne=(2, 1), op=OP["ARGSORT"],
                   src=(3,))
    assert refused(Session().hello().buffer(4096), graph([4], [ROUTER, small])).code == "bad_shape"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=2000))
def test_garbage_is_refused_or_passed_whole_never_a_crash(garbage: bytes) -> None:
    """Random bytes after HELLO: the guard raises nothing but ``RpcRefused``, and passes on
    only a prefix of what it was given."""
    s = Session().hello().buffer(4096)
    try:
        out = passed(s.guard.from_head(garbage))
    except RpcRefused:
        return
    assert garbage.startswith(out)


def test_a_parsed_tensor_round_trips_its_fields() -> None:
    raw = tensor(7, type_=F16, buffer=3, data=99, ne=(2, 3), op=OP["ROPE"], src=(4, 5),
                 op_params=(0, 64, 2), name=b"k")
    t = parse_tensor(raw)
    assert (t.id, t.type, t.buffer, t.data, t.ne, t.op, t.src[:3], t.op_params[:3]) == (
        7, F16, 3, 99, (2, 3, 1, 1), OP["ROPE"], (4, 5, 0), (0, 64, 2))
