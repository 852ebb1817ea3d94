"""Every method's ``impl="auto"`` path on a CUDA GPU, as ratios to torch's SDPA on the same GPU.

For each n (Lq = Lk; B = 1, H = 4 unless ``--heads``, D = 64, float32 unless ``--dtype``),
non-causal and causal,
forward and forward+backward:

* time: CUDA-event time of one call (its backward included for ``fwdbwd``), the minimum over
  ``--reps`` calls after one warm-up, divided by SDPA's measured the same way in the same
  process (``F.scaled_dot_product_attention``; on float32 torch picks its memory-efficient
  kernel, on 16-bit ones flash attention);
* memory: the peak of ``torch.cuda.max_memory_allocated`` during one call above what was
  allocated before it (inputs and their gradients excluded), as a ratio to SDPA's.

The same methods and targets as ``benchmarks/attention.py`` (CPU). On CUDA ``sigmoid``,
``relu`` (and ``relu@p=2``), ``power``, ``signed`` and ``softpick`` run their Triton kernels
where triton imports (``attention/triton_elementwise.py``); the rows ``sigmoid:tiles``,
``relu:tiles``, ``power:tiles``, ``signed:tiles`` and ``softpick:tiles`` are the same methods
on the PyTorch tiles (``SHARPATTN_TRITON=0``), to compare the two. Measure both float32 and
bfloat16 (``--dtype``). Cells that would pass
``--deadline`` seconds from the start are skipped and listed. Rows are written to ``--out``
after every cell, so a run stopped early keeps what it measured.

    python benchmarks/gpu.py --sizes 1024,4096,16384 --out benchmarks/results/gpu.json
    python benchmarks/gpu.py --methods sigmoid,relu,relu@p=2,sigmoid:tiles,relu:tiles \
        --dtype bfloat16 --out benchmarks/results/gpu_triton_bf16.json
    python benchmarks/gpu.py --methods power,signed,softpick,power:tiles,signed:tiles,\
softpick:tiles --dtype bfloat16 --out benchmarks/results/gpu_triton_normalised_bf16.json
    python benchmarks/gpu.py --table benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from attention import CAUSAL_ONLY, EXTRA, method_case  # the CPU benchmark beside this one

from sharpattn.attention import attend
from sharpattn.attention.tiles import device_budget
from sharpattn.normalizers import available

B, H, D = 1, 4, 64


#: methods with Triton kernels on CUDA (``sink`` and ``adaptive``: the softmax kernel with its
#: log-sum-exp), and the rows of their ``impl="auto"`` path without them (``SHARPATTN_TRITON=0``:
#: the tiles; ``sink`` the sink as one more key of SDPA)
TRITON = (
    *("sigmoid", "relu", "relu@p=2", "power", "signed", "softpick", "sink", "adaptive"),
    *("sparsemax", "entmax15", "entmax", "asentmax", "topk", "hardmax", "stick_breaking"),
)
TILES = [
    f"{m}:tiles"
    for m in TRITON
    if "@" not in m and m not in ("entmax", "asentmax")  # their kernels are sparsemax's
]

#: the targets (forward+backward time as a ratio to SDPA's flash kernel, bfloat16, n >= 4,096)
#: by method: the softmax family and the sink within FlexAttention's distance of flash, the
#: element-wise and row-normalised maps within FlashSigmoid's, adaptive two flash passes
TARGETS = {
    **dict.fromkeys(("softmax", "ssmax", "length_scaled", "llama4_temperature", "logn"), 1.1),
    "sink": 1.1,
    **dict.fromkeys(("sigmoid", "relu", "relu@p=2", "power", "signed", "softpick"), 1.3),
    "adaptive": 2.2,
    **dict.fromkeys(("sparsemax", "entmax15", "entmax", "asentmax", "stick_breaking"), 2.0),
    **dict.fromkeys(("topk", "hardmax"), 1.5),
}
#: the sparse maps: each cell also reports the fraction of nonzero weights (their support)
SPARSE = ("sparsemax", "entmax15", "entmax", "asentmax", "entmax@alpha=1.3")


def support(method: str, params: dict, q, k, v, causal: bool, rows: int = 64) -> float:
    """The fraction of a sparse map's weights that are nonzero among the visible ones, on the
    last ``rows`` query rows (the naive path's weights: O(rows·n) memory)."""
    with torch.no_grad():
        _, w = attend(q[..., -rows:, :], k, v, method, causal=causal, return_weights=True,
                      impl="naive", **params)  # fmt: skip
    visible = w.shape[-1] * rows - (rows * (rows - 1) // 2 if causal else 0)
    return float((w != 0).sum()) / (visible * w.shape[0] * w.shape[1])


def methods(names: str) -> dict[str, tuple[str, dict]]:
    """Case name → (method, params): every registered method, the CPU benchmark's extras, the
    Triton methods' ``relu@p=2`` and the tiles' rows (``NAME:tiles``)."""
    every = [*available(), *EXTRA, "relu@p=2", *TILES, *(f"anchor:{a}" for a in ANCHORS)]
    return {m: (m, {}) if m.startswith("anchor:") else method_case(m)
            for m in (names.split(",") if names else every)}  # fmt: skip


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


#: other projects' kernels of the same maps, measured in the same process where their package
#: imports (rows ``anchor:NAME``): AdaSplash's α-entmax (PyPI ``adasplash``; its 0.2 release
#: runs causal α = 1.5 through AdaSplash-2, the rest through AdaSplash-1) and Tan et al.'s
#: stick-breaking kernel (``stickbreaking_attention``, not on PyPI: GitHub only). The GPU
#: machine has no network: ``benchmarks/gpu_check.sh`` installs the wheels it finds in
#: benchmarks/wheels (``pip download adasplash --no-deps -d benchmarks/wheels``)
ANCHORS = {"adasplash": ("adasplash", "entmax15"), "stickbreaking": ("stickbreaking_attention",
                                                                      "stick_breaking")}  # fmt: skip


def anchor(name: str, q, k, v, causal: bool):
    """The call of anchor ``name`` (`ANCHORS`), or a reason it cannot run here."""
    package, _ = ANCHORS[name]
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    if name == "adasplash":
        from adasplash import adasplash

        return lambda: adasplash(q, k, v, alpha=1.5, is_causal=causal)
    if not causal:
        return "stick-breaking is causal only"
    from stickbreaking_attention.sb_attn import sb_attn

    # its forward returns (out, remainder); the remainder is what our "remainder" adds back
    return lambda: sb_attn(q, k, v, inv_temp=1 / q.shape[-1] ** 0.5)[0]


def call(method: str, params: dict, q, k, v, causal: bool):
    if method == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if method.startswith("anchor:"):
        return anchor(method.partition(":")[2], q, k, v, causal)
    method, _, path = method.partition(":")  # "sigmoid:tiles": without the Triton kernels

    def run():
        with _tiles(path == "tiles"):
            return attend(q, k, v, method, causal=causal, check_finite=False, **params)

    return run


def measure(fn, mode: str, q, k, v, reps: int) -> dict:
    """Minimum milliseconds over ``reps`` calls (after a warm-up) and peak extra MiB: CUDA events
    and the CUDA allocator's peak on a GPU; wall time and no memory on the CPU (a dry run)."""
    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    cuda = q.device.type == "cuda"

    def once():
        out = fn()
        if mode == "fwdbwd":
            torch.autograd.grad(out, (q, k, v), grad, allow_unused=True)

    def timed() -> float:
        if not cuda:
            t = time.perf_counter()
            once()
            return (time.perf_counter() - t) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    timed()  # warm-up: lazy initialisation, cuBLAS handles, autotuning
    times = [timed() for _ in range(reps)]
    extra = float("nan")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        once()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - before) / 2**20
    return {"ms": min(times), "extra_mib": extra}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,4096,16384")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--methods", default="", help="comma-separated (default: every one)")
    p.add_argument("--heads", type=int, default=H,
                   help="heads per call (more: each call further past launch overhead)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no memory)")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds; later cells skipped")
    p.add_argument("--out", default=str(Path(__file__).with_name("results") / "gpu.json"))
    p.add_argument("--table", metavar="JSON", help="print the table of a result file and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        # the element-wise methods' Triton kernels run where triton imports
        "triton": _triton_version(),
        "python": platform.python_version(),
        "dtype": args.dtype,
        # the tile budget's factor on this device (SHARPATTN_DEVICE_TILES or the default)
        "tile_factor": device_budget(1, device) if device.type != "cpu" else 1,
        "shape": {"B": B, "H": args.heads, "D": D},
        "reps": args.reps,
        "rows": [],
        "skipped": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = methods(args.methods)
    for n in (int(s) for s in args.sizes.split(",")):
        for causal in (False, True):
            g = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(B, args.heads, n, D, generator=g).to(device, dtype).requires_grad_()
                for _ in range(3)
            )
            for mode in args.modes.split(","):
                base = measure(call("sdpa", {}, q, k, v, causal), mode, q, k, v, args.reps)
                for name, (method, params) in todo.items():
                    if method.split(":")[0] in CAUSAL_ONLY and not causal:
                        continue
                    cell = {"method": name, "n": n, "causal": causal, "mode": mode}
                    if time.perf_counter() - t0 > args.deadline:
                        result["skipped"].append(cell)
                        continue
                    fn = call(method, params, q, k, v, causal)
                    if isinstance(fn, str):  # an anchor that cannot run here: why
                        result["rows"].append(cell | {"error": fn})
                        continue
                    # the cell's name first, so that a cell that never ends is named
                    print(f"n={n:>6} {'causal' if causal else 'full  '} {mode:6} {name:22}",
                          end=" ", flush=True)  # fmt: skip
                    try:
                        got = measure(fn, mode, q, k, v, args.reps)
                    except torch.OutOfMemoryError:
                        cell["error"] = "out of GPU memory"
                        print(cell["error"], flush=True)
                        result["rows"].append(cell)
                        torch.cuda.empty_cache()
                        continue
                    except Exception as err:  # an anchor's kernel that fails on this GPU
                        if not method.startswith("anchor:"):
                            raise
                        cell["error"] = f"{type(err).__name__}: {err}"[:300]
                        print(cell["error"], flush=True)
                        result["rows"].append(cell)
                        torch.cuda.empty_cache()
                        continue
                    if method.split(":")[0] in SPARSE and mode == "fwd":
                        cell["support"] = support(method.split(":")[0], params, q, k, v, causal)
                    cell |= {
                        "ms": got["ms"],
                        "sdpa_ms": base["ms"],
                        "time_ratio": got["ms"] / base["ms"],
                        "extra_mib": got["extra_mib"],
                        "sdpa_extra_mib": base["extra_mib"],
                        "memory_ratio": got["extra_mib"] / max(base["extra_mib"], 1e-3),
                    }
                    result["rows"].append(cell)
                    print(
                        f"{got['ms']:9.2f} ms  {cell['time_ratio']:7.2f}x SDPA  "
                        f"extra {got['extra_mib']:8.1f} MiB ({cell['memory_ratio']:.2f}x)",
                        flush=True,
                    )
                    result["wall_s"] = time.perf_counter() - t0
                    out.write_text(json.dumps(result, indent=1))
            del q, k, v
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(result, indent=1))
    print(table(result))


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return triton.__version__


def table(result: dict) -> str:
    """Markdown: one row per method, ``fwd / fwd+bwd`` time ratios per (n, causal) column."""
    rows = [r for r in result["rows"] if "time_ratio" in r]
    cols = sorted({(r["n"], r["causal"]) for r in rows})
    names = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["n"], r["causal"], r["mode"]): r for r in rows}
    shape = result.get("shape", {"B": B, "H": H, "D": D})
    head = ["method"] + [
        f"{f'{n // 1024}k' if n >= 1024 else n}{' causal' if c else ''}" for n, c in cols
    ]
    lines = [
        f"{result['device']}, torch {result['torch']}"
        + (f", triton {result['triton']}" if result.get("triton") else "")
        + f", {result['dtype']}, B = {shape['B']}, H = {shape['H']}, "
        f"D = {shape['D']}: time as a ratio to SDPA's, forward / forward+backward",
        "",
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
    ]
    for m in names:
        parts = []
        for n, c in cols:
            f, fb = cell.get((m, n, c, "fwd")), cell.get((m, n, c, "fwdbwd"))
            parts.append(
                " / ".join(f"{x['time_ratio']:.1f}" if x else "–" for x in (f, fb))
                if f or fb
                else "–"
            )
        lines.append(f"| {m} | " + " | ".join(parts) + " |")
    sdpa = {(r["n"], r["causal"], r["mode"]): r["sdpa_ms"] for r in rows}
    lines.append(
        "| SDPA, ms | "
        + " | ".join(
            " / ".join(f"{sdpa.get((n, c, mode), float('nan')):.2f}" for mode in ("fwd", "fwdbwd"))
            for n, c in cols
        )
        + " |"
    )
    big = [r for r in rows if r["n"] == max(n for n, _ in cols) and r["mode"] == "fwdbwd"]
    if big and all(r["memory_ratio"] == r["memory_ratio"] for r in big):  # not NaN (CPU)
        worst = max(big, key=lambda r: r["memory_ratio"])
        lines += [
            "",
            f"Peak extra GPU memory at n = {worst['n']}, forward+backward: at most "
            f"{worst['memory_ratio']:.2f}x SDPA's ({worst['method']}, {worst['extra_mib']:.0f} MiB "
            f"against {worst['sdpa_extra_mib']:.0f} MiB).",
        ]
    lines += targets(rows)
    kept = [r for r in rows if "support" in r]
    if kept:
        lines += ["", "Support of the sparse maps (nonzero weights / visible keys, last 64 rows):"]
        lines += [f"- {r['method']}, n = {r['n']}{' causal' if r['causal'] else ''}: "
                  f"{100 * r['support']:.2f} %" for r in kept]  # fmt: skip
    failed = {r["method"]: r["error"] for r in result["rows"] if "error" in r}
    if failed:
        lines += ["", "Not measured:", *(f"- {m}: {why}" for m, why in failed.items())]
    if result.get("skipped"):
        lines.append(f"{len(result['skipped'])} cells skipped at the deadline.")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    """The methods of `TARGETS` measured at n >= 4,096 forward+backward: the worst ratio to
    SDPA over those cells against the target (meaningful in bfloat16, where SDPA is flash)."""
    lines = []
    for name, target in TARGETS.items():
        cells = [r for r in rows if r["method"] == name and r["n"] >= 4096
                 and r["mode"] == "fwdbwd"]  # fmt: skip
        if cells:
            worst = max(cells, key=lambda r: r["time_ratio"])
            verdict = "met" if worst["time_ratio"] <= target else "missed"
            lines.append(
                f"- {name}: at most {worst['time_ratio']:.2f}x SDPA forward+backward at n >= 4k "
                f"(worst: n = {worst['n']}{', causal' if worst['causal'] else ''}); target "
                f"{target}: {verdict}"
            )
    return ["", "Targets (forward+backward, n >= 4k):", *lines] if lines else []


if __name__ == "__main__":
    main()
