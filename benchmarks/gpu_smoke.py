"""The GPU smoke check: every kernel variant ``gpu.py`` will launch, run once and checked, one
process per family and head dimension in parallel (which also fills Triton's cache before the
timed runs).

Per family (the registry's: ``RowScaled``, ``Sink``, ``Adaptive``, ``Elementwise``,
``RowNormalised``, ``Sparse``, ``TopK``, ``StickBreaking``), every case of
``gpu_common.CASES`` in it, at each head dimension, causal and not (stick-breaking causal only):
``attend(impl="auto")`` forward and backward in ``--dtype`` (bfloat16; B 1, H 16, n = 1,024 by
default) against the naive path in float32, with the tests' rule for 16-bit results
(``tests/paths/test_triton.py``): the error of each of out, dq, dk, dv at most 4× the error of
the same naive computation in the same dtype, plus a quarter of the dtype's rounding of the
largest entry (``tests/precision.py``). In float32 the bound is ``precision.tolerance`` with
n keys.

    python benchmarks/gpu_smoke.py                      # every family, in parallel
    python benchmarks/gpu_smoke.py --family Sparse      # one, in this process

One line per family: variants passed, the worst error as a fraction of its bound, seconds; a
failing variant is named with its error. ``--cells`` appends one JSON line per variant.
``--device cpu --triton-cpu --dtype float32`` is the dry run (Triton's interpreter).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # precision.py: the tests' tolerance rule
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import CASES, CAUSAL_ONLY, append_cell, family, method_case  # noqa: E402

NAMES = ("out", "dq", "dk", "dv")


def families(cases) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for case in cases:
        grouped.setdefault(family(case), []).append(case)
    return grouped


def check_case(case: str, n: int, heads: int, d: int, causal: bool, dtype, device) -> dict:
    """One variant: the fast path against the float32 naive path; each output's error over its
    bound (a ratio ≤ 1 passes)."""
    import torch

    from precision import tolerance
    from sharpattn.attention import attend

    method, params = method_case(case)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, heads, n, d, generator=g) for _ in range(3)]
    dout = torch.randn(1, heads, n, d, generator=g).to(device)

    def run(impl, dt):
        leaves = [t.to(device, dt).requires_grad_() for t in base]
        out = attend(*leaves, method, causal=causal, impl=impl, check_finite=False, **params)
        grads = torch.autograd.grad(out, leaves, dout.to(dt), allow_unused=True)
        return [out.detach()] + [
            torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads, strict=True)
        ]

    got = run("auto", dtype)
    ref = run("naive", torch.float32)
    eager = run("naive", dtype) if dtype != torch.float32 else None
    worst, bad = 0.0, []
    for i, what in enumerate(NAMES):
        want = ref[i].double()
        ours = float((got[i].double() - want).abs().max())
        scale = float(want.abs().max())
        if eager is None:
            bound = tolerance(dtype, n=n, magnitude=max(scale, 1e-30))
        else:
            theirs = float((eager[i].double() - want).abs().max())
            bound = 4 * theirs + tolerance(dtype, magnitude=scale, ulps=0.25)
        ratio = ours / bound if bound > 0 else (0.0 if ours == 0 else float("inf"))
        if not ratio <= 1:  # NaN fails too
            bad.append(f"{what} {ours:.3g} > {bound:.3g}")
        worst = max(worst, ratio) if ratio == ratio else float("inf")
    return {"worst": worst, "failed": "; ".join(bad)}


def run_family(name: str, cases: list[str], args) -> int:
    import torch

    if args.triton_cpu:
        from gpu_common import route_triton_to_cpu

        route_triton_to_cpu()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    t0 = time.perf_counter()
    passed, total, worst, failures = 0, 0, 0.0, []
    for case in cases:
        for d in (int(x) for x in args.head_dims.split(",")):
            causals = (True,) if method_case(case)[0] in CAUSAL_ONLY else (False, True)
            for causal in causals:
                total += 1
                variant = f"{case} D{d}{' causal' if causal else ''}"
                row = {
                    "kind": "smoke",
                    "family": name,
                    "method": case,
                    "D": d,
                    "causal": causal,
                    "n": args.n,
                    "H": args.heads,
                    "dtype": args.dtype,
                }
                try:
                    res = check_case(case, args.n, args.heads, d, causal, dtype, device)
                except Exception as err:
                    res = {
                        "worst": float("inf"),
                        "failed": f"{type(err).__name__}: {str(err).strip()}"[:300],
                    }
                append_cell(args.cells, row | res)
                if res["failed"]:
                    failures.append(f"{variant}: {res['failed'].splitlines()[0]}")
                else:
                    passed += 1
                worst = max(worst, res["worst"])
    line = (
        f"{name} D{args.head_dims}: {passed}/{total} variants within bound (worst {worst:.2f} of its bound), "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print(line, flush=True)
    for f in failures:
        print(f"  FAILED {f}", flush=True)
    return 0 if passed == total else 1


def run_all(args, argv: list[str]) -> int:
    """One process per family and head dimension, in parallel, each under ``--timeout`` (a stuck
    one gets SIGABRT,
    so ``-X faulthandler`` prints its stack, then SIGKILL)."""
    groups = families(args.cases.split(","))
    procs = {}
    for name in groups:
        for d in args.head_dims.split(","):  # a head dimension's kernels are variants of their own
            cmd = [sys.executable, "-X", "faulthandler", __file__, *argv]
            cmd += ["--family", name, "--head-dims", d]
            procs[f"{name} D{d}"] = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
    deadline = time.monotonic() + args.timeout
    code = 0
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            out = f"{name}: TIMEOUT after {args.timeout:.0f} s (its stack below)\n{out}"
            append_cell(
                args.cells,
                {
                    "kind": "smoke",
                    "family": name,
                    "method": None,
                    "failed": f"timeout after {args.timeout:.0f} s",
                },
            )
        print(out.rstrip(), flush=True)
        code = code or proc.returncode or (1 if "TIMEOUT" in out else 0)
    return code


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default=None, help="run one family here (default: all, parallel)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--device", default="cuda")
    p.add_argument("--triton-cpu", action="store_true", help="dry run: Triton's interpreter")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds for all families")
    p.add_argument("--cells", default=None, help="append each variant as a JSON line here")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.family is None:
        return run_all(args, argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cases = families(args.cases.split(",")).get(args.family, [])
    return run_family(args.family, cases, args)


if __name__ == "__main__":
    sys.exit(main())
