"""Every method's ``impl="auto"`` path on a CUDA GPU, as ratios to torch's SDPA on the same GPU.

For each n (Lq = Lk; B = 1, H = ``--heads``, D = ``--head-dim``, ``--dtype``), non-causal and
causal, forward and forward+backward, each cell measures (``--lq``: decoding steps instead, Lq
query rows against n keys, the rows at the end of the keys when causal, j <= i + n − Lq; the
baselines then non-causal, as ``decoding.py`` takes them: with one row the same keys, and
SDPA's ``is_causal`` aligns the rows to the keys' start, which is not decoding):

* **kernel time**: CUDA events around N back-to-back calls (no synchronisation between them;
  N chosen so that the N calls take about ``--window-ms``), divided by N; the median over
  ``--reps`` such windows, after a warm-up call (compilation) and with the clocks warmed by a
  matrix product first. Ratios against **two baselines** measured the same way in the same
  process: SDPA pinned to flash attention (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, where
  the dtype allows it) and SDPA as torch picks it (cuDNN on torch 2.11 on Hopper); the backend
  the default ran is read from its kernels' names (torch's profiler) and stored;
* **host time**: the wall time per call of the same method and mode on 128 keys (work too small
  to matter, synchronised after every call): what a call costs Python and the launches alone.
  A cell whose host time is near its kernel time measures the host, not the kernels;
* **memory**: the peak of ``torch.cuda.max_memory_allocated`` during one call above what was
  allocated before it (inputs excluded), and its ratio to flash attention's (default SDPA's
  where flash cannot run).

``--docs N``: packed cells instead: the n tokens are N documents of n/N tokens in one sequence,
the method called with ``cu_seqlens`` (causal within each document), the baselines SDPA on the
documents as a batch of N (what packing must match: no work across documents). ``--window W``:
sliding-window cells, the method called with ``window=(W − 1, 0)`` (causal), the baselines SDPA
with the banded boolean mask of the same window (flash takes no mask: its cell is an error row).

Each cell is named on stdout before it runs (a cell that never ends is named), and written as it
ends: to ``--out`` (the whole result, JSON) and appended as one line to ``--cells`` (JSON lines,
what ``gpu_check.py`` collects). A method that raises is an ``error`` row; a CUDA error (which
poisons the process's context) ends the run after its row. Cells past ``--deadline`` seconds
are listed as skipped. ``--device cpu --triton-cpu`` is a dry run on the CPU (tiny sizes, the
kernels in Triton's interpreter: ``TRITON_INTERPRET=1``), to check the script, not to time.

    python benchmarks/gpu.py --dtype bfloat16 --heads 16 --sizes 16384,4096 --modes fwdbwd \\
        --methods sigmoid,adaptive --out /tmp/gpu.json
    python benchmarks/gpu.py --table benchmarks/results/gpu_bf16_triton.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_common import ANCHORS, CAUSAL_ONLY, append_cell, family, method_case, versions

B = 1

#: the targets (forward+backward time as a ratio to SDPA's flash kernel, bfloat16, n >= 4,096)
#: by method: the softmax family and the sink within FlexAttention's distance of flash, the
#: element-wise and row-normalised maps within FlashSigmoid's, adaptive two flash passes
TARGETS = {
    **dict.fromkeys(("softmax", "ssmax", "length_scaled", "llama4_temperature", "logn"), 1.1),
    "sink": 1.1,
    **dict.fromkeys(("sigmoid", "relu", "relu@p=2", "power", "signed", "softpick"), 1.3),
    "adaptive": 2.2,
    **dict.fromkeys(("sparsemax", "entmax15", "entmax", "asentmax", "stick_breaking"), 2.0),
    "entmax@alpha=1.3": 2.0,
    **dict.fromkeys(("topk", "hardmax"), 1.5),
}
#: the sparse maps: each forward cell also reports the fraction of nonzero weights (support)
SUPPORTED = ("sparsemax", "entmax15", "entmax", "asentmax")
#: the baselines: SDPA pinned to flash attention, and SDPA as torch picks it
BASELINES = ("flash", "default")
#: keys of the "empty work" call that measures a method's host time
HOST_N = 128
#: keys of a decoding cell's host-time call: enough that the Triton template splits the keys as
#: the cell's call does (``template.SPLIT_MIN_LK``), two launches and the scratch
HOST_DECODE_N = 1024


def support(method: str, params: dict, q, k, v, causal: bool, rows: int = 64) -> float:
    """The fraction of a sparse map's weights that are nonzero among the visible ones, on the
    last ``rows`` query rows (the naive path's weights: O(rows·n) memory)."""
    from sharpattn.attention import attend

    with torch.no_grad():
        _, w = attend(
            q[..., -rows:, :],
            k,
            v,
            method,
            causal=causal,
            return_weights=True,
            impl="naive",
            **params,
        )
    rows = w.shape[-2]
    visible = w.shape[-1] * rows - (rows * (rows - 1) // 2 if causal else 0)
    return float((w != 0).sum()) / (visible * w.shape[0] * w.shape[1])


@contextlib.contextmanager
def _tiles(on: bool):
    """``SHARPATTN_TRITON=0`` while ``on``: the Triton methods on the PyTorch tiles."""
    before = os.environ.get("SHARPATTN_TRITON")
    if on:
        os.environ["SHARPATTN_TRITON"] = "0"
    try:
        yield
    finally:
        if on and before is None:
            del os.environ["SHARPATTN_TRITON"]
        elif on:
            os.environ["SHARPATTN_TRITON"] = before


def sdpa(backend: str, q, k, v, causal: bool):
    """SDPA pinned to flash attention (``"flash"``) or as torch picks it (``"default"``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def pinned():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return pinned


def backend_of(fn) -> str:
    """Which SDPA backend ``fn`` ran, from the names of the CUDA kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name.lower() for e in prof.events() if "cuda" in str(e.device_type).lower()]
    except Exception as err:  # a profiler that cannot run here
        return f"unknown ({type(err).__name__})"
    for key, label in (
        ("cudnn", "cudnn"),
        ("flash", "flash"),
        ("fmha", "efficient"),
        ("efficient", "efficient"),
    ):
        if any(key in n for n in names):
            return label
    return "math" if names else "unknown (no kernel seen)"


def anchor(name: str, q, k, v, causal: bool):
    """The call of anchor ``name`` (`ANCHORS`), or a reason it cannot run here."""
    package, _ = ANCHORS[name]
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    if q.device.type != "cuda":
        return "needs a CUDA GPU"
    if name == "adasplash":
        from adasplash import adasplash

        return lambda: adasplash(q, k, v, alpha=1.5, is_causal=causal)
    if not causal:
        return "stick-breaking is causal only"
    from stickbreaking_attention.sb_attn import sb_attn

    # its forward returns (out, remainder); the remainder is what our "remainder" adds back
    return lambda: sb_attn(q, k, v, inv_temp=1 / q.shape[-1] ** 0.5)[0]


def call(name: str, q, k, v, causal: bool, structure: dict | None = None):
    """The call of case ``name`` (``method``, ``method@param=value``, ``method:tiles``,
    ``anchor:NAME``), or a reason it cannot run here; ``structure``: the packed or windowed
    cell's keywords (`structured`)."""
    from sharpattn.attention import attend

    if name.startswith("anchor:"):
        if structure:
            return "the anchors take no packed or windowed call here"
        return anchor(name.partition(":")[2], q, k, v, causal)
    method, params = method_case(name)
    method, _, path = method.partition(":")  # "sigmoid:tiles": without the Triton kernels
    extra = structure or {}

    def run():
        with _tiles(path == "tiles"):
            return attend(q, k, v, method, causal=causal, check_finite=False, **params, **extra)

    return run


def structured(n: int, docs: int | None, window: int | None, device) -> dict:
    """The keywords of a packed (``docs`` equal documents of the n tokens: ``cu_seqlens``) or
    windowed (``window=(W − 1, 0)``) call; {} for a plain one."""
    if docs:
        if n % docs:
            raise SystemExit(f"--docs {docs} must divide every size (got {n}).")
        bounds = torch.arange(0, n + 1, n // docs, dtype=torch.int32, device=device)
        return {"cu_seqlens": bounds}
    if window:
        return {"window": (window - 1, 0)}
    return {}


def sdpa_structured(backend: str, q, k, v, docs: int | None, window: int | None):
    """The baseline of a packed cell (SDPA on the ``docs`` documents as a batch, causal, the
    output back in the packed layout) or of a windowed one (SDPA with the banded mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, h, n, d = q.shape
    pin = (
        (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))
        if backend == "flash"
        else contextlib.nullcontext
    )
    if docs:

        def batch(x):  # [1, H, n, D] -> [docs, H, n/docs, D], a view
            return x[0].reshape(h, docs, n // docs, d).transpose(0, 1)

        def packed():
            with pin():
                out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), is_causal=True)
            return out.transpose(0, 1).reshape(1, h, n, d)

        return packed
    i = torch.arange(n, device=q.device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)

    def windowed():
        with pin():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band)

    return windowed


class Timer:
    """Kernel time of back-to-back calls between CUDA events (wall time on the CPU)."""

    def __init__(self, device: torch.device, window_ms: float, reps: int, host_calls: int):
        self.cuda = device.type == "cuda"
        self.window_ms, self.reps, self.host_calls = window_ms, reps, host_calls

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def window(self, once, calls: int) -> float:
        """Milliseconds per call over ``calls`` back-to-back calls."""
        self.sync()
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(calls):
                once()
            return (time.perf_counter() - t) * 1e3 / calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            once()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    def host(self, once) -> float:
        """Wall milliseconds per call, synchronised after each (median of ``host_calls``, after
        one call that compiles)."""
        once()
        times = []
        for _ in range(self.host_calls):
            self.sync()
            t = time.perf_counter()
            once()
            self.sync()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    def measure(self, once) -> dict:
        """``ms`` (median over ``reps`` windows), ``calls`` per window, ``spread`` (max/min)."""
        once()  # warm-up: compilation, lazy initialisation, cuBLAS handles
        first = self.window(once, 1)
        calls = max(1, min(100, round(self.window_ms / max(first, 1e-3))))
        times = [self.window(once, calls) for _ in range(self.reps)]
        return {
            "ms": statistics.median(times),
            "calls": calls,
            "spread": max(times) / max(min(times), 1e-9),
        }


def peak_extra_mib(once, device: torch.device) -> float:
    """Peak CUDA memory above what was allocated before one call (NaN off CUDA)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    once()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def warm_clocks(device: torch.device, ms: float = 300.0) -> None:
    """Busy the GPU with matrix products for about ``ms`` (it idles at a low clock)."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t = time.perf_counter()
    while (time.perf_counter() - t) * 1e3 < ms:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def work(fn, mode: str, leaves, grad):
    """One call of ``fn`` (with its backward for ``fwdbwd``)."""

    def once():
        out = fn()
        if mode == "fwdbwd":
            torch.autograd.grad(out, leaves, grad, allow_unused=True)
        return out

    return once


def inputs(n: int, heads: int, d: int, device, dtype, seed: int = 0, lq: int | None = None):
    """q, k, v with n keys and ``lq`` query rows (default n)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, heads, rows, d, generator=g).to(device, dtype).requires_grad_()
        for rows in (lq or n, n, n)
    ]


def environment(device: torch.device) -> dict:
    """The machine and versions a result was measured with, the commit measured (None outside a
    git checkout) and the date (UTC): ``benchmarks/gpu_claims.py`` prints them with the
    numbers."""
    import datetime
    import subprocess

    env = versions()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return {
        "device": env["gpu"] if device.type == "cuda" else platform.processor(),
        **env,
        "commit": commit or None,
        "date": date,
    }


def _is_cuda_error(err: BaseException) -> bool:
    return "CUDA error" in str(err) or type(err).__name__ == "AcceleratorError"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,4096,16384")
    p.add_argument(
        "--lq",
        default="",
        help="comma-separated query rows of decoding cells (each against every size); "
        "default: Lq = n",
    )
    p.add_argument("--docs", type=int, default=None, help="packed cells: N documents per size")
    p.add_argument("--window", type=int, default=None, help="sliding-window cells: W keys")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--methods", default="", help="comma-separated cases (default: every method)")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=5, help="timing windows per cell (median)")
    p.add_argument("--window-ms", type=float, default=20.0, help="length of a timing window")
    p.add_argument("--host-calls", type=int, default=5, help="calls timed for the host time")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    p.add_argument(
        "--triton-cpu",
        action="store_true",
        help="dry run: CPU tensors take the Triton kernels (TRITON_INTERPRET=1)",
    )
    p.add_argument("--deadline", type=float, default=1e9, help="seconds; later cells skipped")
    p.add_argument("--out", default=None, help="the whole result as JSON, after every cell")
    p.add_argument("--cells", default=None, help="append each cell as a JSON line here")
    p.add_argument("--tag", default="", help="a label stored in every cell (the check's step)")
    p.add_argument(
        "--table",
        nargs="+",
        metavar="FILE",
        help="print the table of result files (JSON or JSON lines) and exit",
    )
    args = p.parse_args(argv)
    if (args.docs or args.window) and (args.lq or args.causal == "no"):
        p.error("--docs and --window cells are causal and not decoding: no --lq, no --causal no.")
    if args.docs and args.window:
        p.error("--docs and --window are separate cells: give one.")
    if args.table:
        from gpu_check import load, summary

        print(summary(load(args.table)))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    if args.triton_cpu:
        from gpu_common import route_triton_to_cpu

        route_triton_to_cpu()
    from sharpattn.attention.cpu.tiles import device_budget
    from sharpattn.normalizers import available

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    setting = {"dtype": args.dtype, "B": B, "H": args.heads, "D": args.head_dim}
    result = {
        **environment(device),
        **setting,
        "reps": args.reps,
        "window_ms": args.window_ms,
        "tile_factor": device_budget(1, device) if device.type != "cpu" else 1,
        "rows": [],
        "skipped": [],
    }
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)

    def save(row: dict | None = None) -> None:
        result["wall_s"] = time.perf_counter() - t0
        if row is not None:
            result["rows"].append(row)
            append_cell(args.cells, {"kind": "bench", "tag": args.tag, **setting, **row})
        if out:
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1, default=str))
            tmp.replace(out)

    names = args.methods.split(",") if args.methods else list(available())
    timer = Timer(device, args.window_ms, args.reps, args.host_calls)
    warm_clocks(device)
    host_of: dict[tuple, float] = {}
    backends: dict[tuple, str] = {}
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if args.docs or args.window:
        causals = (True,)
    lqs = [int(x) for x in args.lq.split(",")] if args.lq else [None]
    shapes = [(lq, int(s)) for lq in lqs for s in args.sizes.split(",")]
    for lq, n in shapes:
        decoding = {} if lq is None else {"lq": lq}
        decoding |= {"docs": args.docs} if args.docs else {}
        decoding |= {"window": args.window} if args.window else {}
        structure = structured(n, args.docs, args.window, device)
        for causal in causals:
            q, k, v = inputs(n, args.heads, args.head_dim, device, dtype, lq=lq)
            grad = torch.randn_like(q)
            base_causal = causal and lq is None  # decoding: SDPA without its top-left mask
            for mode in args.modes.split(","):
                base = {}
                for backend in BASELINES:
                    fn = (
                        sdpa_structured(backend, q, k, v, args.docs, args.window)
                        if structure
                        else sdpa(backend, q, k, v, base_causal)
                    )
                    once = work(fn, mode, (q, k, v), grad)
                    try:
                        base[backend] = timer.measure(once) | {"mib": peak_extra_mib(once, device)}
                    except RuntimeError as err:  # flash cannot run this dtype or shape
                        base[backend] = {"error": str(err).splitlines()[0][:200]}
                if "ms" in base["default"] and device.type == "cuda":
                    kind = (causal, mode, lq)
                    if kind not in backends:  # read once per kind of call
                        fn = (
                            sdpa_structured("default", q, k, v, args.docs, args.window)
                            if structure
                            else sdpa("default", q, k, v, base_causal)
                        )
                        backends[kind] = backend_of(work(fn, mode, (q, k, v), grad))
                    base["default"]["backend"] = backends[kind]
                result.setdefault("baselines", []).append(
                    {"n": n, **decoding, "causal": causal, "mode": mode, **base}
                )
                for name in names:
                    method = method_case(name)[0].partition(":")[0]
                    if method in CAUSAL_ONLY and not causal:
                        continue
                    cell = {
                        "method": name,
                        "family": family(name),
                        "n": n,
                        **decoding,
                        "causal": causal,
                        "mode": mode,
                    }
                    if time.perf_counter() - t0 > args.deadline:
                        result["skipped"].append(cell)
                        save()
                        continue
                    fn = call(name, q, k, v, causal, structure)
                    if isinstance(fn, str):  # an anchor that cannot run here: why
                        save(cell | {"error": fn})
                        continue
                    # the cell's name first, so that a cell that never ends is named
                    print(
                        f"n={n:>6}{f' Lq={lq:<3}' if lq else ''}"
                        f"{f' docs={args.docs}' if args.docs else ''}"
                        f"{f' window={args.window}' if args.window else ''} "
                        f"{'causal' if causal else 'full  '} {mode:6} {name:22}",
                        end=" ",
                        flush=True,
                    )
                    once = work(fn, mode, (q, k, v), grad)
                    try:
                        got = timer.measure(once)
                        got["mib"] = peak_extra_mib(once, device)
                        key = (name, mode, causal, lq)
                        if key not in host_of:
                            few = HOST_N if lq is None else HOST_DECODE_N
                            rows = None if lq is None else min(lq, few)
                            small = inputs(few, args.heads, args.head_dim, device, dtype, lq=rows)
                            little = structured(
                                few, args.docs, min(args.window or 0, few) or None, device
                            )
                            host_of[key] = timer.host(
                                work(
                                    call(name, *small, causal, little),
                                    mode,
                                    small,
                                    torch.randn_like(small[0]),
                                )
                            )
                    except Exception as err:
                        cell["error"] = f"{type(err).__name__}: {str(err).strip()}"[:300]
                        print("error:", cell["error"].splitlines()[0], flush=True)
                        save(cell)
                        if _is_cuda_error(err):
                            print("a CUDA error: the rest of this run cannot be trusted; stop")
                            return 1
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    if method in SUPPORTED and mode == "fwd":
                        cell["support"] = support(method, method_case(name)[1], q, k, v, causal)
                    cell |= {
                        "ms": got["ms"],
                        "calls": got["calls"],
                        "spread": got["spread"],
                        "host_ms": host_of[key],
                        "extra_mib": got["mib"],
                    }
                    for backend in BASELINES:
                        if "ms" in base[backend]:
                            cell[f"{backend}_ms"] = base[backend]["ms"]
                            cell[f"ratio_{backend}"] = got["ms"] / base[backend]["ms"]
                            cell[f"{backend}_mib"] = base[backend]["mib"]
                    if "backend" in base["default"]:
                        cell["default_backend"] = base["default"]["backend"]
                    ref = next((b for b in BASELINES if "ms" in base[b]), None)
                    if ref and got["mib"] == got["mib"]:
                        cell["memory_ratio"] = got["mib"] / max(base[ref]["mib"], 1e-3)
                    save(cell)
                    ratios = "  ".join(
                        f"{cell[f'ratio_{b}']:6.2f}x {b}" for b in BASELINES if f"ratio_{b}" in cell
                    )
                    print(
                        f"{got['ms']:9.3f} ms  {ratios}  host {host_of[key]:.2f} ms  "
                        f"extra {got['mib']:.0f} MiB",
                        flush=True,
                    )
            del q, k, v, grad
            if device.type == "cuda":
                torch.cuda.empty_cache()
    save()
    from gpu_check import summary

    print(summary([{"kind": "bench", "tag": args.tag, **setting, **r} for r in result["rows"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
