"""Seconds per training step of each `sharpattn reproduce backcopy` run, and the projected
running time of a profile (measured steps/s × steps).

    .venv/bin/python benchmarks/backcopy_step_time.py --profile paper --steps 2 --threads 2

Times (wall and process CPU) ``--steps`` optimizer steps (after one warm-up step) of every run of the profile, each on
fresh samples drawn as `train` draws them, and prints s/step, the profile's steps and the
projected hours. Prints the machine (CPU count, load average) because the numbers depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from sharpattn.experiments import backcopy as bb
from sharpattn.tasks.bigram_backcopy import BigramBackcopy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=list(bb.PROFILES), default="paper")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument(
        "--runs", nargs="+", choices=list(bb.RUNS), default=list(bb.RUNS), help="only these runs"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    task = BigramBackcopy.tiny_shakespeare()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, {args.threads} threads"
    )
    rows, total = [], 0.0
    for name in args.runs:
        cfg = bb.profile_config(args.profile, name)
        model = bb.build_model(cfg, task)
        opt = bb.make_optimizer(cfg, model)
        data = torch.Generator().manual_seed(cfg.seed)
        times, cpu = [], []
        for step in range(args.steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            x = task.sample(cfg.batch, cfg.seq_len + 1, generator=data)
            loss = bb.next_token_loss(model, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step:  # the first step warms up allocators and kernels
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        sec, cpu_sec = sum(times) / len(times), sum(cpu) / len(cpu)
        total += sec * cfg.steps
        rows.append(
            {
                "run": name,
                "s_per_step": sec,
                "cpu_s_per_step": cpu_sec,
                "steps": cfg.steps,
                "hours": sec * cfg.steps / 3600,
                "cpu_hours": cpu_sec * cfg.steps / 3600,
            }
        )
        print(
            f"{name:18s} {sec:8.2f} s/step (CPU {cpu_sec:7.2f} s) x {cfg.steps:6d} steps = "
            f"{sec * cfg.steps / 3600:7.2f} h wall, {cpu_sec * cfg.steps / 3600:7.2f} CPU-hours",
            flush=True,
        )
    cpu_total = sum(r["cpu_hours"] for r in rows)
    print(
        f"profile {args.profile} ({len(rows)} runs): {total / 3600:.2f} h wall, {cpu_total:.2f} CPU-hours in all"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"profile": args.profile, "threads": args.threads, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
