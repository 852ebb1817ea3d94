"""CPU cost of `sharpattn reproduce selective`'s character language model at its full profile.

Per LM variant, times the experiment's own training loop (``selective_lm.lm_train``: the runner's
Trainer, AdamW with warm-up and cosine, gradient clipping, the real batches) on one thread: the
process CPU time of ``--warmup + --steps`` steps minus that of ``--warmup`` steps, in fresh
folders, divided by ``--steps``. Counts one step's matrix-product FLOPs
(``torch.utils.flop_counter.FlopCounterMode``, forward and backward) and, with the float32 GEMM
rate of this machine (``batched_seeds.matmul_rate``), the floor no code could go below. Prints the
profile's projected CPU-hours and hours on every core (one run per core), and that floor.

    python benchmarks/selective_lm_cost.py [--steps 10] [--warmup 2] [--variants vanilla,qv:both] [--out FILE]
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
from batched_seeds import matmul_rate
from torch.utils.flop_counter import FlopCounterMode

from sharpattn.experiments import selective_lm as sel
from sharpattn.experiments.selective import make_config
from sharpattn.lab.runner import cores, threads


def cpu_of(cfg: sel.LMConfig, corpus, variant: str, steps: int) -> float:
    """Process CPU seconds of ``lm_train`` stopped after ``steps`` steps in a fresh folder."""
    train, val, vocab = corpus
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.process_time()
        sel.lm_train(Path(tmp), cfg, train, val, len(vocab), variant, 0, stop_at=steps)
        return time.process_time() - t0


def step_flops(cfg: sel.LMConfig, vocab: int, variant: str) -> float:
    """Matrix-product FLOPs of one training step's forward and backward."""
    model = sel.lm_model(cfg, vocab, variant, 0)
    chunk = torch.randint(vocab, (cfg.batch, cfg.context + 1))
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(chunk[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).backward()
    return float(counter.get_total_flops())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=None, help="comma-separated (default: the profile's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = make_config("paper").lm
    variants = (
        [sel.lm_variant(v) for v in args.variants.split(",")] if args.variants else cfg.variants
    )
    corpus = sel.char_corpus(sel.load_text())
    vocab = len(corpus[2])
    n = cores()
    print(
        f"selective LM, full profile: {len(cfg.variants)} variants x {cfg.seeds} seeds x "
        f"{cfg.steps} steps of batch {cfg.batch} at context {cfg.context}"
    )
    print(
        f"torch {torch.__version__}, {n} cores, {platform.processor() or platform.machine()}, "
        f"load {os.getloadavg()[0]:.1f}; one thread per run"
    )
    print(f"{'variant':<16}{'CPU-s/step':>11}{'GFLOP/step':>12}{'GFLOP/s':>9}")
    rows = []
    with threads(1):
        for v in variants:
            per_step = (
                cpu_of(cfg, corpus, v, args.warmup + args.steps)
                - cpu_of(cfg, corpus, v, args.warmup)
            ) / args.steps
            flops = step_flops(cfg, vocab, v)
            rows.append({"variant": v, "cpu_s_per_step": per_step, "flops_per_step": flops})
            print(f"{v:<16}{per_step:>11.3f}{flops / 1e9:>12.1f}{flops / per_step / 1e9:>9.1f}")
    mean_step = sum(r["cpu_s_per_step"] for r in rows) / len(rows)
    mean_flops = sum(r["flops_per_step"] for r in rows) / len(rows)
    total_steps = len(cfg.variants) * cfg.seeds * cfg.steps
    cpu_h = mean_step * total_steps / 3600
    peak = matmul_rate(n)
    floor_h = mean_flops * total_steps / peak / 3600
    print(
        f"profile: {total_steps:,} steps x {mean_step:.3f} CPU-s = {cpu_h:.1f} CPU-hours, "
        f"{cpu_h / n:.1f} h on {n} cores (one run per core; mean over the variants measured)"
    )
    print(
        f"floor: {mean_flops * total_steps / 1e15:.2f} PFLOP at the {n}-thread 1024^3 torch.mm "
        f"rate ({peak / 1e9:.0f} GFLOP/s) = {floor_h:.1f} h"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "cores": n,
                    "rows": rows,
                    "profile_steps": total_steps,
                    "cpu_hours": cpu_h,
                    "hours_on_all_cores": cpu_h / n,
                    "matmul_flop_per_s": peak,
                    "floor_hours": floor_h,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
