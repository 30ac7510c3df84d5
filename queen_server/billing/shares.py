"""Crediting a model group's answer (issue 19): the developer pays once; the workers of the
group that served it share the worker's part by the layers each held.

Pure: ``split_parts`` takes the answer's parts (one per worker that delivered some of it, as
failover already makes them; a group head's part carries the shares its group had when the
head was given the job, ``swarm.jobs.Credit``) and returns them with each group head's part
replaced by one per member. Token counts are split by the largest remainder, so the sums (what
the developer is charged for) never change. Shares are taken when the job starts, not when the
books close: a group that ends (or re-forms with other members, after a failover) before the
answer is settled still credits the workers that did the work.
"""

from __future__ import annotations

from collections.abc import Sequence

from queen_server.swarm.jobs import Part, Shares

__all__ = ["Shares", "apportion", "split_parts"]


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (non-negative, some positive), in whole
    units summing to ``total``: floors first, then one more each to the largest remainders
    (the earlier on a tie)."""
    if total < 0:
        raise ValueError("cannot split a negative total")
    clean = [max(0, int(w)) for w in weights]
    whole = sum(clean)
    if whole == 0:
        raise ValueError("the weights hold nothing")
    shares = [total * w // whole for w in clean]
    left = total - sum(shares)
    order = sorted(range(len(clean)), key=lambda i: (-(total * clean[i] % whole), i))
    for i in order[:left]:
        shares[i] += 1
    return shares


def split_parts(parts: Sequence[Part]) -> list[Part]:
    """Each part of a worker that served the answer as a group's head (its ``shares``) becomes
    one part per member, its tokens split by layers held; every other part is kept as it is."""
    out: list[Part] = []
    for part in parts:
        shares = part.shares if part.worker_key is not None else ()
        weights = [layers for _, layers in shares]
        if not shares or sum(max(0, w) for w in weights) <= 0:
            out.append(part)
            continue
        prompts = apportion(part.prompt_tokens, weights)
        completions = apportion(part.completion_tokens, weights)
        for (key, _), prompt, completion in zip(shares, prompts, completions, strict=True):
            out.append(Part(key, prompt, completion, part.completed))
    return out
