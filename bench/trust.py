"""Trust: how fast the audits flag each kind of cheat, how rarely they flag an honest worker,
and what they cost, on real per-job scores from real SmolLM2 runs.

The scores come from ``bench/trust_collect.py`` (``bench/data/trust_scores.json.gz``): real
answers from three honest engines on the same file (different thread counts and batch sizes)
at temperatures 0, 0.7 and 1.0, and from the five cheats of ``tests/support/cheats.py``, each
re-scored by a real auditor engine with another thread count. Each job goes through the queen's
own reading (``audits.cases.read_score``) and rule (``audits.decision.judge``, ``Standing``).

How runs are simulated. The honest jobs are split in two at random, and each half is judged by
bands learned from the other (``HonestBands.learn``), so no honest job is judged by bands it
taught; cheats are judged by bands learned from every honest job. Then:

* **False flags, real order:** each honest worker's jobs, in the order they ran, as one audited
  stream from a new worker's standing (every job audited).
* **False flags, resampled:** ``--runs`` streams of ``--honest-jobs`` jobs per honest worker,
  each job drawn with replacement from that worker's verdicts (so the tails of real scores are
  kept, and each real job recurs about three times in a stream: harsher than real traffic,
  whose prompts vary).
* **Detection:** ``--runs`` streams per cheat kind, each job drawn with replacement from that
  kind's jobs (the temperatures as collected), from a new worker's standing; the table gives
  the share flagged within 20 of its audited jobs, and the median jobs to the flag.
* **The rule before issue 39's robust test:** ``--contamination 0`` weighs every job in full
  (no ``job_cap``), as the queen did before; the default is ``SprtParams``'s. The per-job table
  says how many failed jobs weigh in full (evidence no honest answer gives) against ambiguous
  ones (their scores: at most ``job_cap`` each).
* **A Sybil pair:** two auditor keys of one party that look independent and fail every audit
  of an honest worker, among 0-10 honest auditors of the same file; each audit's auditors are
  drawn at random, a failing first verdict needs a second auditor's, two that agree a third's
  where there is one, and a disagreement outvotes the failing ones (``sybil_run``). The
  queen's rules (a flag on untrusted evidence needs ``MIN_ACCUSERS`` accusers; a third opinion)
  against two may flag, and against the accusers' rule alone.
* **Cost:** at steady state an established worker is audited at ``audit_base_rate``; an audit
  costs the auditor its ``scoring_s`` (and ``scoring_tokens`` evaluated) against the
  ``generation_s`` (and prompt plus completion tokens) of the job it checks.

    .venv/bin/python bench/trust.py [--data PATH] [--runs 1000] [--contamination EPS]
        [--bands OUT.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from queen_server.audits.cases import AuditCase, BadScore, read_score  # noqa: E402
from queen_server.audits.decision import (  # noqa: E402
    CLIP,
    HonestBands,
    JobScore,
    SprtParams,
    Standing,
    Verdict,
    enough_accusers,
    judge,
)
from queen_server.audits.independence import OUTVOTED_LIMIT  # noqa: E402

DATA = ROOT / "bench" / "data" / "trust_scores.json.gz"
WITHIN = 20  # a cheat must be flagged within this many of its audited jobs
BASE_RATE = 0.03  # the queen's default audit_base_rate


def case_of(job: dict[str, Any], sha256: str) -> AuditCase:
    return AuditCase(
        request_id="bench", model=job["request"].get("model", "smol"), sha256=sha256,
        worker_key=job["worker"], kind="chat", request=job["request"], answer=job["text"],
        claimed_completion_tokens=job["usage"]["completion_tokens"],
        claimed_prompt_tokens=job["usage"]["prompt_tokens"],
        finish_reason=job["finish_reason"] or "stop", key_id=None, charged_msat=0)


def load(path: Path) -> tuple[dict[str, Any], list[tuple[dict[str, Any], JobScore]]]:
    raw = json.loads(gzip.decompress(path.read_bytes()))
    sha256 = raw["meta"]["model_sha256"]
    scored = []
    for job in raw["jobs"]:
        if job.get("score") is None or not job.get("text"):
            continue
        try:
            scored.append((job, read_score(case_of(job, sha256), job["score"])))
        except BadScore as exc:
            print(f"skipped a {job['kind']} job: {exc}", file=sys.stderr)
    return raw["meta"], scored


def stream(verdicts: list[Verdict], params: SprtParams) -> tuple[bool, int]:
    """Whether a stream of verdicts flags a new worker, and after how many."""
    standing = Standing()
    for count, verdict in enumerate(verdicts, 1):
        standing = standing.after(verdict, params)
        if standing.state == "flagged":
            return True, count
    return False, len(verdicts)


SYBIL_POOLS = (0, 1, 3, 10)  # honest auditors holding the model beside the Sybil pair


def sybil_run(honest: list[Verdict], others: int, jobs: int, params: SprtParams,
              rng: random.Random, *, accusers_rule: bool, third_opinion: bool) -> bool:
    """One honest worker's ``jobs`` audited answers, each audited by auditors drawn at random
    from a Sybil pair (which fail every answer) and ``others`` honest auditors (whose verdicts
    are the honest worker's real ones, out of fold). A first failing verdict needs a second
    auditor's; with ``third_opinion`` (the queen's), two that agree are checked by a third when
    there is one. An auditor whose failing verdict the next one contradicts is outvoted, and
    past ``OUTVOTED_LIMIT`` audits no one. ``accusers_rule`` (the queen's): a flag needs
    ``MIN_ACCUSERS`` accusers. Whether the worker ends flagged."""
    pool = ["sybil-a", "sybil-b", *(f"honest-{n}" for n in range(others))]
    outvoted: dict[str, int] = defaultdict(int)
    accusers: set[str] = set()
    standing = Standing()

    def opinion(auditor: str) -> Verdict:
        return Verdict(CLIP, True, "sybil") if auditor.startswith("sybil") else rng.choice(honest)

    for _ in range(jobs):
        able = [a for a in pool if outvoted[a] < OUTVOTED_LIMIT]
        if not able:
            break
        chosen = [rng.choice(able)]
        verdict = opinion(chosen[0])
        while verdict.failed and len(chosen) < (3 if third_opinion else 2):
            rest = [a for a in able if a not in chosen]
            if not rest:
                break
            chosen.append(rng.choice(rest))
            more = opinion(chosen[-1])
            if not more.failed:
                for wrong in chosen[:-1]:
                    outvoted[wrong] += 1
                verdict = Verdict(None)  # they disagree: the job counts for nothing
                break
            verdict = Verdict(max(verdict.suspicion or 0, more.suspicion or 0), True, "",
                              verdict.ambiguous and more.ambiguous)
        if verdict.failed and len(chosen) < 2:
            continue  # no second opinion: the case expires
        if verdict.failed:
            accusers |= set(chosen)
        standing = standing.after(verdict, params, may_flag=not accusers_rule
                                  or enough_accusers(accusers, trusted=False))
        if standing.state == "flagged":
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--honest-jobs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--contamination", type=float, default=SprtParams().contamination,
                        help="the share of honest jobs the test allows to score anyhow (0: "
                        "every job weighs in full, the rule before issue 39)")
    parser.add_argument("--bands", type=Path, help="write the bands learned from all honest "
                        "jobs here, as an APIARY_AUDIT_BANDS_FILE")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    params = SprtParams(contamination=args.contamination)
    meta, scored = load(args.data)
    honest = [(job, score) for job, score in scored if job["kind"] == "honest"]
    rng.shuffle(honest)
    half = len(honest) // 2
    bands = HonestBands.learn(score for _, score in honest)
    # Two folds: each honest job is judged by bands learned from the other half only.
    held: list[tuple[dict[str, Any], Verdict]] = []
    for learn, judged in ((honest[:half], honest[half:]), (honest[half:], honest[:half])):
        fold = HonestBands.learn(score for _, score in learn)
        held += [(job, judge(score, fold)) for job, score in judged]
    ran = {id(job): i for i, (job, _) in enumerate(scored)}  # the order the jobs ran in
    held.sort(key=lambda pair: ran[id(pair[0])])

    print(f"data: {args.data.name}, {len(scored)} scored jobs ({len(honest)} honest), model "
          f"{meta['model']} ({meta['model_sha256'][:12]}…), {meta.get('machine', '?')}")
    print(f"test: delta {params.delta:g}, alpha {params.alpha:g}, beta {params.beta:g}, flag at "
          f"{params.upper:.2f}, good at {params.lower:.2f}; contamination {params.contamination:g}:"
          f" an ambiguous job adds at most {params.job_cap:.2f}")
    print("bands learned from every honest job (each honest job below is judged by those of "
          "the other half):")
    for band in bands.bands:
        if band.temperature == 0:
            print(f"  T=0: mismatch rate {band.mismatch_rate:.4f} per position, dispersion "
                  f"{band.mismatch_dispersion:.1f}")
        else:
            print(f"  T={band.temperature:g}: z mean {band.z_mean:+.2f}, sd {band.z_sd:.2f}, "
                  f"max {band.z_max:+.2f}")

    # Per-job failure rates, by kind and temperature.
    by_kind: dict[str, list[tuple[dict[str, Any], Verdict]]] = defaultdict(list)
    by_kind["honest"] = held
    for job, score in scored:
        if job["kind"] != "honest":
            by_kind[job["kind"]].append((job, judge(score, bands)))
    print("\nper job (honest jobs judged out of fold; every cheat job):")
    print(f"{'kind':<14}{'jobs':>6}{'failed':>9}{'T=0':>8}{'T=0.7':>8}{'T=1':>8}"
          f"{'mean suspicion':>16}{'failed, in full':>17}")
    for kind, verdicts in by_kind.items():
        rates = []
        for temperature in (0.0, 0.7, 1.0):
            some = [v for j, v in verdicts if j["request"]["temperature"] == temperature]
            rates.append(f"{sum(v.failed for v in some) / len(some):.0%}" if some else "-")
        informative = [v.suspicion for _, v in verdicts if v.suspicion is not None]
        mean = statistics.fmean(informative) if informative else float("nan")
        failed = sum(v.failed for _, v in verdicts) / len(verdicts)
        full = sum(v.failed and not v.ambiguous for _, v in verdicts)
        print(f"{kind:<14}{len(verdicts):>6}{failed:>9.1%}{rates[0]:>8}{rates[1]:>8}"
              f"{rates[2]:>8}{mean:>16.2f}{full:>17}")

    # False flags.
    print("\nhonest workers (every job, judged out of fold):")
    print(f"{'worker':<16}{'jobs':>6}{'real order':>12}{'resampled runs':>16}"
          f"{'flagged':>9}")
    honest_verdicts: dict[str, list[Verdict]] = defaultdict(list)
    for job, verdict in by_kind["honest"]:
        honest_verdicts[job["worker"]].append(verdict)
    for worker, verdicts in sorted(honest_verdicts.items()):
        real, _ = stream(verdicts, params)
        flagged = sum(stream([rng.choice(verdicts) for _ in range(args.honest_jobs)],
                             params)[0] for _ in range(args.runs))
        print(f"{worker:<16}{len(verdicts):>6}{'FLAGGED' if real else 'clean':>12}"
              f"{f'{args.runs} x {args.honest_jobs}':>16}{flagged / args.runs:>9.2%}")

    # Detection.
    print(f"\ncheats (new workers; {args.runs} resampled runs each):")
    print(f"{'kind':<14}{'jobs':>6}{f'flagged <= {WITHIN}':>15}{'median jobs':>13}"
          f"{'p99 jobs':>10}")
    for kind, pairs in by_kind.items():
        if kind == "honest":
            continue
        verdicts = [v for _, v in pairs]
        results = [stream([rng.choice(verdicts) for _ in range(200)], params)
                   for _ in range(args.runs)]
        within = sum(flag and count <= WITHIN for flag, count in results) / args.runs
        counts = sorted(count if flag else 10**6 for flag, count in results)
        p99 = counts[int(0.99 * (len(counts) - 1))]
        print(f"{kind:<14}{len(verdicts):>6}{within:>15.1%}"
              f"{statistics.median(counts):>13g}{p99 if p99 < 10**6 else '>200':>10}")

    # The Sybil pair.
    print(f"\na Sybil pair of auditors failing every audit of an honest worker ({args.runs} runs "
          f"of {args.honest_jobs} audited jobs per pool, auditors drawn at random):")
    print(f"{'honest auditors beside it':<27}{'two may flag':>14}{'3 accusers':>12}"
          f"{'the queen (3 accusers, a third opinion)':>41}")
    every_honest = [v for _, v in by_kind["honest"]]
    for others in SYBIL_POOLS:
        shares = []
        for accusers_rule, third_opinion in ((False, False), (True, False), (True, True)):
            flagged = sum(sybil_run(every_honest, others, args.honest_jobs, params, rng,
                                    accusers_rule=accusers_rule, third_opinion=third_opinion)
                          for _ in range(args.runs))
            shares.append(flagged / args.runs)
        print(f"{others:<27}{shares[0]:>14.2%}{shares[1]:>12.2%}{shares[2]:>41.2%}")

    # Cost.
    jobs = [job for job, _ in honest]
    gen_s = sum(job["generation_s"] for job in jobs)
    score_s = sum(job["scoring_s"] for job in jobs)
    served = sum(job["usage"]["prompt_tokens"] + job["usage"]["completion_tokens"]
                 for job in jobs)
    evaluated = sum(job["scoring_tokens"] for job in jobs)
    print(f"\naudit cost per audited job: {score_s / gen_s:.0%} of its generation seconds, "
          f"{evaluated / served:.0%} of its tokens")
    print(f"at steady state (audit_base_rate {BASE_RATE:.0%}): "
          f"{BASE_RATE * score_s / gen_s:.2%} of served seconds, "
          f"{BASE_RATE * evaluated / served:.2%} of served tokens; a second opinion adds the "
          f"same again for the few jobs an untrusted auditor fails")

    if args.bands is not None:
        every = HonestBands.learn(score for _, score in honest)
        args.bands.write_text(json.dumps({meta["model_sha256"]: every.to_dict()}, indent=1))
        print(f"\nbands from all {len(honest)} honest jobs written to {args.bands}")


if __name__ == "__main__":
    main()
