"""CPU-time ratios of methods' ``impl="auto"`` paths to torch's SDPA, measured in one process.

For each causal flag and mode (forward, forward+backward): SDPA and each method run alternately,
the minimum process CPU time over ``--rounds`` rounds each; B = 1, H = 4, D = 64, float32,
``check_finite=False``. The table of the tiled paths in docs/performance.md came from

    python benchmarks/fast_paths.py --methods sigmoid,relu,power,signed,softpick,adaptive --n 4096

(one thread, the default). ``benchmarks/attention.py`` is the full table with memory.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from sharpattn import attend

B, H, D = 1, 4, 64


def cpu_time(fn, mode: str, q, k, v) -> float:
    q, k, v = (t.detach().requires_grad_(mode == "fwd+bwd") for t in (q, k, v))
    start = time.process_time()
    out = fn(q, k, v)
    if mode == "fwd+bwd":
        out.backward(torch.ones_like(out))
    return time.process_time() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="sigmoid,relu,power,signed,softpick,adaptive")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, args.n, D, generator=g) for _ in range(3))
    methods = args.methods.split(",")
    print(f"n = {args.n}, {args.threads} thread(s); ratio of CPU time to SDPA's")
    for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):

            def sdpa(a, b, c, causal=causal):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal)

            base = min(cpu_time(sdpa, mode, q, k, v) for _ in range(args.rounds))
            cells = []
            for m in methods:

                def run(a, b, c, m=m, causal=causal):
                    return attend(a, b, c, m, causal=causal, check_finite=False)

                t = min(cpu_time(run, mode, q, k, v) for _ in range(args.rounds))
                cells.append(f"{m} {t / base:.2f}")
            print(f"causal={causal} {mode:8s} sdpa {base:.3f} s | " + " | ".join(cells))


if __name__ == "__main__":
    main()
