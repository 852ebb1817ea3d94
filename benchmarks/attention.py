"""Speed and memory of every method's attention path, as ratios to torch's fused SDPA.

For each n (Lq = Lk; B=1, H=4, D=64, float32), non-causal and causal:

* time of the forward and of forward+backward of each method's ``impl="auto"`` path, divided by
  SDPA's, measured in the same process, interleaved round by round (min over rounds). Two
  ratios: of the process's CPU time (all threads; robust when other processes share the
  cores) and of wall time;
* peak memory: each case runs once in its own subprocess; "RSS" is the process's peak resident
  set, "extra" the peak above the resident set once inputs are ready (Linux: VmHWM reset via
  /proc/self/clear_refs). Both as ratios to SDPA's;
* the naive path (the whole score matrix) where it fits (``--naive-max``), and the chunked path
  of adaptive (``--chunked-max``) with a block-count sweep showing its memory is flat.

Fused functions whose method is not registered yet (ssmax, length_scaled, sink) are run
directly, with their default parameters, labelled "fn".

    python benchmarks/attention.py                          # 1k, 4k, 16k, 32k (slow)
    python benchmarks/attention.py --sizes 1024,4096 --rounds 2   # a quick run
    SHARPATTN_COMPILE=0 python benchmarks/attention.py ...        # the pure-PyTorch tiles

The tiled paths' per-tile work runs in the C++ loops (``sharpattn.attention.cpu.native``) unless
``SHARPATTN_COMPILE=0``; timings are the min over rounds, and memory children run once at
n = 1,024 first, so the loops are loaded before the peak is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_common import CAUSAL_ONLY, method_case  # the cases' names, shared with the GPU scripts

from sharpattn.attention import attend
from sharpattn.attention.cpu import adaptive_tiled, native
from sharpattn.attention.cpu.sparse_tiled import block_rows
from sharpattn.attention.cpu.tiles import Grid, Slabs
from sharpattn.attention.dispatch.fast import path_of
from sharpattn.attention.masking import Masking
from sharpattn.normalizers import available, get

B, H, D = 1, 4, 64
#: the size at which the memory children run once before measuring (the C++ loops loaded)
WARM_N = 1024
GLIBC_DYNAMIC = False  # set by --glibc-dynamic
#: targets at n = 4k and 16k, causal or not, as CPU-time ratios to SDPA (forward, fwd+bwd), by
#: family; peak resident memory of every method at 16k at most MEMORY_TARGET x SDPA's
TARGET_GROUPS = {
    (1.1, 1.1): "softmax ssmax length_scaled llama4_temperature logn sink",
    (1.5, 1.8): "adaptive",
    (1.5, 2.0): "sigmoid relu power signed softpick stablemax hardmax",
    (3.0, 4.0): "sparsemax entmax15 entmax entmax@alpha=1.3 asentmax topk stick_breaking",
}
TARGETS = {m: t for t, names in TARGET_GROUPS.items() for m in names.split()}
MEMORY_TARGET = 1.3
#: the longest a spinning process of ``--busy`` lives, were the benchmark killed
BUSY_SECONDS = 1800

#: extra cases: a method with non-default parameters, named "<method>@<param>=<value>"
EXTRA = ["entmax@alpha=1.3"]


#: the GEMM floor of each path family (``floor:<kind>`` cases): only the matrix products the
#: path must do, on its own tiles, element-wise work free. "tiled": one pass of
#: :class:`~sharpattn.attention.cpu.tiles.Grid` tiles (q·kᵀ and p·v; backward 5 products per tile,
#: as flash attention's); "slab": the sparse paths' query-row slabs over the keys each block
#: sees (the same products); "adaptive_slab": the same on adaptive temperature's slabs
FLOOR_OF = {
    "adaptive": "adaptive_slab",
    **dict.fromkeys("sigmoid relu power signed softpick stick_breaking".split(), "tiled"),
    **dict.fromkeys("sparsemax entmax15 entmax entmax@alpha=1.3 asentmax topk".split(), "slab"),
}


def cases(sizes_n: int, naive_max: int, chunked_max: int) -> list[str]:
    """Case names for one n: 'sdpa', '<method>:auto', '<method>:naive', 'fn:<fused name>'."""
    names = ["sdpa"]
    fused_used = set()
    for m in available():
        names.append(f"{m}:auto")
        if get(m).fused:
            fused_used.add(get(m).fused)
    names += [f"fn:{f}" for f in ("ssmax", "length_scaled", "sink") if f not in fused_used]
    names += [f"{m}:auto" for m in EXTRA if m.split("@")[0] in available()]
    names += [f"floor:{kind}" for kind in dict.fromkeys(FLOOR_OF.values())]
    if sizes_n <= chunked_max and "adaptive" in available():
        names.append("adaptive:chunked")
    if sizes_n <= naive_max:
        names += [f"{m}:naive" for m in available()]
    return names


def make_inputs(n: int, lq: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq or n, D, generator=g).requires_grad_()
    k = torch.randn(B, H, n, D, generator=g).requires_grad_()
    v = torch.randn(B, H, n, D, generator=g).requires_grad_()
    return q, k, v


def runner(case: str, q, k, v, causal: bool, block_size: int | None = None):
    if case == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    kind, name = case.split(":")
    if kind == "floor":
        return gemm_floor(name, q, k, v, causal)
    if kind == "fn":
        masking = Masking.build(None, causal, q.shape[2], k.shape[2], q.device)
        return lambda: path_of(get(name))(q, k, v, masking, D**-0.5, False)[0]
    method, params = method_case(kind)
    return lambda: attend(
        q, k, v, method, causal=causal, impl=name, block_size=block_size, **params
    )


def gemm_floor(kind: str, q, k, v, causal: bool):
    """The ``floor:<kind>`` case (:data:`FLOOR_OF`): a function of the mode that runs only the
    GEMMs of that path family on its tiles (gradient products on stand-in tiles)."""
    n = q.shape[2]
    masking = Masking.build(None, causal, n, n, q.device)
    scale = D**-0.5

    def products(grid: Grid, blocks, forward: int, backward: int) -> None:
        d_out = grid.empty_out()  # stands in for dO (any values: GEMMs only)
        for r0, r1, tiles in blocks:
            qb = grid.q_rows(r0, r1)
            go = d_out[..., r0:r1, :]
            for t in tiles:
                s = grid.scores(qb, t)  # q·kᵀ
                vt = grid.v[..., t.c0 : t.c1, :]
                if forward == 2:
                    grid.weigh(s, t)  # p·v
                if backward:  # recomputed scores, dO·vᵀ, ds·k, dsᵀ·q (and pᵀ·dO)
                    grid.scores(qb, t)
                    dp = grid.product(go, vt.transpose(-2, -1), "dp")
                    torch.matmul(dp, grid.k[..., t.c0 : t.c1, :])
                    torch.matmul(dp.transpose(-2, -1), qb)
                    if backward == 5:
                        torch.matmul(grid.grouped(s).transpose(-2, -1), go)

    def fn(mode: str) -> None:
        back = mode == "fwdbwd"
        with torch.no_grad():
            grid = Grid(q.detach(), k.detach(), v.detach(), masking, scale, fold_scale=True)
            if kind in ("slab", "adaptive_slab"):
                if kind == "slab":
                    bq = block_rows(B * H, n, n)
                else:
                    bq = adaptive_tiled._rows_of(B * H, n, n, q.device)
                grid = Grid(
                    *(x.detach() for x in (q, k, v)), masking, scale, bq, n, True, reuse=True
                )
                slabs = Slabs(grid, bq).blocks()
                blocks = [(t.r0, t.r1, [t]) for t in slabs]  # each block over the keys it sees
            else:
                blocks = [(r0, r1, list(grid.tiles(r0, r1))) for r0, r1 in grid.row_blocks()]
            products(grid, blocks, 2, 5 if back else 0)

    fn.floor = True
    return fn


def run_once(fn, mode: str, q, k, v) -> tuple[float, float]:
    """(CPU seconds of this process, all threads; wall seconds) of one forward or fwd+bwd."""
    for t in (q, k, v):
        t.grad = None
    c0, t0 = time.process_time(), time.perf_counter()
    if getattr(fn, "floor", False):
        fn(mode)
    elif mode == "fwd":
        with torch.no_grad():
            fn()
    else:
        fn().sum().backward()
    return time.process_time() - c0, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# memory: one subprocess per case


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(case: str, n: int, causal: bool, mode: str, lq: int | None, block: int | None) -> None:
    if native.mode() != "0" and n > WARM_N:  # load the loops first: the peak is then the
        small = make_inputs(WARM_N)  # call's own
        run_once(runner(case, *small, causal, block), mode, *small)
    q, k, v = make_inputs(n, lq)
    fn = runner(case, q, k, v, causal, block)
    base = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False  # then the peak includes start-up (ru_maxrss: KiB on Linux)
    run_once(fn, mode, q, k, v)
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"base_mib": base / 1024, "peak_mib": peak / 1024}))


def measure_memory(case, n, causal, mode, lq=None, block=None) -> dict | None:
    cmd = [sys.executable, __file__, "--child", case, str(n), str(int(causal)), mode]
    cmd += [str(lq or 0), str(block or 0)]
    env = dict(os.environ)
    if not GLIBC_DYNAMIC:
        # glibc's dynamic mmap threshold lets freed multi-MiB blocks stay in the heap, where
        # fragmentation makes RSS grow with the number of query blocks; fix the threshold at its
        # documented default so RSS shows what the code allocates (--glibc-dynamic to compare)
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        print(f"  memory run failed for {case} n={n}: {res.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------


def selected(n, causal, args) -> list[str]:
    """The cases of one size and mask: every one of `cases`, or SDPA and ``--methods``'."""
    names = cases(n, args.naive_max, args.chunked_max)
    if not causal:
        names = [c for c in names if c.split(":")[0] not in CAUSAL_ONLY]
    if args.methods:  # keep SDPA (the reference) and the cases of the chosen methods
        keep = set(args.methods.split(","))
        keep |= {f"floor:{FLOOR_OF[m]}" for m in FLOOR_OF if m.split("@")[0] in keep}
        names = [
            c for c in names if c == "sdpa" or c in keep or c.split(":")[0].split("@")[0] in keep
        ]
    return names


def bench_size(n, causal, args) -> list[dict]:
    names = selected(n, causal, args)
    q, k, v = make_inputs(n)
    fns = {c: runner(c, q, k, v, causal) for c in names}
    rows = {c: {"case": c, "n": n, "causal": causal} for c in names}
    for mode in args.modes:
        times = {c: [] for c in names}
        if n <= 1024:  # warm-up (allocator, kernels); larger sizes rely on min over rounds
            for c in names:
                run_once(fns[c], mode, q, k, v)
        for _ in range(args.rounds):
            for c in names:
                times[c].append(run_once(fns[c], mode, q, k, v))
        for c in names:  # ratios of CPU time (robust to other processes), and of wall time
            cpu, wall = min(t[0] for t in times[c]), min(t[1] for t in times[c])
            rows[c][f"{mode}_s"], rows[c][f"{mode}_cpu_s"] = wall, cpu
            rows[c][f"{mode}_ratio"] = cpu / min(t[0] for t in times["sdpa"])
            rows[c][f"{mode}_wall_ratio"] = wall / min(t[1] for t in times["sdpa"])
    if args.memory and n >= args.memory_min:
        for mode in args.modes:
            mem = {c: measure_memory(c, n, causal, mode) for c in names if c[:6] != "floor:"}
            ref = mem.get("sdpa")
            for c in mem:
                if mem[c] and ref:
                    rows[c][f"{mode}_peak_mib"] = mem[c]["peak_mib"]
                    rows[c][f"{mode}_rss_ratio"] = mem[c]["peak_mib"] / ref["peak_mib"]
                    extra, ref_extra = (
                        mem[c]["peak_mib"] - mem[c]["base_mib"],
                        ref["peak_mib"] - ref["base_mib"],
                    )
                    rows[c][f"{mode}_extra_mib"] = extra
                    rows[c][f"{mode}_extra_ratio"] = extra / max(ref_extra, 1e-9)
    return list(rows.values())


@contextlib.contextmanager
def busy_loops(count: int, seconds: float = BUSY_SECONDS):
    """``count`` other processes, each spinning on a core (a user's data loader, a second job),
    each ending by itself after ``seconds`` at the latest and stopped when the block ends."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        time.sleep(0.5)  # every spinner started
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def busy_size(n, causal, threads, args) -> list[dict]:
    """Each case's median wall time over ``args.rounds`` calls (after one warm-up call) as a
    ratio to SDPA's, quiet and then beside ``args.busy`` spinning processes, with ``threads``
    torch threads: ``{mode}_quiet`` and ``{mode}_busy``."""
    torch.set_num_threads(threads)
    names = [c for c in selected(n, causal, args) if not c.startswith(("floor:", "fn:"))]
    names = [c for c in names if c == "sdpa" or c.endswith(":auto")]
    q, k, v = make_inputs(n)
    fns = {c: runner(c, q, k, v, causal) for c in names}
    rows = {c: {"case": c, "n": n, "causal": causal, "threads": threads} for c in names}
    for mode in args.modes:
        for load in ("quiet", "busy"):
            with busy_loops(args.busy) if load == "busy" else contextlib.nullcontext():
                for c in names:
                    run_once(fns[c], mode, q, k, v)
                times = {c: [] for c in names}
                for _ in range(args.rounds):  # interleaved: a change of load hits every case
                    for c in names:
                        times[c].append(run_once(fns[c], mode, q, k, v)[1])
            ref = statistics.median(times["sdpa"])
            for c in names:
                rows[c][f"{mode}_{load}"] = statistics.median(times[c]) / ref
            rows["sdpa"][f"{mode}_{load}_s"] = ref
    return list(rows.values())


def busy_table(rows, modes) -> str:
    head = ["method", "n", "causal", "threads"]
    for m in modes:
        head += [f"{m} quiet", f"{m} busy", f"{m} busy/quiet"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["case"] == "sdpa":
            continue
        cells = [r["case"].removesuffix(":auto"), str(r["n"]), "yes" if r["causal"] else "no"]
        cells.append(str(r["threads"]))
        for m in modes:
            quiet, busy = r.get(f"{m}_quiet"), r.get(f"{m}_busy")
            cells += [fmt(quiet), fmt(busy), fmt(busy / quiet if quiet and busy else None)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def busy_main(args, sizes, causals) -> None:
    out = Path(args.out)
    if out.name == "attention.json":  # the default: the busy table has a file of its own
        out = out.with_name("attention_busy.json")
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for n in sizes:
            for causal in causals:
                t0 = time.perf_counter()
                rows += busy_size(n, causal, threads, args)
                print(
                    f"n={n} causal={causal} threads={threads} done in "
                    f"{time.perf_counter() - t0:.0f}s",
                    flush=True,
                )
                out.parent.mkdir(parents=True, exist_ok=True)
                data = {"machine": machine(), "busy_processes": args.busy, "rounds": args.rounds}
                data["shape"] = {"B": B, "H": H, "D": D, "dtype": "float32"}
                out.write_text(json.dumps({**data, "rows": rows}, indent=2))
    print()
    print(busy_table(rows, args.modes))
    print(f"\nwrote {out}")


def block_sweep(args) -> list[dict]:
    """Chunked adaptive, fixed Lk and block size, Lq growing: peak memory vs block count."""
    out = []
    lk, block = args.sweep_lk, args.sweep_block
    for lq in args.sweep_lq:
        m = measure_memory("adaptive:chunked", lk, False, "fwdbwd", lq=lq, block=block)
        if m:
            out.append(
                {
                    "lq": lq,
                    "lk": lk,
                    "block": block,
                    "blocks": -(-lq // block),
                    "peak_mib": m["peak_mib"],
                    "extra_mib": m["peak_mib"] - m["base_mib"],
                }
            )
            print(f"  sweep Lq={lq}: {out[-1]}", flush=True)
    return out


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def table(rows, modes, memory) -> str:
    head = ["method", "path", "n", "causal"]
    for m in modes:
        head += [f"{m} ×SDPA (CPU)", f"{m} ×SDPA (wall)"]
    if memory:
        for m in modes:
            head += [f"{m} peak RSS ×SDPA", f"{m} extra mem ×SDPA"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r["case"]
        method, path = (
            ("sdpa", f"{r.get('fwd_s', 0):.2f}s fwd wall") if c == "sdpa" else c.split(":")
        )
        if method == "fn":
            method, path = path, "fused fn"
        cells = [method, path, str(r["n"]), "yes" if r["causal"] else "no"]
        for m in modes:
            cells += [fmt(r.get(f"{m}_ratio")), fmt(r.get(f"{m}_wall_ratio"))]
        if memory:
            for m in modes:
                cells += [fmt(r.get(f"{m}_rss_ratio")), fmt(r.get(f"{m}_extra_ratio"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows, sizes=(4096, 16384)) -> str:
    """One line per method on its ``auto`` path: CPU-time ratios (non-causal / causal) at each
    size, peak RSS at the largest size, the targets, and which cells miss them."""
    by = {(r["case"], r["n"], r["causal"]): r for r in rows}
    methods = [r["case"] for r in rows if r["case"].endswith(":auto")]
    methods = list(dict.fromkeys(methods))
    big = max(sizes)
    head = ["method", "path"]
    for n in sizes:
        head += [f"fwd {n // 1024}k", f"fwd+bwd {n // 1024}k"]
    head += [f"peak RSS {big // 1024}k (fwd / fwd+bwd)", "target (fwd / fwd+bwd)"]
    head += ["GEMM floor, fwd " + "; ".join(f"{n // 1024}k" for n in sizes), "misses"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pair(case, n, field):
        vals = [by.get((case, n, c), {}).get(field) for c in (False, True)]
        return " / ".join(fmt(v) for v in vals), vals

    for case in methods:
        method = case.split(":")[0]
        entry = get(method.split("@")[0])
        target = TARGETS.get(method)
        cells, misses = [method, entry.fused or "chunked"], []
        for n in sizes:
            for mode, t in zip(("fwd", "fwdbwd"), target or (None, None), strict=True):
                text, vals = pair(case, n, f"{mode}_ratio")
                cells.append(text)
                for c, v in zip(("", " causal"), vals, strict=True):
                    if t is not None and v is not None and v > t:
                        misses.append(f"{mode} {n // 1024}k{c} {v:.2f}")
        peaks = []
        for mode in ("fwd", "fwdbwd"):
            vals = [by.get((case, big, c), {}).get(f"{mode}_rss_ratio") for c in (False, True)]
            vals = [v for v in vals if v is not None]
            peaks.append(max(vals) if vals else None)
            if vals and max(vals) > MEMORY_TARGET:
                misses.append(f"{mode} memory {max(vals):.2f}")
        cells.append(" / ".join(fmt(v) for v in peaks))
        cells.append("–" if target is None else f"{target[0]} / {target[1]}")
        kind = FLOOR_OF.get(method)  # the GEMMs alone: how much of the target they leave
        floors = [pair(f"floor:{kind}", n, "fwd_ratio") for n in sizes] if kind else []
        floors = [text for text, vals in floors if any(v is not None for v in vals)]
        cells.append("; ".join(floors) or "–")
        cells.append("; ".join(misses) or "none")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores (torch threads {torch.get_num_threads()}), "
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"SHARPATTN_COMPILE={native.mode()}"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1024,4096,16384,32768")
    p.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--naive-max", type=int, default=4096)
    p.add_argument("--chunked-max", type=int, default=4096)
    p.add_argument("--methods", default="", help="comma-separated methods (default: every one)")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--memory-min", type=int, default=0, help="measure memory from this n on")
    p.add_argument("--sweep-lk", type=int, default=4096)
    p.add_argument("--sweep-block", type=int, default=256)
    p.add_argument("--sweep-lq", default="1024,4096,16384")
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--out", default=str(Path(__file__).with_name("results") / "attention.json"))
    p.add_argument(
        "--glibc-dynamic",
        action="store_true",
        help="keep glibc's dynamic mmap threshold in the memory subprocesses",
    )
    p.add_argument("--append", action="store_true", help="merge into an existing --out JSON")
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    p.add_argument(
        "--summary",
        action="store_true",
        help="print one line per method (ratios, peak memory, targets) from --out and exit",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        help="also time every method beside N spinning processes (wall-clock medians, quiet "
        "and busy; writes attention_busy.json)",
    )
    p.add_argument("--threads", default="", help="with --busy: torch thread counts, e.g. 1,2")
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global GLIBC_DYNAMIC
    GLIBC_DYNAMIC = args.glibc_dynamic
    if args.child:
        case, n, causal, mode, lq, block = args.child
        child(case, int(n), bool(int(causal)), mode, int(lq) or None, int(block) or None)
        return
    args.modes = args.modes.split(",")
    if args.summary:
        data = json.loads(Path(args.out).read_text())
        print(f"machine: {data['machine']}\n")
        print(summary(data["rows"]))
        return
    if args.table:
        data = json.loads(Path(args.out).read_text())
        print(f"machine: {data['machine']}\n")
        print(table(data["rows"], args.modes, args.memory))
        if data.get("block_sweep"):
            print()
            print(sweep_table(data["block_sweep"]))
        return
    args.sweep_lq = [int(x) for x in args.sweep_lq.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    print(f"machine: {machine()}", flush=True)
    if args.busy:
        args.threads = args.threads or str(torch.get_num_threads())
        busy_main(args, sizes, causals)
        return
    out = Path(args.out)
    rows = []
    if args.append and out.is_file():  # merge with an earlier run (same case, n, causal: replaced)
        rows = json.loads(out.read_text())["rows"]
    for n in sizes:
        for causal in causals:
            t0 = time.perf_counter()
            new = bench_size(n, causal, args)
            old = {(r["case"], r["n"], r["causal"]): r for r in rows}
            for r in new:  # field by field: a timing-only run keeps earlier memory numbers
                r.update(
                    {f: x for f, x in old.pop((r["case"], n, causal), {}).items() if f not in r}
                )
            rows = list(old.values()) + new
            rows.sort(key=lambda r: (r["n"], r["causal"]))
            write(out, rows, [], args)  # after every size: a long run keeps what it measured
            print(f"n={n} causal={causal} done in {time.perf_counter() - t0:.0f}s", flush=True)
    sweep = block_sweep(args) if args.sweep and args.memory else []
    write(out, rows, sweep, args)
    print()
    print(table(rows, args.modes, args.memory))
    if sweep:
        print()
        print(sweep_table(sweep))
    print(f"\nwrote {out}")


def sweep_table(sweep) -> str:
    lines = [
        f"| Lq (Lk = {sweep[0]['lk']}, block {sweep[0]['block']}) | blocks | peak RSS MiB "
        "| extra MiB |",
        "|---|---|---|---|",
    ]
    for s in sweep:
        lines.append(f"| {s['lq']} | {s['blocks']} | {s['peak_mib']:.0f} | {s['extra_mib']:.0f} |")
    return "\n".join(lines)


def write(out: Path, rows, sweep, args) -> None:
    old = json.loads(out.read_text()) if out.is_file() else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": machine(),
        "glibc_dynamic_mmap": args.glibc_dynamic,
        "shape": {"B": B, "H": H, "D": D, "dtype": "float32"},
        "rounds": args.rounds,
        "rows": rows,
        "block_sweep": sweep or old.get("block_sweep", []),
        "targets": {m: list(t) for m, t in TARGETS.items()},
        "memory_target": MEMORY_TARGET,
    }
    out.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
