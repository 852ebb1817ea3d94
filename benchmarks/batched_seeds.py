"""Seeds trained together: max-retrieval training steps per second per seed, batched vs one at a time.

In one process, interleaved rounds (the machine may be shared: ratios, not absolute numbers):
  * one at a time: ``SetAttention`` seeds trained one after another on the runner's Trainer
    (the group of one seed), with 1 and with every thread;
  * batched: S = 1, 2, 5, 10 seeds as one ensemble (``SetAttention(members=S)``) on the same
    Trainer, same batches per seed, with 1 and with every thread.
Reports steps/s per seed (training steps of every seed divided by wall time), the best of the
rounds, and the ratio to the best one-at-a-time configuration. CPU-time per seed-step is printed
too (it does not depend on other load), and the kernel's share of it (page faults: the runner's
allocator policy, ``runner.keep_freed_memory``, keeps it near zero).

The ceiling: the matrix-product FLOPs of one seed's training step (forward and backward, counted
by ``torch.utils.flop_counter.FlopCounterMode`` and averaged over n = 5..16; the optimizer's
elementwise work is not counted) and this machine's float32 matrix-product rate (a 1024³
``torch.mm`` with 1 and with every thread) give the most steps per second per seed that any
batching could reach; the table prints each configuration's GFLOP/s against it.

    python benchmarks/batched_seeds.py [--steps 200] [--rounds 3] [--out benchmarks/results/batched_seeds.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from sharpattn.experiments import max_retrieval as mr
from sharpattn.lab.runner import cores
from sharpattn.tasks import sample_max_retrieval


def rate(seeds: int, group: int, threads: int, steps: int) -> tuple[float, float, float]:
    """(seed-steps per wall second, seed-steps per CPU second, the kernel's share of the CPU
    time) training ``seeds`` seeds in groups of ``group``; logging every 1,000 steps as the
    paper profile does."""
    config = mr.Config(
        seeds=seeds,
        group=group,
        steps=steps,
        threads=threads,
        log_every=1000,
        checkpoint_every=10**9,
        sizes=(16,),
        test_sets=1,
    )
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), os.times()
        for g in mr.groups(config):
            mr.train_group(Path(tmp), config, g)
        c1 = os.times()
        wall = time.perf_counter() - t0
        user, system = c1.user - c0.user, c1.system - c0.system
    return seeds * steps / wall, seeds * steps / (user + system), system / (user + system)


def flops_per_seed_step(config: mr.Config | None = None) -> float:
    """Matrix-product FLOPs of one seed's training step (forward + backward of the cross-entropy
    on a batch), averaged over the step's item counts n = min_items..max_items."""
    config = config or mr.Config(seeds=1, group=1, sizes=(16,), test_sets=1)
    model = mr.build_model(config, 0)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for n in range(config.min_items, config.max_items + 1):
        b = sample_max_retrieval(config.batch, n, gen)
        counter = FlopCounterMode(display=False)
        with counter:
            F.cross_entropy(model(b.x, b.q, check_finite=False), b.target).backward()
        counts.append(counter.get_total_flops())
    return sum(counts) / len(counts)


def matmul_rate(threads: int, size: int = 1024, repeats: int = 20) -> float:
    """float32 FLOP/s of a ``size``³ ``torch.mm`` on ``threads`` threads (best of ``repeats``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * size**3 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1,2,5,10")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    threads = sorted({1, cores()})
    cases = [("one at a time", 1, 1, t) for t in threads]  # (label, seeds, group, threads)
    cases += [(f"batched S={s}", s, s, t) for s in sizes for t in threads]
    best: dict[tuple, tuple[float, float, float]] = {}
    mr.train_group(
        Path(tempfile.mkdtemp()),
        mr.Config(seeds=1, group=1, steps=20, sizes=(16,), test_sets=1),
        [0],
    )  # warm-up
    for _ in range(args.rounds):
        for case in cases:
            r = rate(*case[1:], steps=args.steps if case[1] > 1 else 2 * args.steps)
            old = best.get(case, (0.0, 0.0, 1.0))
            best[case] = (max(old[0], r[0]), max(old[1], r[1]), min(old[2], r[2]))
    base = max(v[0] for c, v in best.items() if c[0] == "one at a time")
    flops = flops_per_seed_step()
    peak = {t: matmul_rate(t) for t in threads}
    print(
        f"max-retrieval training (batch 128, n ~ U{{5..16}}), {args.steps} steps x {args.rounds} rounds"
    )
    print(
        f"torch {torch.__version__}, {cores()} cores, {platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'configuration':<18}{'threads':>8}{'steps/s per seed':>18}{'vs one at a time':>18}{'per CPU-s':>11}{'kernel':>8}{'GFLOP/s':>9}"
    )
    rows = []
    for (label, s, _, t), (wall, cpu, kernel) in best.items():
        print(
            f"{label:<18}{t:>8}{wall:>18.1f}{wall / base:>17.2f}x{cpu:>11.1f}{kernel:>7.1%}"
            f"{wall * flops / 1e9:>9.1f}"
        )
        rows.append(
            {
                "configuration": label,
                "seeds": s,
                "threads": t,
                "steps_per_s_per_seed": wall,
                "ratio": wall / base,
                "per_cpu_s": cpu,
                "kernel_share": kernel,
                "gflop_per_s": wall * flops / 1e9,
            }
        )
    print(f"matrix-product FLOPs per seed-step: {flops / 1e6:.0f} M (forward + backward)")
    for t, rate_ in peak.items():
        print(
            f"1024^3 torch.mm on {t} thread(s): {rate_ / 1e9:.0f} GFLOP/s -> at most "
            f"{rate_ / flops:.0f} steps/s per seed, {rate_ / flops / base:.2f}x the best one at a time"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "cores": cores(),
                    "flops_per_seed_step": flops,
                    "matmul_flop_per_s": {str(t): r for t, r in peak.items()},
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
