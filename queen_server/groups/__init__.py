"""Model groups (issue 19): one model served by several workers through llama.cpp's RPC backend.

``planner`` is the pure decision: which workers form a group for a model no single one can
hold, which of them is the head, and which contiguous layers each holds. It imports only the
standard library and ``shared_schema``.
"""

from queen_server.groups.planner import (
    Candidate,
    GroupPlan,
    MemberPlan,
    NoPlan,
    NoPlanReason,
    Route,
    plan_group,
    usable_mb,
)

__all__ = [
    "Candidate",
    "GroupPlan",
    "MemberPlan",
    "NoPlan",
    "NoPlanReason",
    "Route",
    "plan_group",
    "usable_mb",
]
