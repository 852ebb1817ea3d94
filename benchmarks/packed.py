"""Packed documents and sliding windows as structure, against the dense-mask route.

A batch of ``--docs`` documents of ``--doc-len`` tokens each, packed into one causal sequence
(B=1, H=4, D=64, float32), for each method, forward+backward:

* ``apart``: each document attended on its own (one call per document), the lower bound;
* ``packed``: one call with ``cu_seqlens`` (sharpattn's structure);
* ``dense``: one call with the ``[L, L]`` boolean mask of the same documents (what a caller
  without structure must build), where it fits (``--dense-max`` tokens);
* ``window``: one causal call over the packed length with ``window=(W − 1, 0)`` (``--window``),
  and SDPA's time on the same call with its dense mask, for scale.

Time: median wall clock over ``--repeats`` calls, in one process, every route of a method
interleaved. Memory: each (method, route) runs once in its own subprocess; "peak" is the peak
resident set above the one with inputs ready (Linux: VmHWM reset via /proc/self/clear_refs).

    python benchmarks/packed.py                       # 8 × 4,096 tokens (slow: ~15 min)
    python benchmarks/packed.py --quick               # 4 × 256, a few methods
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sharpattn import attend
from sharpattn import normalizers as nz

H, D = 4, 64
DEFAULT_METHODS = (
    "softmax,sink,ssmax,adaptive,sigmoid,softpick,sparsemax,entmax15,topk,stick_breaking"
)


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, n, D, generator=g).requires_grad_() for _ in range(3)]


def _dense(docs: int, doc_len: int) -> torch.Tensor:
    ids = torch.arange(docs).repeat_interleave(doc_len)
    i = torch.arange(docs * doc_len)
    return (ids[:, None] == ids[None, :]) & (i[None, :] <= i[:, None])


def route(method: str, name: str, docs: int, doc_len: int, window: int):
    """A function of (q, k, v) running one route forward+backward."""
    n = docs * doc_len
    cu = torch.arange(0, n + 1, doc_len)

    def step(out):
        out.sum().backward()

    if name == "apart":

        def run(q, k, v):
            for a in range(0, n, doc_len):
                z = a + doc_len
                part = attend(q[:, :, a:z], k[:, :, a:z], v[:, :, a:z], method, causal=True)
                step(part)

    elif name == "packed":

        def run(q, k, v):
            step(attend(q, k, v, method, causal=True, cu_seqlens=cu))

    elif name == "dense":
        mask = _dense(docs, doc_len)

        def run(q, k, v):
            step(attend(q, k, v, method, causal=True, mask=mask))

    elif name == "window":

        def run(q, k, v):
            step(attend(q, k, v, method, causal=True, window=(window - 1, 0)))

    elif name == "sdpa-window":
        i = torch.arange(n)
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)

        def run(q, k, v):
            step(F.scaled_dot_product_attention(q, k, v, attn_mask=band))

    else:
        raise ValueError(name)
    return run


def child(method, name, docs, doc_len, window) -> None:
    q, k, v = _inputs(docs * doc_len)
    run = route(method, name, docs, doc_len, window)
    base = _kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    run(q, k, v)
    print(json.dumps({"peak_mib": (_kib("VmHWM") - base) / 1024}))


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def memory(method, name, docs, doc_len, window) -> float | None:
    cmd = [sys.executable, __file__, "--child", method, name, str(docs), str(doc_len), str(window)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
    except (subprocess.SubprocessError, ValueError, IndexError, KeyError):
        return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dense-max", type=int, default=32768, help="largest L for the dense route")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--quick", action="store_true", help="4 × 256 tokens, three methods")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        m, name, docs, doc_len, window = a.child
        return child(m, name, int(docs), int(doc_len), int(window))
    if a.quick:
        a.docs, a.doc_len, a.window, a.repeats = 4, 256, 64, 1
        a.methods = "softmax,sigmoid,entmax15"
    n = a.docs * a.doc_len
    routes = ["apart", "packed", "window"] + (["dense"] if n <= a.dense_max else [])
    rows = []
    started = time.time()
    print(
        f"{a.docs} documents × {a.doc_len} tokens (L = {n:,}), causal, B1 H{H} D{D} float32, "
        f"forward+backward; window {a.window}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}",
        flush=True,
    )
    sdpa = {}
    for name in ("sdpa-window",) if n <= a.dense_max else ():
        q, k, v = _inputs(n)
        fn = route("softmax", name, a.docs, a.doc_len, a.window)
        sdpa[name] = _median(fn, q, k, v, a.repeats)
    for method in a.methods.split(","):
        nz.get(method)  # a name the registry does not have: its one-sentence error
        q, k, v = _inputs(n)
        fns = {r: route(method, r, a.docs, a.doc_len, a.window) for r in routes}
        times = {r: [] for r in routes}
        for fn in fns.values():  # once before timing (the C++ loops loaded, buffers grown)
            _time(fn, q, k, v)
        for _ in range(a.repeats):  # routes interleaved, round by round
            for r, fn in fns.items():
                times[r].append(_time(fn, q, k, v))
        row = {"method": method, **{f"{r}_s": statistics.median(t) for r, t in times.items()}}
        if a.memory:
            for r in routes:
                row[f"{r}_mib"] = memory(method, r, a.docs, a.doc_len, a.window)
        rows.append(row)
        print(_line(row, routes), flush=True)
    result = {
        "docs": a.docs,
        "doc_len": a.doc_len,
        "window": a.window,
        "sdpa_window_s": sdpa.get("sdpa-window"),
        "rows": rows,
        "wall_s": time.time() - started,
        "cpu_s": time.process_time(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(markdown(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


def _time(fn, q, k, v) -> float:
    for t in (q, k, v):
        t.grad = None
    t0 = time.perf_counter()
    fn(q, k, v)
    return time.perf_counter() - t0


def _median(fn, q, k, v, repeats) -> float:
    return statistics.median(_time(fn, q, k, v) for _ in range(max(repeats, 1)))


def _line(row, routes) -> str:
    parts = [row["method"]]
    for r in routes:
        mib = row.get(f"{r}_mib")
        parts.append(f"{r} {row[f'{r}_s']:.3f} s" + (f" {mib:.0f} MiB" if mib is not None else ""))
    return " | ".join(parts)


def markdown(result) -> str:
    """The table of a result (as in docs/performance.md)."""
    rows = result["rows"]
    dense = any("dense_s" in r for r in rows)
    head = "| method | apart (s) | packed (s) | packed / apart |"
    head += " dense mask (s) | packed peak (MiB) | dense peak (MiB) |" if dense else ""
    head += " window (s) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, spec):
        return "–" if x is None else format(x, spec)

    for r in rows:
        cells = [r["method"], f(r["apart_s"], ".3f"), f(r["packed_s"], ".3f")]
        cells.append(f(r["packed_s"] / r["apart_s"], ".2f"))
        if dense:
            cells += [f(r.get("dense_s"), ".3f"), f(r.get("packed_mib"), ".0f")]
            cells.append(f(r.get("dense_mib"), ".0f"))
        cells.append(f(r["window_s"], ".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
