"""App. G's streamed entropy at 131,072 keys: accuracy against float64 and peak memory.

One head (B = H = 1, D = 64, float32), Lq = Lk = n (default 131,072). Query rows are scaled by
factors spread over [1, ``--max-scale``] so the rows' softmax entropies cover the range where
adaptive temperature changes β (H between 0.5 and ~5.9 nats) and beyond (up to log n).

* The fused adaptive path, ``attend(q, k, v, "adaptive", impl="fused", return_stats=True)``,
  runs in a fresh subprocess; its peak resident set is ``resource.getrusage(RUSAGE_SELF)
  .ru_maxrss`` (tracemalloc does not see torch's allocations), beside the resident set once the
  inputs exist. It returns, per row, H(softmax(s)) (streamed, App. G), β(H), and the entropy of
  the adaptive weights softmax(β·s) (streamed too).
* The reference, in this process, for ``--check`` rows spread evenly over the n queries: the
  full score rows in float64 (``--chunk`` rows at a time), p = exp(s − logsumexp s),
  H = −Σ p·log p directly (not App. G's formula), β from the same polynomial in NumPy, and the
  entropy of softmax(β·s).
* The score matrix the fused path never forms: n² float32 entries.

    python benchmarks/streaming_entropy.py                 # n = 131,072 (about 10 min, 1 thread)
    python benchmarks/streaming_entropy.py --n 8192        # a quick run
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

D = 64
ICML = np.array([-0.037, 0.481, -2.3, 4.917, -1.791])  # Fig. 4 (highest power first)


def inputs(n: int, max_scale: float, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, n, D, generator=g)
    k = torch.randn(1, 1, n, D, generator=g)
    v = torch.randn(1, 1, n, D, generator=g)
    scale = torch.linspace(1.0, max_scale, n).reshape(1, 1, n, 1)  # row i: scores × scale_i
    return q * scale, k, v


def check_rows(n: int, count: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, count).round().astype(np.int64))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(n: int, max_scale: float, count: int, threads: int) -> None:
    """The fused call in this fresh process; prints one JSON line."""
    from sharpattn.attention import attend

    torch.set_num_threads(threads)
    q, k, v = inputs(n, max_scale)
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    with torch.no_grad():
        _, st = attend(q, k, v, "adaptive", impl="fused", return_stats=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rows = check_rows(n, count)
    pick = {
        f: getattr(st, f)[0, 0, rows].double().tolist()
        for f in ("softmax_entropy", "beta", "entropy")
    }
    h = st.softmax_entropy[0, 0]
    print(
        json.dumps(
            {
                "base_mib": base / 1024,
                "peak_mib": peak / 1024,
                "wall_s": wall,
                "rows": rows.tolist(),
                **pick,
                "h_range": [float(h.min()), float(h.max())],
                "rows_sharpened": int((st.beta[0, 0] > 1).sum()),
            }
        )
    )


def reference(n: int, max_scale: float, rows: np.ndarray, chunk: int) -> dict[str, np.ndarray]:
    """float64 H(softmax(s)), β(H) and H(softmax(β·s)) for the query ``rows``."""
    q, k, _ = inputs(n, max_scale)
    q, k = q[0, 0].double(), k[0, 0].double()
    out = {"softmax_entropy": [], "beta": [], "entropy": []}

    def entropy(s: torch.Tensor) -> np.ndarray:
        logp = s - torch.logsumexp(s, dim=-1, keepdim=True)
        return (-(logp.exp() * logp).sum(-1)).numpy()

    for i in range(0, len(rows), chunk):
        s = q[torch.as_tensor(rows[i : i + chunk])] @ k.T / math.sqrt(D)  # (chunk, n) float64
        h = entropy(s)
        beta = np.where(h > 0.5, np.maximum(np.polyval(ICML, h), 1.0), 1.0)
        out["softmax_entropy"].append(h)
        out["beta"].append(beta)
        out["entropy"].append(entropy(s * torch.from_numpy(beta)[:, None]))
    return {key: np.concatenate(v) for key, v in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=131_072)
    ap.add_argument("--max-scale", type=float, default=8.0)
    ap.add_argument("--check", type=int, default=256, help="query rows checked against float64")
    ap.add_argument("--chunk", type=int, default=32, help="float64 reference rows at a time")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/streaming_entropy.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.n, a.max_scale, a.check, a.threads)
        return
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", "--n", str(a.n), "--max-scale", str(a.max_scale)]
    cmd += ["--check", str(a.check), "--threads", str(a.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"fused run failed: {res.stderr.strip()[-500:]}")
    fused = json.loads(res.stdout.strip().splitlines()[-1])
    t1 = time.perf_counter()
    ref = reference(a.n, a.max_scale, np.asarray(fused["rows"]), a.chunk)
    t2 = time.perf_counter()
    errors = {
        key: float(np.abs(np.asarray(fused[key]) - ref[key]).max())
        for key in ("softmax_entropy", "beta", "entropy")
    }
    matrix_mib = a.n * a.n * 4 / 2**20
    result = {
        "n": a.n,
        "d": D,
        "threads": a.threads,
        "max_scale": a.max_scale,
        "rows_checked": len(fused["rows"]),
        "max_abs_error": errors,
        "reference_h_range": [
            float(ref["softmax_entropy"].min()),
            float(ref["softmax_entropy"].max()),
        ],
        "fused_h_range": fused["h_range"],
        "rows_sharpened": fused["rows_sharpened"],
        "fused_wall_s": fused["wall_s"],
        "reference_wall_s": t2 - t1,
        "total_wall_s": t2 - t0,
        "rss_after_inputs_mib": fused["base_mib"],
        "peak_rss_mib": fused["peak_mib"],
        "peak_above_inputs_mib": fused["peak_mib"] - fused["base_mib"],
        "score_matrix_float32_mib": matrix_mib,
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
