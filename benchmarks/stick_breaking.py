"""Stick-breaking's O(n)-memory path against causal SDPA: CPU-time ratios on one thread.

B = 1, H = 4, D = 64, float32, Lq = Lk = n, ``attend(..., "stick_breaking", causal=True,
check_finite=False)`` (the tiled path of ``attention/cpu/stick_tiled.py``) against
``F.scaled_dot_product_attention(..., is_causal=True)``, interleaved round by round in one
process, min over rounds, ``time.process_time`` (robust to other processes on a shared machine).
Forward under ``torch.no_grad``; forward+backward with a cotangent of ones. Targets: forward
<= 3x, forward+backward <= 4x.

    python benchmarks/stick_breaking.py --sizes 4096,16384 --rounds 3
    python benchmarks/stick_breaking.py --sizes 4096 --blocks 128x512   # other tile sizes
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sharpattn import attend
from sharpattn.attention.cpu.stick_tiled import stick_breaking
from sharpattn.attention.masking import Masking

B, H, D = 1, 4, 64
TARGETS = {"fwd": 3.0, "fwdbwd": 4.0}


def run_once(fn, mode: str, q, k, v) -> float:
    for t in (q, k, v):
        t.grad = None
    c0 = time.process_time()
    if mode == "fwd":
        with torch.no_grad():
            fn(q, k, v)
    else:
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    return time.process_time() - c0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--blocks", default=None, help="rows x keys per tile, e.g. 256x256")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    blocks = tuple(int(x) for x in args.blocks.split("x")) if args.blocks else None

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def stick(q, k, v):
        if blocks is None:
            return attend(q, k, v, "stick_breaking", causal=True, check_finite=False)
        n = q.shape[2]
        masking = Masking.build(None, True, n, n, q.device)
        return stick_breaking(q, k, v, masking, D**-0.5, False, blocks=blocks)[0]

    rows = []
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread"
    )
    print("| n | mode | SDPA CPU s | stick CPU s | ratio | target |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3))
        for mode in args.modes.split(","):
            best = {"sdpa": float("inf"), "stick": float("inf")}
            for _ in range(args.rounds):
                for name, fn in (("sdpa", sdpa), ("stick", stick)):
                    best[name] = min(best[name], run_once(fn, mode, q, k, v))
            ratio = best["stick"] / best["sdpa"]
            rows.append(
                {
                    "n": n,
                    "mode": mode,
                    "rounds": args.rounds,
                    "blocks": args.blocks,
                    "sdpa_cpu_s": best["sdpa"],
                    "stick_cpu_s": best["stick"],
                    "ratio": ratio,
                    "target": TARGETS[mode],
                }
            )
            print(
                f"| {n} | {mode} | {best['sdpa']:.3f} | {best['stick']:.3f} | {ratio:.2f} "
                f"| <= {TARGETS[mode]:g} |",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
