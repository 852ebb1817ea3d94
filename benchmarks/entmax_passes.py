"""How much work CUDA's entmax kernel does, counted in Triton's interpreter (no GPU needed).

The kernel (``attention/triton_elementwise.py``, `_entmax_forward_kernel`) makes one pass over
the key blocks for each row's maximum, Newton passes for the threshold τ until no row of the
block moves by more than float32's resolution of its scores (at most ``ENTMAX_STEPS``), and one
output pass; the Newton passes after the first and the output pass skip key blocks whose
largest score lies below every row's τ (the block support). This script runs the real kernel in
the interpreter (``TRITON_INTERPRET=1``, set here) on one block of 64 query rows and counts:

* Newton passes (calls of ``_newton``), against the cap, and
* key-block products q·kᵀ (calls of ``block_scores``), against what the same passes would make
  without skipping (every pass over every visible block) and what the cap's passes would
  without skipping (the kernel before the stopping rule and the block support),

for rows of random scores (q and k Gaussian, D = 64, q times ``gain``: flat rows at 1, peaked at
4) and for local rows (key j is (cos jω, sin jω) over 32 frequencies, query i a multiple of key
i: scores fall with the distance |i − j|, as in trained heads that attend near the diagonal;
causal). Counts, not times: the interpreter runs NumPy, so its speed says nothing about a GPU's.

    python benchmarks/entmax_passes.py
    python benchmarks/entmax_passes.py --sizes 1024,4096 --alphas 2,1.5
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # read by triton when it is imported, below

import torch  # noqa: E402

from sharpattn.attention.masking import Masking  # noqa: E402
from sharpattn.attention.triton import sparse as K  # noqa: E402

ROWS, D, BLOCK = 64, 64, 64


def counted(name: str, calls: list):
    """Replace kernel helper ``name`` (a jitted function the interpreter calls as Python) by one
    that appends to ``calls`` each time it runs."""
    inner = getattr(K, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return inner(*args, **kwargs)

    setattr(K, name, wrapper)


def inputs(kind: str, n: int, gain: float, g: torch.Generator):
    """(q, k, v, causal): the last ``ROWS`` queries of ``n`` keys."""
    if kind == "random":
        q = torch.randn(1, 1, ROWS, D, generator=g) * gain
        k = torch.randn(1, 1, n, D, generator=g)
        causal = False
    else:  # local: cos/sin features, q_i = gain · k_{n − ROWS + i}
        angle = torch.arange(float(n))[:, None] * torch.logspace(-3, 0, D // 2)[None, :]
        k = torch.cat([angle.cos(), angle.sin()], -1).view(1, 1, n, D)
        q = k[:, :, n - ROWS :] * gain
        causal = True
    return q, k, torch.randn(1, 1, n, D, generator=g), causal


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,4096")
    p.add_argument("--alphas", default="2,1.5,1.3")
    args = p.parse_args(argv)
    calls: list[str] = []
    counted("_newton", calls)
    counted("block_scores", calls)
    g = torch.Generator().manual_seed(0)
    print(
        "| rows | n | α | Newton passes (cap) | key-block products | without skipping | "
        "all cap passes, no skipping |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, gain in (("random", 1.0), ("random", 4.0), ("local", 4.0)):
        for n in (int(x) for x in args.sizes.split(",")):
            q, k, v, causal = inputs(kind, n, gain, g)
            masking = Masking.build(None, causal, ROWS, n, q.device)
            for alpha in (float(a) for a in args.alphas.split(",")):
                calls.clear()
                K.entmax_attention(q, k, v, masking, D**-0.5, alpha, blocks=(BLOCK, BLOCK))
                passes, products = calls.count("_newton"), calls.count("block_scores")
                blocks = -(-n // BLOCK)  # every block is visible to the last rows
                cap = K.ENTMAX_STEPS.get(alpha, K.ENTMAX_STEPS_DEFAULT)
                print(
                    f"| {kind}, q × {gain:g} | {n:,} | {alpha:g} | {passes} ({cap}) | "
                    f"{products:,} | {(passes + 2) * blocks:,} | {(cap + 2) * blocks:,} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
