"""The CPU cost of the full sequence sweeps, measured: ``sharpattn leaderboard --paper`` (and
``sharpattn reproduce clrs --paper``), from the engine's own jobs.

With one thread, in CPU seconds of this process (``time.process_time``; the machine may be shared,
so wall time is not used), for each job the sweep would run (``sequence.jobs`` of the profile's
configuration: task × training recipe, one seed):

  * training: ``sequence.run_job`` itself (the engine's model, batches, AdamW, schedule, clipping,
    on the runner's Trainer) for ``--warmup`` + ``--steps`` + 1 steps; the engine's loss function
    is wrapped to note the CPU clock at the start of every step, and the ``--steps`` steps after
    the warm-up are timed (forward, backward, clipping, optimizer, logging, the next batch);
  * evaluation: ``run_job`` again on the trained folder (it loads the weights, as a resumed sweep
    does) with one evaluation size at a time and a few test sequences (``eval_sets``; the
    engine's batches of ``eval_batch``), timing every method of the job between the engine's
    progress events (so ``adaptive (inference)`` is the softmax model switched to adaptive, as in
    the sweep). Sizes go up in order; at each one the number of sequences is as many as
    ``--eval-budget`` CPU seconds allow (at most one batch, at least one), and a size whose one
    sequence would take more than ``--eval-cap`` seconds (predicted from the last measured size
    by length²) is not measured: it and the larger ones are extrapolated as
    cost(last measured) × (length / its length)², marked in the table.

Evaluation is measured on ``--eval-tasks`` (default per profile: the leaderboard's task with the
longest sequences, ``copy``, whose lengths 34-8,194 cover every task's; every task for clrs,
whose vocabularies differ up to 1,032) and applied to the other tasks by their sequence length at
each size (log-log interpolation; the forward's cost depends on the task only through its length
and vocabulary). Totals: training CPU s/step × steps × seeds, and evaluation CPU s/sequence ×
test sequences × seeds at every size; the wall time is the profile's job list (the engine's order)
scheduled on ``workers`` single-threaded processes, each on its own core.

    python benchmarks/sequence_cost.py [--profile leaderboard|clrs|both] [--sweep paper|standard]
        [--seeds N] [--set KEY=JSON ...] [--steps 20] [--warmup 3]
        [--tasks copy,...] [--methods softmax,...] [--eval-tasks longest|all|copy,...]
        [--eval-budget 1] [--eval-cap 4] [--out benchmarks/results/sequence_cost.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sharpattn.experiments import clrs, leaderboard
from sharpattn.experiments import sequence as seq
from sharpattn.lab import runner

PROFILES = {"leaderboard": leaderboard.make_config, "clrs": clrs.make_config}
COMMANDS = {
    "leaderboard": "sharpattn leaderboard --{sweep}",
    "clrs": "sharpattn reproduce clrs --{sweep}",
}
DEFAULT_EVAL_TASKS = {"leaderboard": "longest", "clrs": "all"}


def probe(job: seq.Job, **changes: Any) -> seq.Job:
    """``job`` with configuration ``changes`` (same folder: same task, recipe and seed)."""
    return dataclasses.replace(job, config={**job.config, **changes})


def train_cost(job: seq.Job, warmup: int, steps: int) -> float:
    """CPU seconds per training step of ``job`` (its folder keeps the trained weights)."""
    stamps: list[float] = []
    loss = seq.loss_fn

    def timed(model, batch):  # called first thing in every step (after the step's batch)
        stamps.append(time.process_time())
        return loss(model, batch)

    seq.loss_fn = timed  # run_job looks it up when it builds its Trainer
    try:
        # task_steps emptied: a profile's per-task steps would override ``steps``
        seq.run_job(probe(job, steps=warmup + steps + 1, task_steps={}, eval_sizes={job.task: []}))
    finally:
        seq.loss_fn = loss
    return (stamps[warmup + steps] - stamps[warmup]) / steps


def eval_costs(job: seq.Job, budget: float, cap: float) -> dict[str, list[dict[str, Any]]]:
    """{method: [{size, length, sets, cpu_per_seq}]} for every method of ``job`` at the sizes
    that fit ``cap``, in order."""
    cfg = seq.SequenceConfig(**job.config)
    t = seq.task(job.task)
    out: dict[str, list[dict[str, Any]]] = {m.name: [] for m in job.methods}
    last: tuple[int, float] | None = None  # (length, the job's slowest method's s/sequence)
    for size in seq.sizes_of(cfg, job.task):
        length = int(t.length(size))
        guess = 0.0 if last is None else last[1] * (length / last[0]) ** 2
        if guess > cap:
            break
        sets = cfg.eval_batch if guess == 0 else max(1, min(cfg.eval_batch, int(budget / guess)))
        marks: list[tuple[str, float]] = []

        def note(ev: dict[str, Any], marks=marks) -> None:
            if ev["phase"].startswith("eval ") or ev["phase"] == "done":
                marks.append((ev["phase"], time.process_time()))

        # exactly ``sets`` sequences: no adaptive sampling, no stopping rule while measuring
        change = {"eval_sizes": {job.task: [size]}, "eval_sets": sets, "eval_se": 0.0}
        seq.run_job(probe(job, **change, stop_zeros=0), progress=note)
        slowest = 0.0
        for (phase, c0), (_, c1) in zip(marks, marks[1:], strict=False):
            name = phase[len("eval ") :].rsplit(" n=", 1)[0]
            per = (c1 - c0) / sets
            out[name].append({"size": size, "length": length, "sets": sets, "cpu_per_seq": per})
            slowest = max(slowest, per)
        last = (length, slowest)
    return out


def per_sequence(points: list[dict[str, Any]], length: int) -> tuple[float, bool]:
    """(CPU s per sequence at ``length``, extrapolated?) from measured ``points`` of one method:
    log-log interpolation inside them, the smallest below them, length² beyond them."""
    pts = sorted((p["length"], p["cpu_per_seq"]) for p in points)
    if length <= pts[0][0]:
        return pts[0][1], False
    if length > pts[-1][0]:
        n, c = pts[-1]
        return c * (length / n) ** 2, True
    for (n0, c0), (n1, c1) in zip(pts, pts[1:], strict=False):
        if n0 <= length <= n1:
            if n1 == n0:
                return max(c0, c1), False
            x = math.log(length / n0) / math.log(n1 / n0)
            return math.exp((1 - x) * math.log(max(c0, 1e-9)) + x * math.log(max(c1, 1e-9))), False
    raise AssertionError


def step_flops(cfg: seq.SequenceConfig, name: str) -> float:
    """Matrix-product FLOPs of one training step of task ``name`` with softmax (forward and
    backward, ``FlopCounterMode``), the mean over five training sizes across its range."""
    from torch.utils.flop_counter import FlopCounterMode

    t = seq.task(name)
    model = seq.build_model(cfg, seq.resolve(["softmax"])[0], t, 0)
    g = torch.Generator().manual_seed(0)
    lo, hi = t.train_sizes
    counts = []
    for size in sorted({lo + (hi - lo) * i // 4 for i in range(5)}):
        with FlopCounterMode(display=False) as counter:
            seq.loss_fn(model, t.batch(size, cfg.batch, g)).backward()
        counts.append(counter.get_total_flops())
    return sum(counts) / len(counts)


def gemm_rate(m: int = 4096, k: int = 64, n: int = 256, repeats: int = 20) -> float:
    """float32 FLOP/s of an (m, k) @ (k, n) product on this thread, best of ``repeats``: the
    shape of the decoder's projections at width 64 (a batch's tokens times a 4× MLP)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


def wall_time(costs: list[float], workers: int) -> float:
    """The jobs' CPU seconds, in the engine's order, on a pool of ``workers`` (each job goes to
    the first worker free, as ``ProcessPoolExecutor`` hands them out)."""
    free = [0.0] * workers
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def measure(profile: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    full = PROFILES[profile](args.sweep)
    tasks = args.tasks.split(",") if args.tasks else list(full.tasks)
    names = args.methods.split(",") if args.methods else list(full.methods)
    changes = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    cfg = PROFILES[profile](
        args.sweep, tasks=tuple(tasks), methods=tuple(names), seeds=args.seeds, **changes
    )
    if args.eval_tasks == "longest":
        top = {name: seq.task(name).length(seq.sizes_of(cfg, name)[-1]) for name in full.tasks}
        eval_tasks = [max(full.tasks, key=lambda n: top[n])]
    elif args.eval_tasks == "all":
        eval_tasks = list(tasks)
    else:
        eval_tasks = args.eval_tasks.split(",")
    one_seed = dataclasses.replace(cfg, seeds=1, tasks=tuple(dict.fromkeys(tasks + eval_tasks)))
    jobs = seq.jobs(root / profile, one_seed)
    train: dict[tuple[str, str], float] = {}  # (task, recipe) -> CPU s/step
    evals: dict[tuple[str, str], list[dict[str, Any]]] = {}  # (task, method) -> points
    c0 = time.process_time()
    for job in jobs:
        recipe = job.methods[0].recipe
        train[(job.task, recipe)] = train_cost(job, args.warmup, args.steps)
        if job.task in eval_tasks:
            for name, pts in eval_costs(job, args.eval_budget, args.eval_cap).items():
                evals[(job.task, name)] = pts
        line = f"{job.task}/{recipe}: {train[(job.task, recipe)]:.4f} s/step"
        print(f"  {line}  ({time.process_time() - c0:.0f} CPU-s so far)", flush=True)

    def seq_cost(task: str, method: str, length: int) -> tuple[float, bool]:
        pts = evals.get((task, method))
        if pts is None:  # pooled over the measured tasks, by length
            pts = [p for t in eval_tasks for p in evals.get((t, method), [])]
        return per_sequence(pts, length)

    # with adaptive sampling a size costs between eval_min and eval_sets test sequences (the
    # stopping rule, which skips a run's larger sizes, is not predicted: both bounds count every
    # size)
    fewest = min(cfg.eval_min, cfg.eval_sets) if cfg.eval_se > 0 else cfg.eval_sets
    rows: dict[str, dict[str, float]] = {}
    job_costs, job_costs_fewest = [], []
    for job in seq.jobs(root / "plan", cfg):  # the sweep's jobs, in its order
        t = seq.task(job.task)
        steps = seq.steps_of(cfg, job.task)
        cost = train[(job.task, job.methods[0].recipe)] * steps
        cost_fewest = cost
        for i, m in enumerate(job.methods):
            r = rows.setdefault(
                m.name, {"train": 0.0, "eval": 0.0, "extrapolated": 0.0, "eval_fewest": 0.0}
            )
            if i == 0:  # the job's model is trained once, for its first method
                r["train"] += train[(job.task, m.recipe)] * steps
            for size in seq.sizes_of(cfg, job.task):
                per, extra = seq_cost(job.task, m.name, int(t.length(size)))
                r["eval"] += per * cfg.eval_sets
                r["extrapolated"] += per * cfg.eval_sets if extra else 0.0
                cost += per * cfg.eval_sets
                r["eval_fewest"] += per * fewest
                cost_fewest += per * fewest
        job_costs.append(cost)
        job_costs_fewest.append(cost_fewest)
    flops = {name: step_flops(cfg, name) for name in tasks}
    recipes = len({m.recipe for m in seq.resolve(list(cfg.methods))})
    train_flops = sum(f * seq.steps_of(cfg, n) for n, f in flops.items()) * recipes * cfg.seeds
    rate = gemm_rate()
    total = sum(r["train"] + r["eval"] for r in rows.values())
    total_fewest = sum(r["train"] + r["eval_fewest"] for r in rows.values())
    return {
        "profile": profile,
        "command": COMMANDS[profile].format(sweep=args.sweep)
        + (f" --seeds {args.seeds}" if args.seeds else "")
        + "".join(f" [{kv}]" for kv in args.set),
        "config": {k: v for k, v in cfg.to_dict().items() if k != "eval_sizes"},
        "measured": {
            "steps": args.steps,
            "warmup": args.warmup,
            "eval_tasks": eval_tasks,
            "eval_budget": args.eval_budget,
            "eval_cap": args.eval_cap,
            "cpu_seconds": time.process_time() - c0,
        },
        "train_cpu_per_step": [
            {"task": k[0], "recipe": k[1], "cpu_s": v} for k, v in train.items()
        ],
        "eval_cpu_per_sequence": [
            {"task": k[0], "method": k[1], "points": v} for k, v in evals.items()
        ],
        "methods": [
            {
                "method": m,
                "train_cpu_h": r["train"] / 3600,
                "eval_cpu_h": r["eval"] / 3600,
                "eval_extrapolated_cpu_h": r["extrapolated"] / 3600,
                "eval_fewest_cpu_h": r["eval_fewest"] / 3600,
                "total_cpu_h": (r["train"] + r["eval"]) / 3600,
            }
            for m, r in rows.items()
        ],
        "total_cpu_h": total / 3600,
        "wall_h": wall_time(job_costs, cfg.workers) / 3600,
        "fewest_sets": fewest,
        "total_fewest_cpu_h": total_fewest / 3600,
        "wall_fewest_h": wall_time(job_costs_fewest, cfg.workers) / 3600,
        "workers": cfg.workers,
        "largest_job_cpu_h": max(job_costs) / 3600,
        "step_gflop": {n: f / 1e9 for n, f in flops.items()},
        "train_pflop": train_flops / 1e15,
        "gemm_gflops": rate / 1e9,
        "train_floor_cpu_h": train_flops / rate / 3600,
    }


def show(result: dict[str, Any]) -> None:
    c, m = result["config"], result["measured"]
    top = max(seq.task(t).length(seq.sizes_of(seq.SequenceConfig(**c), t)[-1]) for t in c["tasks"])
    recipes = len({mm.recipe for mm in seq.resolve(c["methods"])})
    per_task = sorted({seq.steps_of(seq.SequenceConfig(**c), t) for t in c["tasks"]})
    steps = "-".join(f"{n:,}" for n in sorted({per_task[0], per_task[-1]}))
    print(
        f"\n{result['command']}: {len(c['tasks'])} tasks x {recipes} recipes "
        f"({len(c['methods'])} methods) x {c['seeds']} seeds x {steps} steps of batch "
        f"{c['batch']}; {c['eval_sets']} test sequences per size, up to {c['eval_factor']}x the "
        f"training sizes (sequences up to {top:,} tokens)"
    )
    print(
        f"measured with 1 thread: {m['steps']} timed training steps after {m['warmup']} warm-up "
        f"per task x recipe; evaluation on {', '.join(m['eval_tasks'])} (beyond {m['eval_cap']} "
        f"CPU-s per sequence: length^2 extrapolation); {m['cpu_seconds']:.0f} CPU-s"
    )
    print(f"{'method':<22}{'train CPU-h':>12}{'eval CPU-h':>12}{'of it extrap.':>14}{'total':>9}")
    rows = sorted(result["methods"], key=lambda r: -r["total_cpu_h"])
    for r in rows:
        print(
            f"{r['method']:<22}{r['train_cpu_h']:>12.2f}{r['eval_cpu_h']:>12.2f}"
            f"{r['eval_extrapolated_cpu_h']:>14.2f}{r['total_cpu_h']:>9.2f}"
        )
    train = sum(r["train_cpu_h"] for r in rows)
    ev = sum(r["eval_cpu_h"] for r in rows)
    extra = sum(r["eval_extrapolated_cpu_h"] for r in rows)
    print(f"{'total':<22}{train:>12.2f}{ev:>12.2f}{extra:>14.2f}{result['total_cpu_h']:>9.2f}")
    print(
        f"wall on {result['workers']} cores with {result['workers']} single-threaded workers "
        f"(the engine's job order): {result['wall_h']:.1f} h; the longest job "
        f"{result['largest_job_cpu_h']:.2f} CPU-h"
    )
    if "train_floor_cpu_h" in result:
        per = ", ".join(f"{n} {g:.2f}" for n, g in result["step_gflop"].items())
        print(
            f"matrix products of training (softmax's, every recipe counted alike): "
            f"{result['train_pflop']:.2f} PFLOP (GFLOP a step: {per}); at this thread's "
            f"{result['gemm_gflops']:.0f} GFLOP/s on the decoder's product shape that alone is "
            f"{result['train_floor_cpu_h']:.1f} CPU-h, a floor no batching of seeds lowers"
        )
    if result.get("fewest_sets", c["eval_sets"]) < c["eval_sets"]:
        print(
            f"with adaptive sampling every size costs {result['fewest_sets']} to "
            f"{c['eval_sets']} test sequences: the totals above are the most; with "
            f"{result['fewest_sets']} at every size {result['total_fewest_cpu_h']:.1f} CPU-h, "
            f"{result['wall_fewest_h']:.1f} h wall (neither counts the sizes the stopping rule "
            "skips)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=["leaderboard", "clrs", "both"], default="both")
    ap.add_argument("--sweep", default="paper", help="the profile to cost: paper or standard")
    ap.add_argument("--seeds", type=int, default=None, help="seeds (default: the profile's)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="another setting of the profile, e.g. --set d_model=256 --set "
        "positions='\"nape\"' (repeatable)",
    )
    ap.add_argument("--steps", type=int, default=20, help="timed training steps per job")
    ap.add_argument("--warmup", type=int, default=3, help="untimed training steps first")
    ap.add_argument("--tasks", default=None, help="a subset of the profile's tasks")
    ap.add_argument("--methods", default=None, help="a subset of the profile's methods")
    ap.add_argument(
        "--eval-tasks", default=None, help="longest | all | names (default: per profile)"
    )
    ap.add_argument("--eval-budget", type=float, default=1.0, help="CPU-s per method and size")
    ap.add_argument("--eval-cap", type=float, default=4.0, help="largest CPU-s of one sequence")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    profiles = ["leaderboard", "clrs"] if args.profile == "both" else [args.profile]
    print(
        f"torch {torch.__version__}, {runner.cores()} cores, "
        f"{platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.1f}"
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp, runner.threads(1):
        for profile in profiles:
            run = argparse.Namespace(
                **{**vars(args), "eval_tasks": args.eval_tasks or DEFAULT_EVAL_TASKS[profile]}
            )
            results.append(measure(profile, run, Path(tmp)))
    for r in results:
        show(r)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "cores": runner.cores(),
                    "load": os.getloadavg()[0],
                    "profiles": results,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
