"""Audit data (issue 16): real per-job scores of honest and cheating SmolLM2 workers, for the
simulation in ``bench/trust.py``.

Workers are the worker's own ``ModelPool`` (the path a job takes). The honest workers hold the
same model file with different engine settings: 1 thread, 2 threads, and 2 threads with
``n_batch`` 64 (llama.cpp splits the prompt differently, so the arithmetic differs a little, as
it does between honest machines). The cheats are ``tests/support/cheats.py``'s ``CheatPool``
over a 2-thread pool (``requant`` over its ``SwappedStore``). Every job is a chat request for one
of 60 short prompts at temperature 0, 0.7 or 1.0 (equal shares per worker), ``max_tokens`` from
{32, 64, 128}, a random seed, and in one job of ten the stop string "\\n\\n". Jobs run one at a
time in a shuffled order, so drift on a shared machine hits every kind alike.

Each delivered answer is then scored by an auditor configured unlike its worker (another thread
count, another ``n_batch``) with the real scoring (``ModelPool.score``: one teacher-forced pass
of prompt and answer). Stored per job: the worker and kind, the request, the text, what the
worker claimed (usage, finish), the generation seconds, the scoring seconds and tokens
evaluated, and ``Score.data()`` (floats rounded to 5 decimals) as gzip JSON.

    .venv/bin/python bench/trust_collect.py [--honest 1050] [--cheats 60] [--seed 16]
        [--out bench/data/trust_scores.json.gz] [--batched N] [--shapes 0.5]
        [--kinds shape_picker prompt_inflate]

With ``--shapes S`` (issue 39) a share S of the jobs (honest and cheats alike) is constrained:
half of them ask for a JSON object (``response_format`` json_object, the prompt asking for
JSON), half carry presence and frequency penalties; the auditors replay both. ``--kinds`` runs
only those cheats.

With ``--batched N`` (issue 36) the honest jobs are served by one worker as the worker serves
them: a confined engine child batching up to N jobs at once (``SandboxedContexts``, 2 threads),
the jobs sent N at a time; the cheats and auditors are as above. It ends by judging every honest
answer with the queen's own rule and default bands, as a new worker's audits would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gzip
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llama_cpp  # noqa: E402

from desktop_worker.engine import llama_model  # noqa: E402
from desktop_worker.engine.pool import ModelPool  # noqa: E402
from desktop_worker.engine.scoring import ScoreRequest  # noqa: E402
from desktop_worker.errors import WorkerError  # noqa: E402
from desktop_worker.sandbox.context import SandboxedContexts  # noqa: E402
from desktop_worker.store import ModelStore  # noqa: E402
from desktop_worker.store.hub import sha256_file  # noqa: E402
from tests.support.cheats import KINDS, SMOLLM2, CheatPool, SwappedStore, chat_text  # noqa: E402

log = logging.getLogger("trust_collect")

NAME = "smol"
N_CTX = 1024
TEMPERATURES = (0.0, 0.7, 1.0)
MAX_TOKENS = (32, 64, 128)
STOP_SHARE = 0.1
PROMPTS = [
    "What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?", "What is photosynthesis?", "How far is the Moon from Earth?",
    "What does a CPU do?", "Why do leaves change colour in autumn?", "What is an atom?",
    "How do vaccines work?", "What is the boiling point of water?", "Who was Ada Lovelace?",
    "Explain gravity to a child.", "Describe a thunderstorm in two sentences.",
    "Summarise the plot of Cinderella.", "Give me one tip for sleeping better.",
    "Explain what a budget is.", "Describe the taste of a lemon.",
    "Tell me how to boil an egg.", "Explain recursion in one paragraph.",
    "Write a haiku about the sea.", "Write a short poem about a cat.",
    "Write a two-line rhyme about rain.", "Invent a name for a bakery.",
    "Write a limerick about a frog.", "Write the first sentence of a mystery novel.",
    "List three fruits.", "List five countries in Europe.", "List the days of the week.",
    "Name three primary colours.", "List four planets.", "Give three uses for a paperclip.",
    "List three musical instruments.", "Name five animals that live in the ocean.",
    "Write a Python function that adds two numbers.", "Write a Python loop that prints 1 to 5.",
    "How do I reverse a list in Python?", "Write a SQL query that counts rows in a table.",
    "What does HTML stand for?", "Write a JavaScript function that returns the larger of two "
    "numbers.", "Explain what a variable is in programming.", "What is a Git commit?",
    "Hello! How are you today?", "What's your favourite colour?", "Tell me a joke.",
    "Good morning!", "Can you recommend a good book?", "What should I cook for dinner?",
    "I'm bored. Any ideas?", "Say something nice.", "What is 12 times 12?",
    "Convert 5 kilometres to miles.", "What is the square root of 81?",
    "If I have 3 apples and eat one, how many are left?", "Is 17 a prime number?",
    "Translate 'good night' into Spanish.", "What is the opposite of 'ancient'?",
    "Use the word 'brilliant' in a sentence.", "What rhymes with 'light'?",
    "Spell 'necessary' backwards.",
]


@dataclass(frozen=True, slots=True)
class Engine:
    """One pool's engine settings."""

    name: str
    threads: int
    n_batch: int


HONEST = (Engine("honest-t1", 1, 512), Engine("honest-t2", 2, 512),
          Engine("honest-t2-b64", 2, 64))
AUDITORS = (Engine("auditor-t1-b128", 1, 128), Engine("auditor-t2-b256", 2, 256))
CHEAT_ENGINE = Engine("cheat-t2", 2, 512)


@dataclass(frozen=True, slots=True)
class JobSpec:
    kind: str  # "honest" or a cheat kind
    worker: str
    prompt: int
    temperature: float
    max_tokens: int
    seed: int
    stop: bool
    shape: str = "plain"  # "plain", "json" (json_object) or "penalties"


def auditor_for(worker: Engine) -> Engine:
    """An auditor unlike the worker: another thread count (and so another engine)."""
    return next(a for a in AUDITORS if a.threads != worker.threads)


def plan_jobs(honest: int, cheats: int, seed: int,
              engines: tuple[Engine, ...] = HONEST, *, shapes: float = 0.0,
              kinds: tuple[str, ...] = KINDS) -> list[JobSpec]:
    """Every job, shuffled: ``honest`` spread over the honest workers and, per worker, over the
    temperatures; ``cheats`` per cheat kind, over the temperatures; a share ``shapes`` of them
    constrained (JSON or penalties, half each)."""
    rng = random.Random(seed)

    def spec(kind: str, worker: str, i: int) -> JobSpec:
        shape = "plain"
        if rng.random() < shapes:
            shape = rng.choice(("json", "penalties"))
        return JobSpec(kind, worker, rng.randrange(len(PROMPTS)),
                       TEMPERATURES[i % len(TEMPERATURES)], rng.choice(MAX_TOKENS),
                       rng.randrange(2**31), rng.random() < STOP_SHARE, shape)

    jobs = [spec("honest", engines[i % len(engines)].name, i // len(engines))
            for i in range(honest)]
    jobs += [spec(kind, f"cheat-{kind}", i) for kind in kinds for i in range(cheats)]
    rng.shuffle(jobs)
    return jobs


def request_of(job: JobSpec) -> dict[str, Any]:
    request: dict[str, Any] = {"model": NAME, "messages": [
        {"role": "user", "content": PROMPTS[job.prompt]}], "temperature": job.temperature,
        "max_tokens": job.max_tokens, "seed": job.seed}
    if job.stop:
        request["stop"] = ["\n\n"]
    if job.shape == "json":
        request["response_format"] = {"type": "json_object"}
        request["messages"][0]["content"] += " Answer as a JSON object."
    elif job.shape == "penalties":
        request.update(presence_penalty=0.6, frequency_penalty=0.4)
    return request


def rounded(value: Any) -> Any:
    """Floats to 5 decimals, all the way down (the data stays well under 5 MB)."""
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


@contextlib.contextmanager
def batch_size(n_batch: int) -> Iterator[None]:
    """Contexts loaded inside get ``n_batch`` (the worker's engine does not take one)."""
    original = llama_model.Llama
    llama_model.Llama = functools.partial(original, n_batch=n_batch)  # type: ignore[misc]
    try:
        yield
    finally:
        llama_model.Llama = original  # type: ignore[misc]


async def loaded_pool(store: ModelStore, engine: Engine) -> ModelPool:
    pool = ModelPool(store.get, llama_model.llama_context, max_jobs=1, n_ctx=N_CTX,
                     n_threads=engine.threads, budget_mb=4096)  # in this process: batch_size
    with batch_size(engine.n_batch):
        await pool.load(NAME)
    return pool


async def generate(pool: ModelPool | CheatPool, request: dict[str, Any]
                   ) -> tuple[str, str, dict[str, int], float]:
    started = time.perf_counter()
    text, finish, usage = await chat_text(pool, NAME, request)
    return text, finish, usage, time.perf_counter() - started


async def run_job(job: JobSpec, workers: dict[str, tuple[Engine, Any]],
                  auditors: dict[str, ModelPool]) -> dict[str, Any]:
    engine, pool = workers[job.worker]
    request = request_of(job)
    text, finish, usage, generation_s = await generate(pool, request)
    bent = getattr(pool, "last", None)
    auditor = auditor_for(engine)
    record: dict[str, Any] = {
        "worker": job.worker, "kind": job.kind, "engine": asdict(engine),
        "auditor": asdict(auditor), "prompt": job.prompt, "shape": job.shape,
        "request": request, "text": text,
        "text_chars": len(text), "text_bytes": len(text.encode("utf-8")), "usage": usage,
        "finish_reason": finish, "generation_s": round(generation_s, 4),
        "bent": None if job.kind == "honest" else (bent.bent if bent else False),
        "real_completion_tokens": bent.real_completion_tokens if bent else None,
        "score": None, "scoring_s": None, "scoring_tokens": None, "score_error": None}
    if not text:
        record["score_error"] = "empty answer"
        return record
    started = time.perf_counter()
    try:
        score = await auditors[auditor.name].score(
            NAME, ScoreRequest("chat", request, text), threading.Event())
    except WorkerError as exc:
        record["score_error"] = str(exc)
        return record
    assert score is not None
    record.update(score=rounded(score.data()), scoring_s=round(time.perf_counter() - started, 4),
                  scoring_tokens=score.usage()["prompt_tokens"])
    return record


def save(path: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with gzip.open(partial, "wt", encoding="utf-8") as handle:
        json.dump({"meta": meta, "jobs": records}, handle, separators=(",", ":"))
    partial.replace(path)


def table(records: list[dict[str, Any]]) -> str:
    """Jobs per kind and temperature, mean seconds and tokens."""
    rows = ["| kind | temperature | jobs | bent | mean generation s | mean completion tokens "
            "(claimed) | mean scoring s | mean tokens scored |",
            "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["kind"], record["request"]["temperature"]), []).append(record)
    order = {kind: i for i, kind in enumerate(("honest", *KINDS))}
    for (kind, temperature), group in sorted(groups.items(),
                                             key=lambda item: (order[item[0][0]], item[0][1])):
        scored = [r for r in group if r["score"] is not None]
        bent = "" if kind == "honest" else str(sum(bool(r["bent"]) for r in group))
        rows.append(
            f"| {kind} | {temperature:g} | {len(group)} | {bent} | "
            f"{statistics.fmean(r['generation_s'] for r in group):.3f} | "
            f"{statistics.fmean(r['usage']['completion_tokens'] for r in group):.1f} | "
            f"{statistics.fmean(r['scoring_s'] for r in scored) if scored else 0:.3f} | "
            f"{statistics.fmean(r['scoring_tokens'] for r in scored) if scored else 0:.1f} |")
    return "\n".join(rows)


def inflate_note(records: list[dict[str, Any]]) -> str:
    """How often 3x the real count stayed inside the queen's byte bound (the claim not capped)."""
    jobs = [r for r in records if r["kind"] == "inflate" and r["real_completion_tokens"]]
    whole = sum(r["usage"]["completion_tokens"] == 3 * r["real_completion_tokens"] for r in jobs)
    return (f"inflate: {whole} of {len(jobs)} claims were the full 3x (the rest capped at the "
            f"byte bound)")


async def collect(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="trust-collect-"))
    store = ModelStore(work / "models")
    store.import_file(args.model, NAME)
    swapped = SwappedStore(work / "requant-models", work / "requant")
    swapped.import_file(args.model, NAME)
    workers: dict[str, tuple[Engine, Any]] = {}
    honest = HONEST
    if args.batched:
        honest = (Engine(f"honest-batched-{args.batched}", 2, 512),)
        batched = ModelPool(store.get, SandboxedContexts(memory_limits=False),
                            max_jobs=args.batched, n_ctx=N_CTX, n_threads=2, budget_mb=4096)
        await batched.load(NAME)
        workers[honest[0].name] = (honest[0], batched)
    for engine in () if args.batched else HONEST:
        workers[engine.name] = (engine, await loaded_pool(store, engine))
    base = await loaded_pool(store, CHEAT_ENGINE)
    for kind in args.kinds:
        if kind == "requant":
            pool: Any = CheatPool(await loaded_pool(swapped, CHEAT_ENGINE), kind, seed=args.seed)
        else:
            pool = CheatPool(base, kind, seed=args.seed)
        workers[f"cheat-{kind}"] = (CHEAT_ENGINE, pool)
    auditors = {engine.name: await loaded_pool(store, engine) for engine in AUDITORS}
    if "cheat-replay" in workers:
        replay = workers["cheat-replay"][1]
        for prompt in range(3):  # fill the replay cache, so every replay job is one
            await generate(replay, request_of(JobSpec("replay", "", prompt, 0.7, 64, prompt,
                                                      False)))
    requant_path = swapped.get(NAME).path
    meta = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "model": args.model.name, "model_sha256": sha256_file(args.model),
        "model_bytes": args.model.stat().st_size, "requant_bytes": requant_path.stat().st_size,
        "requant_sha256": sha256_file(requant_path), "n_ctx": N_CTX,
        "llama_cpp": llama_cpp.__version__, "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} cores, {platform.processor() or platform.system()}",
        "honest": [asdict(e) for e in honest], "batched": args.batched,
        "auditors": [asdict(e) for e in AUDITORS],
        "cheat_engine": asdict(CHEAT_ENGINE), "prompts": PROMPTS, "seed": args.seed,
        "shapes": args.shapes, "kinds": list(args.kinds),
    }
    jobs = plan_jobs(args.honest, args.cheats, args.seed, honest, shapes=args.shapes,
                     kinds=tuple(args.kinds))
    records: list[dict[str, Any]] = []
    done = 0
    for group in _groups(jobs, args.batched):
        records.extend(await asyncio.gather(*(run_job(job, workers, auditors) for job in group)))
        for _ in group:
            done += 1
            if done % 50 == 0:
                log.info("%d/%d jobs, %.0f s", done, len(jobs), time.perf_counter() - started)
            if done % 200 == 0:
                save(args.out, {**meta, "complete": False}, records)
    meta.update(complete=True, wall_s=round(time.perf_counter() - started, 1))
    save(args.out, meta, records)
    pools = {id(pool.pool if isinstance(pool, CheatPool) else pool):
             pool.pool if isinstance(pool, CheatPool) else pool for _, pool in workers.values()}
    for pool in [*pools.values(), *auditors.values()]:
        await pool.close()
    print(f"{meta['machine']}; {args.model.name}; llama-cpp-python {llama_cpp.__version__}; "
          f"{len(records)} jobs in {meta['wall_s']:.0f} s; written to {args.out} "
          f"({args.out.stat().st_size / 1e6:.1f} MB)\n")
    print(table(records))
    print(f"\n{inflate_note(records)}")
    errors = [r for r in records if r["score_error"]]
    print(f"not scored: {len(errors)} ({', '.join(sorted({r['score_error'] for r in errors}))})")
    if args.batched or args.shapes:
        print(judged_note(records, meta["model_sha256"]))


def _groups(jobs: list[JobSpec], batched: int) -> Iterator[list[JobSpec]]:
    """Jobs to run at once: runs of up to ``batched`` honest jobs (a batched worker's traffic),
    every other job alone."""
    group: list[JobSpec] = []
    for job in jobs:
        if batched and job.kind == "honest":
            group.append(job)
            if len(group) == batched:
                yield group
                group = []
            continue
        yield [job]
    if group:
        yield group


def judged_note(records: list[dict[str, Any]], sha256: str) -> str:
    """Honest answers the queen's rule fails with its default bands, and whether the honest
    worker's audited stream (in the order it ran) would be flagged."""
    from bench.trust import case_of
    from queen_server.audits.cases import BadScore, read_score
    from queen_server.audits.decision import DEFAULT_BANDS, SprtParams, Standing, judge

    lines = []
    for shape in ("plain", "json", "penalties"):
        failed = judged = 0
        standing = Standing()
        for record in records:
            if record["kind"] != "honest" or record["score"] is None \
                    or record.get("shape", "plain") != shape:
                continue
            try:
                verdict = judge(read_score(case_of(record, sha256), record["score"]),
                                DEFAULT_BANDS)
            except BadScore:
                continue
            judged += 1
            failed += verdict.failed
            standing = standing.after(verdict, SprtParams())
        if judged:
            lines.append(f"honest {shape} answers judged by the queen's rule (default bands): "
                         f"{failed} of {judged} failed ({100 * failed / max(1, judged):.2f} %); "
                         f"the worker's audited stream ends {standing.state}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--honest", type=int, default=1050)
    parser.add_argument("--cheats", type=int, default=60, help="jobs per cheat kind")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/data/trust_scores.json.gz")
    parser.add_argument("--batched", type=int, default=0,
                        help="serve the honest jobs batched, this many at once (issue 36)")
    parser.add_argument("--shapes", type=float, default=0.0,
                        help="the share of constrained jobs: JSON mode or penalties (issue 39)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                        help="the cheats to run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    log.setLevel(logging.INFO)
    asyncio.run(collect(args))


if __name__ == "__main__":
    main()
