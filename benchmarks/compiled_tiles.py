"""What a compiled tile kernel would save: the element-wise work of one score tile, eager against
``torch.compile`` (Inductor's vectorised C++ on CPU), beside the tile's q·kᵀ product.

One tile of 2^18 scores (4 heads × 256 queries × 256 keys, D = 64, float32), CPU time of this
process per call (the mean over ``--calls`` calls after 5 warm-up calls):

* ``stats``: adaptive temperature's statistics pass per tile (running max, Z = Σ 2^{s−m},
  A = Σ 2^{s−m}·(s − m), with the rescaling of the running sums), as ``attention/fused.py`` does;
* ``softpick``: softpick's forward per tile (e^{−m}·expm1(s), ReLU, Σ|·|, the mask product), as
  ``attention/tiled.py`` does;
* ``gemm``: the tile's q·kᵀ, which no element-wise saving removes.

    python benchmarks/compiled_tiles.py [--threads 1] [--calls 200]

The fast paths run these ops eagerly today; the numbers say how far a fused per-tile loop would
move their CPU-time ratios to SDPA (one SDPA tile costs about 690 µs here, one thread).
"""

from __future__ import annotations

import argparse
import time

import torch


def stats(s, m_old, z_old, a_old):
    m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
    e = torch.exp2(s - m_new)
    corr = torch.exp2(m_old - m_new)
    z = z_old * corr + e.sum(-1, keepdim=True)
    a = (a_old + z_old * (m_old - m_new)) * corr + (e * (s - m_new)).sum(-1, keepdim=True)
    return m_new, z, a


def softpick(s, m, keep):
    d = s.expm1().mul(torch.exp(-m)).mul(keep)
    return d.relu(), d.abs().sum(-1, keepdim=True)


def per_call(fn, *args, calls: int) -> float:
    """Microseconds of process CPU time per call."""
    for _ in range(5):
        fn(*args)
    c0 = time.process_time()
    for _ in range(calls):
        fn(*args)
    return (time.process_time() - c0) / calls * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 256, 64, generator=g), torch.randn(4, 256, 64, generator=g)
    s = q @ k.transpose(-1, -2)
    m, z, a = torch.zeros(4, 256, 1), torch.ones(4, 256, 1), torch.zeros(4, 256, 1)
    keep = torch.ones_like(s)
    t0 = time.perf_counter()
    stats_c, softpick_c = (
        torch.compile(stats, dynamic=False),
        torch.compile(softpick, dynamic=False),
    )
    stats_c(s, m, z, a), softpick_c(s, m, keep)
    print(f"threads {args.threads}; compiling both: {time.perf_counter() - t0:.1f} s wall")
    print("| tile work | eager µs | compiled µs |")
    print("|---|---|---|")
    for name, eager, comp, xs in (
        ("adaptive stats", stats, stats_c, (s, m, z, a)),
        ("softpick forward", softpick, softpick_c, (s, m, keep)),
    ):
        e, c = per_call(eager, *xs, calls=args.calls), per_call(comp, *xs, calls=args.calls)
        print(f"| {name} | {e:.0f} | {c:.0f} |")
    kt = k.transpose(-1, -2)
    print(f"| q·kᵀ (GEMM) | {per_call(torch.matmul, q, kt, calls=args.calls):.0f} | – |")


if __name__ == "__main__":
    main()
