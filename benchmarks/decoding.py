"""Decoding speed of every method with a fast path, as ratios to torch's SDPA.

One decoding step: ``Lq`` query rows (1: one new token; 16: a block of tokens, as speculative
decoding checks) against a cache of ``Lk`` keys and values, ``attend(q, k, v, method,
causal=True)`` (query i sees keys j <= i + Lk − Lq), B=1, H=8, D=64, float32 by default, under
``torch.no_grad``. The reference is ``F.scaled_dot_product_attention`` on the same q, k, v,
non-causal (with one row the same keys; SDPA's ``is_causal`` aligns the rows to the cache's start,
which is not decoding). Each case runs once to warm up (the C++ loops are built then), then the
cases are called round by round, interleaved, and each time is the median wall-clock time of its
rounds. ``check_finite`` False (no check reads the tensors) and True (the inputs are read for NaN,
infinities and the overflow bound) are two columns.

    python benchmarks/decoding.py                              # Lk 4k, 16k, 64k; Lq 1 and 16
    python benchmarks/decoding.py --quick                      # Lk 4k, 3 rounds
    python benchmarks/decoding.py --methods stick_breaking,softmax --lengths 32768
    python benchmarks/decoding.py --threads 1        # a shared machine: one thread, steadier
    python benchmarks/decoding.py --out benchmarks/results/decoding.json   # JSON (asked for)

Nothing is written unless ``--out`` is given, and an existing file is only replaced with
``--force``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from attention import machine  # noqa: E402  (benchmarks/attention.py: the machine's line)

from sharpattn import attend  # noqa: E402
from sharpattn.normalizers import available, get  # noqa: E402

B, H, D = 1, 8, 64
LENGTHS = "4096,16384,65536"
QUICK_LENGTHS = "4096"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def methods_with_fast_path() -> list[str]:
    """Every registered method whose entry names a fast path (``Normalizer.fused``)."""
    return [m for m in available() if get(m).fused]


def make_inputs(lq: int, lk: int, dtype: torch.dtype, heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, lq, dim, generator=g).to(dtype)
    k = torch.randn(B, heads, lk, dim, generator=g).to(dtype)
    v = torch.randn(B, heads, lk, dim, generator=g).to(dtype)
    return q, k, v


def runner(case: str, q, k, v, check_finite: bool):
    if case == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v)
    return lambda: attend(q, k, v, case, causal=True, check_finite=check_finite)


def bench(lq: int, lk: int, cases: list[tuple[str, bool]], rounds: int, args) -> dict:
    """Median seconds per call of each (case, check_finite), interleaved round by round."""
    q, k, v = make_inputs(lq, lk, DTYPES[args.dtype], args.heads, args.dim)
    fns = {c: runner(c[0], q, k, v, c[1]) for c in cases}
    times: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    with torch.no_grad():
        for fn in fns.values():  # warm-up
            fn()
        for _ in range(rounds):
            for c, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[c].append(time.perf_counter() - t0)
    return {c: statistics.median(t) for c, t in times.items()}


def rows_of(lq: int, lk: int, medians: dict, checks: list[bool]) -> list[dict]:
    sdpa = medians[("sdpa", False)]
    rows = [{"method": "sdpa", "lq": lq, "lk": lk, "ms": {"sdpa": sdpa * 1e3}}]
    for method in dict.fromkeys(c[0] for c in medians if c[0] != "sdpa"):
        row = {"method": method, "lq": lq, "lk": lk, "ms": {}, "ratio": {}, "tokens_per_s": {}}
        for check in checks:
            t = medians[(method, check)]
            key = f"check_finite={check}"
            row["ms"][key] = t * 1e3
            row["ratio"][key] = t / sdpa
            row["tokens_per_s"][key] = lq / t
        rows.append(row)
    return rows


def table(rows: list[dict], checks: list[bool]) -> str:
    head = "| method | Lq | Lk | SDPA ms |"
    rule = "|---|---|---|---|"
    for check in checks:
        head += f" ms/step cf={check} | tok/s cf={check} | ratio cf={check} |"
        rule += "---|---|---|"
    lines = [head, rule]
    sdpa = {(r["lq"], r["lk"]): r["ms"]["sdpa"] for r in rows if r["method"] == "sdpa"}
    for r in rows:
        if r["method"] == "sdpa":
            continue
        line = f"| {r['method']} | {r['lq']} | {r['lk']} | {sdpa[(r['lq'], r['lk'])]:.3f} |"
        for check in checks:
            key = f"check_finite={check}"
            line += f" {r['ms'][key]:.3f} | {r['tokens_per_s'][key]:.0f} | {r['ratio'][key]:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default=None, help=f"cache lengths Lk (default {LENGTHS})")
    p.add_argument("--rows", default="1,16", help="query rows per step (default 1,16)")
    p.add_argument("--methods", default="", help="comma-separated (default: every fast path)")
    p.add_argument(
        "--check-finite",
        choices=["both", "no", "yes"],
        default="both",
        help="which check_finite columns: False, True or both (default)",
    )
    p.add_argument("--rounds", type=int, default=None, help="calls per case (default 15)")
    p.add_argument("--quick", action="store_true", help=f"Lk {QUICK_LENGTHS} only, 3 rounds")
    p.add_argument("--heads", type=int, default=H)
    p.add_argument("--dim", type=int, default=D)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's own count)"
    )
    p.add_argument("--out", default=None, help="write the rows as JSON here (default: nowhere)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    lengths = [
        int(x) for x in (args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)).split(",")
    ]
    rounds = args.rounds or (3 if args.quick else 15)
    row_counts = [int(x) for x in args.rows.split(",")]
    checks = {"both": [False, True], "no": [False], "yes": [True]}[args.check_finite]
    methods = args.methods.split(",") if args.methods else methods_with_fast_path()
    unknown = sorted(set(methods) - set(methods_with_fast_path()))
    if unknown:
        p.error(f"not a method with a fast path: {', '.join(unknown)}")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not args.force:
        p.error(f"{out} exists; pass --force to replace it")
    cases = [("sdpa", False)] + [(m, c) for m in methods for c in checks]
    print(f"machine: {machine()}", flush=True)
    rows = []
    for lk in lengths:
        for lq in row_counts:
            t0 = time.perf_counter()
            rows += rows_of(lq, lk, bench(lq, lk, cases, rounds, args), checks)
            print(f"Lq={lq} Lk={lk} done in {time.perf_counter() - t0:.1f}s", flush=True)
    print()
    print(table(rows, checks))
    data = {
        "machine": machine(),
        "shape": {"B": B, "H": args.heads, "D": args.dim, "dtype": args.dtype},
        "rounds": rounds,
        "statistic": "median wall-clock seconds per call, interleaved rounds",
        "rows": rows,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2))
        print(f"\nwrote {out}")
    return data


if __name__ == "__main__":
    main()
