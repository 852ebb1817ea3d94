"""Training speed of the max-retrieval experiment (batch 128, n ~ U{5..16}), in steps/s.

Compares, in one process and interleaved (the machine is shared, so absolute numbers drift):
  * eager baseline: the textbook loop (CE + λ·Σw² in the graph, default Adam, default threads,
    input checks on);
  * sharpattn: ``experiments.max_retrieval.train_group`` of one seed as the CLI runs it (fused
    Adam with the exactly equivalent coupled weight decay 2λ, checks off, one thread, logging and
    checkpoints);
  * optionally (--compile) the eager loop under torch.compile, with its compile time.

The issue's bar: an independent JAX/Flax implementation trains at about 90 steps/s here.

    python benchmarks/max_retrieval.py [--steps 600] [--rounds 3] [--compile]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sharpattn.experiments import max_retrieval as mr
from sharpattn.tasks import sample_max_retrieval


def eager_baseline(steps: int, compile: bool = False, threads: int | None = None):
    config = mr.Config(seeds=1, steps=steps)
    model = mr.build_model(config, 0)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    g = torch.Generator().manual_seed(0)
    forward = torch.compile(model, dynamic=True) if compile else model

    def step():
        n = int(torch.randint(config.min_items, config.max_items + 1, (1,), generator=g))
        b = sample_max_retrieval(config.batch, n, g)
        loss = F.cross_entropy(forward(b.x, b.q), b.target)
        loss = loss + config.l2 * sum(p.pow(2).sum() for p in model.parameters())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        t0 = time.perf_counter()
        for _ in range(20):  # warm-up (and compilation)
            step()
        warm = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        return steps / (time.perf_counter() - t0), steps / (time.process_time() - c0), warm
    finally:
        torch.set_num_threads(old)


def sharpattn_loop(steps: int):
    config = mr.Config(
        seeds=1, group=1, steps=steps, checkpoint_every=500, log_every=100, threads=1
    )
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        mr.train_group(Path(tmp), config, [0])
        return steps / (time.perf_counter() - t0), steps / (time.process_time() - c0), 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    loops = {
        "eager baseline": lambda: eager_baseline(args.steps),
        "eager, 1 thread": lambda: eager_baseline(args.steps, threads=1),
        "sharpattn train_group": lambda: sharpattn_loop(args.steps),
    }
    if args.compile:
        loops["eager + torch.compile"] = lambda: eager_baseline(args.steps, compile=True)
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, loop in loops.items():
            rows[name].append(loop())
    base = max(r[0] for r in rows["eager baseline"])
    print(
        f"max-retrieval training, batch 128, n ~ U{{5..16}}, {args.steps} steps x {args.rounds} rounds"
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} default threads, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'loop':<24}{'best steps/s':>14}{'median':>10}{'vs eager':>10}{'steps/CPU-s':>13}")
    for name, v in rows.items():
        wall = sorted(r[0] for r in v)
        cpu = max(r[1] for r in v)
        print(
            f"{name:<24}{wall[-1]:>14.1f}{wall[len(wall) // 2]:>10.1f}{wall[-1] / base:>9.2f}x{cpu:>13.1f}"
        )
    if args.compile:
        print(
            f"torch.compile warm-up (20 steps incl. compilation): {rows['eager + torch.compile'][0][2]:.1f} s"
        )
    print("reference: JAX/Flax implementation ~90 steps/s on this 2-core machine (issue 5)")


if __name__ == "__main__":
    main()
