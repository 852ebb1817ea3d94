"""The Triton kernels that ``benchmarks/gpu.py`` launches, compiled for Hopper (sm_90a) without
a GPU: registers, spills, shared memory, occupancy and instruction counts per kernel variant.

Nothing runs on a GPU and none is needed. Each method's ``impl="auto"`` call (forward and
backward, as ``gpu.py`` makes it: B = 1, H = 16, n = 16,384) runs on CPU tensors with the library's
readiness checks answering as they would for a CUDA tensor of that dtype (`_as_on_cuda`), and
every Triton launch is turned into a compile-only launch (`_CompileOnly`): Triton's own launch
code binds the arguments and specialises them (dtypes, integers equal to 1, 16-divisible integers
and 16-aligned pointers) exactly as for a launch, then, through a stand-in driver whose target
is ``GPUTarget("cuda", 90, 32)``, compiles that variant (its constexprs, ``num_warps`` and
``num_stages``) with Triton's bundled ptxas and returns without launching. The kernels' outputs
stay unwritten, which the host code around them does not mind. torch's SDPA, which the plain
softmax family calls on CUDA, is replaced by a stub (no Triton kernel there; such methods are
listed under the table).

Per compiled kernel (identical compiled kernels reached by several methods are one row):

* regs, spills: registers per thread and bytes of spill stores (ptxas ``-v`` on the kernel's
  PTX, the flags Triton uses);
* smem KB: dynamic shared memory per CTA (Triton's allocation; the driver adds 1 KB per CTA);
* CTAs/SM: resident CTAs per SM from registers (65,536 per SM in 4 partitions, 256-register
  allocation units per warp), shared memory (228 KB per SM, 227 KB at most per CTA), warps (64)
  and blocks (32), with what limits it;
* from the PTX text, static instruction counts: cp.async (asynchronous copies, ``cp.async.bulk``
  included; not their commit/wait), MUFU (``ex2``, ``rcp``, ``lg2``, ``sqrt``, ``rsqrt``,
  ``sin``, ``cos``, ``tanh`` ``.approx``; after a slash the MUFU instructions of the machine
  code, ``cuobjdump -sass``, which adds the reciprocals of PTX's ``div.full`` divisions, one per
  distinct divisor), fp64 (instructions with an ``.f64`` type, conversions included), wgmma
  (``wgmma.mma_async``; "serialized" where ptxas warns that it serialized them, C7515);
* libdevice: calls to libdevice's ``__nv_*`` functions in the kernel's LLVM module before
  libdevice is linked (after linking they are inlined: the PTX keeps no call, only their
  instructions, e.g. ``ex2.approx.ftz`` for ``exp2f`` and a polynomial for ``logf``).

    python benchmarks/gpu_compile.py                      # bfloat16, D = 64, every method
    python benchmarks/gpu_compile.py --head-dims 64,128 --json benchmarks/results/gpu_compile_bf16.json
    python benchmarks/gpu_compile.py --table benchmarks/results/gpu_compile_bf16.json
    python benchmarks/gpu_compile.py --dtype float32 --methods sigmoid,stick_breaking
    python benchmarks/gpu_compile.py --lq 1 --heads 8 --causal causal   # decoding: split-K

Set ``PYTHONPATH=src:benchmarks`` in a source tree. ``TRITON_INTERPRET`` is removed from the
environment before triton is imported (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import os
import sys

# Triton's interpreter replaces every @triton.jit function when it is defined (triton's own
# when triton is imported): run as a script, this needs the compiler, so the variable goes before
# anything imports triton; where something already has, `main` refuses. Imported as a module (to
# render its table: gpu_claims.py), it leaves the process's environment alone: a test process
# that runs the kernels in the interpreter needs the variable to the end.
_INTERPRETED = False
if __name__ == "__main__":
    _INTERPRETED = os.environ.pop("TRITON_INTERPRET", "0").strip() not in ("", "0") and (
        "triton" in sys.modules
    )

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

#: Hopper (H100/H200, compute capability 9.0) per SM: registers, shared memory (bytes; the
#: carveout at its largest), the most shared memory one CTA may have, what the driver reserves
#: per CTA, resident warps and CTAs; registers are allocated per warp in units of 256 in each of
#: the SM's 4 partitions, shared memory in units of 128 bytes
HOPPER = dict(
    regs=65536,
    partitions=4,
    reg_unit=256,
    smem=228 * 1024,
    smem_per_cta=227 * 1024,
    smem_reserved=1024,
    smem_unit=128,
    warps=64,
    ctas=32,
)
ARCH = 90
COLUMNS = [
    "kernel",
    "method(s)",
    "dtype",
    "D",
    "causal",
    "regs",
    "spills",
    "smem KB",
    "CTAs/SM",
    "cp.async",
    "MUFU",
    "fp64",
    "libdevice",
    "wgmma",
]
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: heads of a call (the GPU check's; strides, not the kernels' code, depend on it)
HEADS = 16


def default_methods() -> list[str]:
    """Every case the GPU check's benchmark runs of this library's kernels (``gpu_common.CASES``:
    not the other projects' kernels, ``anchor:``)."""
    from gpu_common import CASES

    return list(CASES)


# ---------------------------------------------------------------------------------------------
# Counting


_STATEMENT = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.:]*)")
#: MUFU ops in PTX: the approximate transcendentals. The approximate division (div.full) is not
#: one: ptxas makes it a multiply by MUFU.RCP of the divisor, one per distinct divisor (a row's
#: sum divides a whole row with one), which the machine code's count (`ptxas_usage`) shows
_MUFU = re.compile(r"^(ex2|rcp|lg2|sqrt|rsqrt|sin|cos|tanh)\.approx\b")
_CP_ASYNC_NOT_COPIES = ("commit_group", "wait_group", "wait_all", "mbarrier", "prefetch")


def opcodes(ptx: str) -> collections.Counter:
    """Opcode → static count of the PTX's instructions (inline-asm blocks included; directives,
    labels and declarations left out)."""
    ops: collections.Counter = collections.Counter()
    for line in ptx.splitlines():
        for part in line.split(";"):
            s = part.strip().lstrip("{}").strip()
            if not s or s.startswith(("//", ".", "$")):
                continue
            m = _STATEMENT.match(s)
            if m:
                ops[m.group(1)] += 1
    return ops


def ptx_counts(ptx: str) -> dict:
    ops = opcodes(ptx)

    def total(pred) -> int:
        return sum(c for op, c in ops.items() if pred(op))

    mufu = {op: c for op, c in ops.items() if _MUFU.match(op)}
    return {
        "cp_async": total(
            lambda op: op.startswith("cp.async") and not any(w in op for w in _CP_ASYNC_NOT_COPIES)
        ),
        "mufu": sum(mufu.values()),
        "mufu_ops": dict(sorted(mufu.items())),
        "div_full": total(lambda op: op.startswith(("div.full", "div.approx"))),
        "fp64": total(lambda op: ".f64" in op),
        "wgmma": total(lambda op: op.startswith("wgmma.mma_async")),
        "mma_sync": total(lambda op: op.startswith("mma.sync")),
        "ptx_calls": total(lambda op: op.startswith("call")),
        "instructions": sum(ops.values()),
    }


def ptxas_usage(ptxas: str, ptx: str) -> dict:
    """Registers, spill bytes, stack frame and warnings from ptxas ``-v`` on ``ptx`` (Triton's
    flags), and the MUFU instructions of the machine code (``cuobjdump -sass``, a check on the
    PTX count)."""
    with tempfile.TemporaryDirectory() as d:
        src, cubin = Path(d, "kernel.ptx"), Path(d, "kernel.cubin")
        src.write_text(ptx)
        cmd = [
            ptxas,
            "-lineinfo",
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name=sm_{ARCH}a",
            str(src),
            "-o",
            str(cubin),
        ]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        cuobjdump = Path(ptxas).with_name("cuobjdump")
        sass = subprocess.run(
            [str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True
        ).stdout

    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "regs": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack": grab(r"(\d+) bytes stack frame"),
        "ptxas_warnings": sorted(
            set(re.findall(r"\((C\d+)\) ([^\n]*?)(?: in the function.*)?$", log, re.M))
        ),
        "sass_mufu": dict(sorted(collections.Counter(re.findall(r"MUFU\.\w+", sass)).items())),
        "mufu_sass": len(re.findall(r"MUFU\.\w+", sass)),
    }


def occupancy(regs: int, warps: int, shared: int) -> tuple[int, list[str]]:
    """(CTAs per SM, what limits them) on Hopper for a kernel of ``regs`` registers per thread,
    ``warps`` warps per CTA and ``shared`` bytes of dynamic shared memory per CTA (the CUDA
    occupancy calculator's rules, with the largest shared-memory carveout)."""
    hw = HOPPER
    per_warp = -(-max(regs, 1) * 32 // hw["reg_unit"]) * hw["reg_unit"]
    by_regs = (hw["regs"] // hw["partitions"] // per_warp) * hw["partitions"] // warps
    cta_smem = -(-(shared + hw["smem_reserved"]) // hw["smem_unit"]) * hw["smem_unit"]
    by_smem = 0 if shared > hw["smem_per_cta"] else hw["smem"] // cta_smem
    limits = {"regs": by_regs, "smem": by_smem, "warps": hw["warps"] // warps, "blocks": hw["ctas"]}
    n = min(limits.values())
    return n, [k for k, v in limits.items() if v == n]


# ---------------------------------------------------------------------------------------------
# Compile-only launches


class _StandInDriver:
    """What Triton's launch path asks of the active driver before it compiles: a device, a
    stream and the target. Nothing here can load or launch a kernel."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


class _CompileOnly:
    """While active: `JITFunction.run` compiles (``warmup=True``) instead of launching and
    records each compiled kernel under the current case; libdevice calls are counted in each
    kernel's LLVM module before libdevice is linked; torch's SDPA is a stub."""

    def __init__(self, keep: Path | None = None):
        self.keep = keep  # where the libdevice counts of a persistent Triton cache are kept
        self.case: dict = {}
        self.launches: list[tuple[dict, object, str | None]] = []  # (case, kernel, error)
        self.sdpa: set[str] = set()
        self._libdevice: collections.Counter | None = None
        self.libdevice: dict[str, dict] = {}  # kernel hash → {__nv_name: calls}

    def _remember(self, key: str) -> None:
        """The libdevice counts of the kernel just compiled (from this compile, else from the
        record a run before this one left beside a persistent Triton cache)."""
        side = self.keep / f"{key}.json" if self.keep else None
        if self._libdevice is not None:
            self.libdevice[key] = dict(self._libdevice)
            if side:
                side.parent.mkdir(parents=True, exist_ok=True)
                side.write_text(json.dumps(self.libdevice[key]))
        elif key not in self.libdevice and side and side.exists():
            self.libdevice[key] = json.loads(side.read_text())

    @contextlib.contextmanager
    def active(self):
        import torch.nn.functional as F
        import triton.backends.nvidia.compiler as nv
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        real_run, real_layout = JITFunction.run, nv.llvm.attach_datalayout
        real_sdpa, real_driver = F.scaled_dot_product_attention, driver._active  # (None: unasked)
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            recorder._libdevice = None
            err = None
            kernel = None
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # ptxas failures print the PTX
                    kernel = real_run(fn, *args, grid=grid, warmup=True, **kwargs)
            except Exception as e:  # one failed variant is one row, not the end of the run
                err = one_line(e)
            if kernel is not None:
                recorder._remember(kernel.hash)
            name = f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}"
            consts = {k: v for k, v in kwargs.items() if k.isupper()}
            recorder.launches.append(
                ({**recorder.case, "kernel": name, "constexprs": consts}, kernel, err)
            )
            return kernel

        def attach_datalayout(mod, *args, **kwargs):
            calls = re.findall(r"call [^@\n]*@(__nv_\w+)", str(mod))
            recorder._libdevice = collections.Counter(calls)
            return real_layout(mod, *args, **kwargs)

        def sdpa(q, k, v, *args, **kwargs):
            recorder.sdpa.add(recorder.case.get("method", "?"))
            out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
            return out + 0.0 * (q.sum() + k.sum() + v.sum())  # gradients reach q, k, v

        driver.set_active(_StandInDriver(GPUTarget("cuda", ARCH, 32)))
        JITFunction.run = run
        nv.llvm.attach_datalayout = attach_datalayout
        F.scaled_dot_product_attention = sdpa
        try:
            with _as_on_cuda():
                yield self
        finally:
            JITFunction.run = real_run
            nv.llvm.attach_datalayout = real_layout
            F.scaled_dot_product_attention = real_sdpa
            driver._active = real_driver


@contextlib.contextmanager
def _as_on_cuda():
    """The library's device checks answer for CPU tensors as for CUDA tensors of the same dtype:
    the Triton kernels where `devices.triton_ready` says so, and neither the CPU flash kernel
    nor the C++ tile loops (CPU only); tile budgets as on a device."""
    from sharpattn.attention import devices
    from sharpattn.attention.cpu import (
        adaptive_tiled,
        fused,
        native,
        sparse_tiled,
        tiles,
    )

    cuda = torch.device("cuda")

    def as_cuda(device):
        return cuda if device.type == "cpu" else device

    ready, wanted, budget = devices.triton_ready, native.wanted, tiles.device_budget
    patches = [
        (devices, "triton_ready", lambda d, t: ready(as_cuda(d), t)),  # the one readiness check
        (native, "wanted", lambda d, t: wanted(as_cuda(d), t)),
        (fused, "flash_available", lambda q, v: False),
        *(
            (m, "device_budget", lambda b, d: budget(b, as_cuda(d)))
            for m in (tiles, sparse_tiled, adaptive_tiled)
        ),
    ]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    for m, name, fn in patches:
        setattr(m, name, fn)
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


# ---------------------------------------------------------------------------------------------
# The run


def run_case(
    rec: _CompileOnly, name, method, params, dtype, d, causal, n, heads, lq=None
) -> str | None:
    """One method's forward and backward as ``gpu.py`` calls them (``lq`` query rows, default
    n: a decoding step's few rows take the template's split forward); None, or why it
    failed."""
    import gpu

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(gpu.B, heads, rows, d, generator=g).to(dtype).requires_grad_()
        for rows in (lq or n, n, n)
    )
    rec.case = {"method": name, "dtype": SHORT[dtype], "D": d, "causal": causal}
    try:
        out = gpu.call(name, q, k, v, causal)()
        grad = torch.zeros(q.shape, dtype=q.dtype)  # gpu.py's: randn of q's shape
        torch.autograd.grad(out, (q, k, v), grad, allow_unused=True)
    except Exception as e:
        return one_line(e)
    return None


def one_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def describe(kernel, ptxas: str, libdevice: dict | None) -> dict:
    md = kernel.metadata
    ptx = kernel.asm["ptx"]
    usage = ptxas_usage(ptxas, ptx)
    ctas, limits = occupancy(usage["regs"], md.num_warps, md.shared)
    return {
        **usage,
        "shared": md.shared,
        "num_warps": md.num_warps,
        "num_stages": md.num_stages,
        "ctas_per_sm": ctas,
        "limited_by": limits,
        **ptx_counts(ptx),
        "libdevice": None if libdevice is None else sum(libdevice.values()),
        "libdevice_calls": libdevice,
        "hash": md.hash,
    }


def collect(rec: _CompileOnly, ptxas: str) -> list[dict]:
    """One row per distinct compiled kernel (by Triton's hash) of each (dtype, D, causal), with
    every method that launched it; one row per failed compile."""
    rows: dict[tuple, dict] = {}
    described: dict[str, dict] = {}
    for case, kernel, err in rec.launches:
        where = (case["kernel"], case["dtype"], case["D"], case["causal"])
        if kernel is None:
            key = (*where, "error", json.dumps(case["constexprs"], sort_keys=True, default=str))
            extra = {"error": err or "no kernel"}
        else:
            key = (*where, kernel.hash)
            if kernel.hash not in described:
                try:
                    described[kernel.hash] = describe(kernel, ptxas, rec.libdevice.get(kernel.hash))
                except Exception as e:
                    described[kernel.hash] = {"error": one_line(e)}
            extra = described[kernel.hash]
        row = rows.setdefault(
            key,
            {
                "kernel": case["kernel"],
                "methods": [],
                "dtype": case["dtype"],
                "D": case["D"],
                "causal": case["causal"],
                "constexprs": {k: str(v) for k, v in case["constexprs"].items()},
                **extra,
            },
        )
        if case["method"] not in row["methods"]:
            row["methods"].append(case["method"])
    return list(rows.values())


def dump(rec: _CompileOnly, folder: Path) -> None:
    """Each compiled kernel's PTX as ``folder/<kernel>-<hash prefix>.ptx``."""
    folder.mkdir(parents=True, exist_ok=True)
    for case, kernel, _ in rec.launches:
        if kernel is not None:
            Path(folder, f"{case['kernel']}-{kernel.hash[:12]}.ptx").write_text(kernel.asm["ptx"])


def _cell(row: dict, col: str) -> str:
    if col == "kernel":
        return f"`{row['kernel']}`"
    if col == "method(s)":
        return ", ".join(row["methods"])
    if col in ("dtype", "D"):
        return str(row[col])
    if col == "causal":
        return "yes" if row["causal"] else "no"
    if "error" in row:
        return ""
    if col == "spills":
        return str(row["spill_stores"])
    if col == "smem KB":
        return (
            f"{row['shared'] / 1024:.0f}"
            if row["shared"] % 1024 == 0
            else (f"{row['shared'] / 1024:.1f}")
        )
    if col == "CTAs/SM":
        return f"{row['ctas_per_sm']} ({', '.join(row['limited_by'])})"
    if col == "libdevice":
        calls = row["libdevice_calls"]
        if calls is None:
            return "?"
        names = ", ".join(f"{k.removeprefix('__nv_')}" for k in sorted(calls))
        return f"{row['libdevice']} ({names})" if calls else "0"
    if col == "wgmma":  # ptxas's C7515: the wgmma pipeline is serialized
        serial = any(code == "C7515" for code, _ in row["ptxas_warnings"])
        return f"{row['wgmma']}{' serialized' if serial else ''}"
    if col == "MUFU":  # the PTX's approximate ops / the machine code's MUFU instructions
        return f"{row['mufu']} / {row['mufu_sass']}"
    key = {"regs": "regs", "cp.async": "cp_async", "fp64": "fp64"}[col]
    return str(row[key])


def table(rows: list[dict], sdpa: dict | None = None, failed: dict | None = None) -> str:
    """Markdown: one line per row of `collect`; then the methods that called torch's SDPA
    (``sdpa``: method → whether it launched kernels too) and the calls that failed."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for row in rows:
        cells = [_cell(row, c) for c in COLUMNS]
        if "error" in row:
            cells[5] = f"failed: {row['error']}"
        lines.append("| " + " | ".join(cells) + " |")
    only = [m for m, kernels in (sdpa or {}).items() if not kernels]
    also = [m for m, kernels in (sdpa or {}).items() if kernels]
    if only:
        lines += ["", "No Triton kernel (torch's SDPA on CUDA): " + ", ".join(only) + "."]
    if also:
        lines += ["", "Torch's SDPA besides the kernels: " + ", ".join(also) + "."]
    if failed:
        lines += ["", "Calls that failed before or between launches:"]
        lines += [f"- {case}: {why}" for case, why in failed.items()]
    return "\n".join(lines)


def header(doc: dict) -> str:
    lq = f", Lq = {doc['lq']}" if doc.get("lq") else ""
    return (
        f"Triton {doc['triton']}, target {doc['target']} (compiled, not run); B = "
        f"{doc['B']}, H = {doc['H']}, n = {doc['n']}{lq}"
    )


def _ptxas_path() -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(ARCH).path


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods",
        default="",
        help="comma-separated gpu.py cases (default: every "
        "one that can reach this library's kernels)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", help="comma-separated: bfloat16, float32, float16"
    )
    p.add_argument("--head-dims", default="64", help="comma-separated head sizes D")
    p.add_argument("--causal", default="both", choices=["both", "causal", "full"])
    p.add_argument(
        "--n", type=int, default=16384, help="Lk (and Lq unless --lq; gpu.py's largest size)"
    )
    p.add_argument("--heads", type=int, default=None, help="H (default 16, the GPU check's)")
    p.add_argument(
        "--lq",
        type=int,
        default=None,
        help="query rows (default n): 1-16 compile a decoding step's kernels (the split forward)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows there")
    p.add_argument(
        "--cache-dir",
        help="Triton's cache folder, kept between runs (default: a new "
        "temporary one: every kernel compiled afresh)",
    )
    p.add_argument("--dump", metavar="DIR", help="also write each variant's PTX there")
    p.add_argument("--table", metavar="JSON", help="print the table of a result file and exit")
    args = p.parse_args(argv)
    if args.table:
        doc = json.loads(Path(args.table).read_text())
        print(header(doc) + "\n\n" + table(doc["rows"], doc.get("sdpa"), doc.get("failed")))
        return doc["rows"]

    import gpu

    if args.cache_dir:
        os.environ["TRITON_CACHE_DIR"] = args.cache_dir
    scratch = None if args.cache_dir else tempfile.TemporaryDirectory(prefix="gpu_compile_")
    if scratch is not None:
        os.environ["TRITON_CACHE_DIR"] = scratch.name
    from triton.runtime.jit import JITFunction

    from sharpattn.attention.triton import template

    if _INTERPRETED or not isinstance(template._forward_kernel, JITFunction):
        sys.exit(
            "gpu_compile.py: triton was imported in interpreter mode (TRITON_INTERPRET); "
            "run it in a process without that variable."
        )
    ptxas = _ptxas_path()
    names = args.methods.split(",") if args.methods else default_methods()
    from gpu_common import CAUSAL_ONLY, method_case

    cases = {name: method_case(name) for name in names}
    dtypes = [DTYPES[t.strip()] for t in args.dtype.split(",")]
    dims = [int(x) for x in args.head_dims.split(",")]
    masks = {"both": (False, True), "causal": (True,), "full": (False,)}[args.causal]
    heads = args.heads or HEADS
    todo = [
        (dt, d, c, name)
        for dt in dtypes
        for d in dims
        for c in masks
        for name in cases
        if c or cases[name][0].split(":")[0] not in CAUSAL_ONLY
    ]
    rec = _CompileOnly(Path(args.cache_dir, "gpu_compile_libdevice") if args.cache_dir else None)
    failed = {}
    t0 = time.perf_counter()
    with rec.active():
        for i, (dtype, d, causal, name) in enumerate(todo, 1):
            method, params = cases[name]
            before = len(rec.launches)
            t = time.perf_counter()
            why = run_case(rec, name, method, params, dtype, d, causal, args.n, heads, args.lq)
            label = f"{name} {SHORT[dtype]} D={d} {'causal' if causal else 'full'}"
            if why:
                failed[label] = why
            launched = rec.launches[before:]
            bad = sum(1 for *_, e in launched if e)
            print(
                f"[{i}/{len(todo)}] {label}: {len(launched)} launch(es)"
                + (f", {bad} failed" if bad else "")
                + (f"; {why}" if why else "")
                + f" ({time.perf_counter() - t:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        print(
            f"ptxas -v and cuobjdump on {len({k.hash for _, k, _ in rec.launches if k})} "
            "compiled kernels",
            file=sys.stderr,
            flush=True,
        )
        rows = collect(rec, ptxas)
    if args.dump:
        dump(rec, Path(args.dump))
    sdpa = {m: any(m in r["methods"] for r in rows) for m in cases if m in rec.sdpa}
    print(f"{len(rows)} kernel variants in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    import triton

    doc = {
        "triton": triton.__version__,
        "target": f"sm_{ARCH}a",
        "B": gpu.B,
        "H": heads,
        "n": args.n,
        "lq": args.lq,
        "torch": torch.__version__,
        "rows": rows,
        "sdpa": sdpa,
        "failed": failed,
    }
    print(header(doc) + "\n\n" + table(rows, sdpa, failed))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str))
    if scratch is not None:
        scratch.cleanup()
    return rows


if __name__ == "__main__":
    main()
