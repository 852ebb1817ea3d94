"""CPU time of the sparse normalizers' O(n)-memory paths (attention/cpu/sparse_tiled.py) as ratios to
torch's SDPA, forward and forward+backward, non-causal and causal (B=1, H=4, D=64, float32).

One thread (``torch.set_num_threads(1)``: the 2-core machine is shared), CPU time of the process
(``time.process_time``), SDPA and each path interleaved round by round, min over rounds; the
ratio is against SDPA with the same causal flag. ``check_finite=False`` (the paths as a model
runs them). The "GEMM floor" row times only the block GEMMs the path must do (forward: q·kᵀ and
p·v per query block; backward adds dO·vᵀ, ds·k, dsᵀ·q, pᵀ·dO and the recomputed q·kᵀ), the part
no solver change removes.

    python benchmarks/sparse_tiled.py --sizes 4096 --rounds 3
    python benchmarks/sparse_tiled.py --sizes 16384 --rounds 2 --forward-only
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sharpattn.attention import attend
from sharpattn.attention.cpu.sparse_tiled import block_rows

B, H, D = 1, 4, 64
METHODS = {
    "sparsemax": ("sparsemax", {}),
    "entmax15": ("entmax15", {}),
    "entmax a=1.3": ("entmax", {"alpha": 1.3}),
    "asentmax": ("asentmax", {}),
    "topk k=8": ("topk", {}),
}


def cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def step(fn, q, k, v, backward: bool):
    if not backward:
        with torch.no_grad():
            fn(q, k, v)
        return
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    fn(qq, kk, vv).sum().backward()


def gemm_floor(q, k, v, causal: bool, backward: bool):
    """Only the GEMMs of the query-block walk (the same block sizes as the path)."""
    n = q.shape[2]
    bq = block_rows(B * H, n, n)
    for r0 in range(0, n, bq):
        r1 = min(r0 + bq, n)
        c1 = r1 if causal else n
        qb, kb, vb = q[..., r0:r1, :], k[..., :c1, :], v[..., :c1, :]
        s = torch.matmul(qb, kb.transpose(-2, -1))
        torch.matmul(s, vb)
        if backward:
            torch.matmul(qb, kb.transpose(-2, -1))  # recomputed scores
            g = torch.matmul(qb, vb.transpose(-2, -1))  # dO·vᵀ
            torch.matmul(g, kb)  # ds·k
            torch.matmul(g.transpose(-2, -1), qb)  # dsᵀ·q
            torch.matmul(s.transpose(-2, -1), qb)  # pᵀ·dO


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sparse_tiled.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print(
        f"{'n':>6} {'method':14} {'causal':6} {'pass':7} {'SDPA s':>7} {'path s':>7} {'ratio':>6}"
    )
    for n in (int(x) for x in args.sizes.split(",")):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
        for backward in (False,) if args.forward_only else (False, True):
            for causal in (False, True):

                def sdpa(q, k, v, causal=causal):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                cands = {"GEMM floor": None}
                cands.update({m: METHODS[m] for m in args.methods.split(",")})
                for label, spec in cands.items():
                    if spec is None:

                        def fn(q, k, v, causal=causal, backward=backward):
                            with torch.no_grad():
                                gemm_floor(q, k, v, causal, backward)
                            return q.sum().requires_grad_() if backward else q

                    else:
                        method, params = spec

                        def fn(q, k, v, method=method, params=params, causal=causal):
                            return attend(
                                q,
                                k,
                                v,
                                method,
                                causal=causal,
                                impl="fused",
                                check_finite=False,
                                **params,
                            )

                    best_s = best_p = float("inf")
                    inputs = (q, k, v, backward)
                    for _ in range(args.rounds):
                        best_s = min(best_s, cpu(lambda a=inputs: step(sdpa, *a)))
                        best_p = min(best_p, cpu(lambda fn=fn, a=inputs: step(fn, *a)))
                    pas = "fwd+bwd" if backward else "fwd"
                    row = dict(
                        n=n, method=label, causal=causal, pass_=pas, sdpa=best_s, path=best_p
                    )
                    rows.append(row)
                    print(
                        f"{n:>6} {label:14} {causal!s:6} {pas:7} {best_s:7.3f} {best_p:7.3f} "
                        f"{best_p / best_s:6.2f}",
                        flush=True,
                    )
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
