"""A model group's answers are audited (issue 39): by a trusted auditor whose memory holds the
model whole (never by a worker of the group), a failing verdict counts against the head, and a
member is named only by failing groups under two different heads. A real queen and real
websockets; the group is the queen's view of one (``GroupsForAudits``), the auditor scripted."""

from __future__ import annotations

from typing import Any

from queen_server.audits.cases import case_for
from tests.queen_server.audits.test_service import PROMPT_TOKENS, Auditor, settings
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ECHO_SHA256, ScriptedWorker

NEED_BYTES = 48 * 1024 * 1024  # what the group's plan says the model needs held whole
ANSWER = "one two three four"


class OneGroup:
    """The queen's groups as audits see them: one ready group of the echo model."""

    def __init__(self, head: Any, keys: tuple[str, ...]) -> None:
        self.head, self.keys = head, keys

    def need_bytes(self, model: str) -> int | None:
        return NEED_BYTES if model == ECHO_MODEL else None

    def heads(self, model: str) -> list[tuple[Any, tuple[str, ...]]]:
        return [(self.head, self.keys)] if model == ECHO_MODEL and self.head else []


def group_case(request_id: str, head: str, members: tuple[str, ...]):
    case = case_for(request_id=request_id, model=ECHO_MODEL, sha256=ECHO_SHA256,
                    worker_url="/v1/chat/completions",
                    worker_req={"model": ECHO_MODEL, "temperature": 0.0,
                                "messages": [{"role": "user", "content": "count"}]},
                    worker_key=head, answer=ANSWER, claimed_completion_tokens=4,
                    claimed_prompt_tokens=PROMPT_TOKENS, finish_reason="length",
                    group=(head, *members))
    assert case is not None
    return case


async def trusted(queen, memory_mb: int, **kwargs: Any) -> Auditor:
    auditor = await Auditor(queen.ws_url, audit_only=True, **kwargs).start()
    queen.state.audits.trusted = queen.state.audits.trusted | {auditor.pubkey}
    queen.state.audits._trusted_keys.add(auditor.pubkey)
    queen.state.registry.get(auditor.pubkey).memory_budget_mb = memory_mb  # its hello's claim
    return auditor


async def test_a_trusted_auditor_with_the_memory_audits_a_groups_answer(tmp_path):
    async with running_queen(tmp_path, **settings(audit_max_wait_s=0.5)) as queen:
        head = await ScriptedWorker(queen.ws_url, continues=True).start()
        audits = queen.state.audits
        audits.groups = OneGroup(queen.state.registry.get(head.pubkey),
                                 (head.pubkey, "member-a", "member-b"))
        small = await trusted(queen, memory_mb=16)  # cannot hold the model: asked nothing
        assert audits.consider(group_case("req-small", head.pubkey, ("member-a", "member-b")))
        await queen.wait_until(lambda: audits.idle, 5, "the case expired")
        assert small.scored == []
        big = await trusted(queen, memory_mb=64)
        assert audits.consider(group_case("req-big", head.pubkey, ("member-a", "member-b")))
        await queen.wait_until(lambda: audits.idle, 5, "audited")
        assert [job.openai_req["answer"] for job in big.scored] == [ANSWER]
        assert small.scored == []
        assert audits.standing(head.pubkey).audited == 1  # the head's standing bears it
        for worker in (head, small, big):
            await worker.stop()


async def test_a_failing_group_blames_its_head_and_names_a_member_only_under_two_heads(
        tmp_path):
    async with running_queen(tmp_path, **settings()) as queen:
        first = await ScriptedWorker(queen.ws_url, continues=True).start()
        second = await ScriptedWorker(queen.ws_url, continues=True).start()
        audits = queen.state.audits
        audits.groups = OneGroup(None, ())
        auditor = await trusted(queen, memory_mb=64, honest=False)  # every answer fails
        assert audits.consider(group_case("req-1", first.pubkey, ("shared", "only-first")))
        await queen.wait_until(lambda: audits.idle, 5, "audited")
        assert audits.standing(first.pubkey).failed == 1
        assert audits.standing("shared").audited == 0  # a member's standing is not moved
        assert audits.named == set()  # one head's failing group names no member
        assert audits.consider(group_case("req-2", first.pubkey, ("shared", "only-first")))
        await queen.wait_until(lambda: audits.idle, 5, "audited")
        assert audits.named == set()  # the same head again: still none
        assert audits.consider(group_case("req-3", second.pubkey, ("shared", "only-second")))
        await queen.wait_until(lambda: audits.idle, 5, "audited")
        assert audits.named == {"shared"}  # in failing groups under two heads
        assert audits.rate("shared") >= queen.state.settings.audit_new_rate
        assert queen.state.groups.named_by_audits("shared")  # it joins no group now
        assert not queen.state.groups.named_by_audits("only-first")
        assert len(auditor.scored) == 3
        for worker in (first, second, auditor):
            await worker.stop()
