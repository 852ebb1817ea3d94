"""Which of `attend`'s code paths run on this machine: `info` (also ``sharpattn.info()`` and the
``sharpattn info`` command)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch

from ..cpu import fused, native

__all__ = ["TURN_OFF", "cores", "free_cores", "info", "info_text", "kernels"]

#: how to keep every tiled path in plain PyTorch (no C++ build)
TURN_OFF = "SHARPATTN_COMPILE=0"


def _triton() -> str | None:
    """Triton's version where it is installed (found without importing it), else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def free_cores() -> tuple[int, float | None]:
    """``(n, load)``: the cores this process may run on that nothing else is using now, and the
    1-minute load average it was judged by: `cores` minus the load, rounded, at least 1 and at
    most `cores` (all of them where the system reports no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not Unix
        return cores(), None
    return min(cores(), max(1, round(cores() - load))), load


def info() -> dict:
    """The code paths `attend` can take in this process, and where the native build is cached.

    Returns a dict: ``version`` (sharpattn's), ``torch``, ``threads`` (torch's CPU threads,
    which the CPU paths use), ``cores`` (the CPUs this process may run on), ``load`` (the
    1-minute load average, None where the system has none), ``free_cores`` (`free_cores`),
    ``compile`` (``SHARPATTN_COMPILE``: ``"0"``, ``"1"`` or ``"auto"``), ``native`` (the C++ tile
    loops: ``active``, ``compiler``, ``cache``, ``library``, as
    ``sharpattn.attention.cpu.native.status()`` gives them, and ``turn_off``, the setting
    that disables them), ``cpu_flash`` (whether torch's CPU flash kernel with log-sum-exp is
    there: the softmax family's fused path), ``cuda`` (None, or the device count and the first
    device's name), ``triton`` (its version, or None) and ``kernels`` (`kernels` of the CPU, and
    of CUDA where there is one: ``{"cpu": ..., "cuda": ... | None}``). Builds the C++ loops if this process
    has not yet (one line on stderr while it compiles)."""
    try:
        version = importlib.metadata.version("sharpattn")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        version = "(not installed)"
    cuda = None
    if torch.cuda.is_available():
        cuda = {"devices": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0)}
    free, load = free_cores()
    return {
        "version": version,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cores": cores(),
        "load": load,
        "free_cores": free,
        "compile": native.mode(),
        "native": {**native.status(), "turn_off": TURN_OFF},
        "cpu_flash": fused.flash_kernel_available(),
        "cuda": cuda,
        "triton": _triton(),
        "kernels": {"cpu": kernels("cpu"), "cuda": None if cuda is None else kernels("cuda")},
    }


def kernels(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    triton: bool | None = None,
    loops: bool | None = None,
    flash: bool | None = None,
) -> dict[str, dict[str, str]]:
    """The kernel a call of each built-in method takes on ``device``, by family.

    For a call without statistics or a user mask (causal is fine), in ``dtype``. Each method's
    path is `fast.path_of`'s, and the choice within it is the one that path makes from three
    readiness flags, each asked of the library where not given: ``triton``
    (`devices.triton_ready`), ``loops`` (the C++ tile loops: `native.wanted`) and ``flash``
    (torch's private CPU flash kernel: `fused.flash_kernel_available`, on the CPU only). Passing
    them in shows what another machine would run (``device="cuda", triton=True`` without a GPU).

    Args:
        device: The device of the call's tensors.
        dtype: The dtype of q, k and v.
        triton: Whether the Triton kernels may run; None asks `devices.triton_ready`.
        loops: Whether the C++ tile loops may run; None asks `native.wanted`.
        flash: Whether torch's CPU flash kernel may run; None asks the torch build.

    Returns:
        ``{family: {method: kernel}}``, e.g. ``{"Elementwise": {"sigmoid": "C++ loops", ...}}``,
        families and methods in the registry's order.
    """
    from ...normalizers import registry
    from ...normalizers._contract import compute_dtype
    from .. import devices
    from ..cpu import adaptive_tiled, sparse_tiled, stick_tiled, tiled
    from . import fast

    device = torch.device(device)
    if triton is None:
        triton = devices.triton_ready(device, dtype)
    if loops is None:
        loops = native.wanted(device, compute_dtype(dtype))
    if flash is None:
        flash = device.type == "cpu" and fused.flash_kernel_available()
    tiles = "C++ loops" if loops else "tiles (PyTorch)"
    softmax = "CPU flash kernel" if flash else "torch SDPA"
    two_pass = f"{'Triton softmax' if triton else 'entropy tiles'} + {softmax}"

    def tiled_kernel(name: str) -> str:  # tiled.tiled_attention: devices.backend's order
        kernel = registry.get(name).family.kernel
        if kernel is None:
            return "tiles (PyTorch)"
        if triton and kernel.triton:
            return "Triton kernel"
        return "C++ loops" if loops and kernel.cpp else "tiles (PyTorch)"

    by_path = {  # each fast path's own choice, in the order it makes it
        fused.row_scaled: lambda name: softmax,
        fused.sink: lambda name: (
            "Triton softmax" if triton else softmax if flash else "torch SDPA (sink as a key)"
        ),
        fused.adaptive: lambda name: two_pass,
        adaptive_tiled.adaptive: lambda name: "C++ slabs" if loops else two_pass,
        tiled.hardmax: lambda name: "Triton kernel" if triton else "tiles (PyTorch)",
        sparse_tiled.topk: lambda name: (
            "Triton kernel" if triton else "C++ selection" if loops else "tiles (PyTorch)"
        ),
        fast.top_k: lambda name: (
            "Triton kernel" if triton else "C++ selection" if loops else "tiles (PyTorch)"
        ),
        stick_tiled.stick_breaking: lambda name: "Triton kernel" if triton else tiles,
        fast.stick: lambda name: "Triton kernel" if triton else tiles,
        tiled.elementwise: tiled_kernel,
        tiled.row_normalised: tiled_kernel,
    }
    for fn in (*sparse_tiled.SPARSE_TILED.values(), sparse_tiled.sparse):
        by_path.setdefault(fn, lambda name: "Triton kernel" if triton else tiles)

    out: dict[str, dict[str, str]] = {}
    for name in registry.available():
        entry = registry.get(name)
        if not registry.is_built_in(entry):
            continue
        path = fast.path_of(entry)
        fn = getattr(path, "func", path)  # a family's runner is bound to its family
        choose = by_path.get(fn)
        kernel = "scores matrix (PyTorch)" if choose is None else choose(name)
        family = type(entry.family).__name__ if entry.family is not None else "other"
        out.setdefault(family, {})[name] = kernel
    return out


def _kernels_cell(methods: dict[str, str]) -> str:
    """One family's kernels in a few words: the kernel, or each method's where they differ."""
    if len(set(methods.values())) == 1:
        return next(iter(methods.values()))
    return ", ".join(f"{m}: {k}" for m, k in methods.items())


def info_text(state: dict | None = None) -> str:
    """`info` as lines to read (what ``sharpattn info`` prints)."""
    s = info() if state is None else state
    n = s["native"]
    if n["active"]:
        loops = f"active, built by {n['compiler']}: {n['library']}"
    elif s["compile"] == "0":
        loops = f"off ({TURN_OFF} is set): the tiled paths run in plain PyTorch"
    elif n["compiler"] is None:
        loops = "off: no C++ compiler on the PATH (CXX, c++, g++ or clang++); plain PyTorch"
    else:
        loops = f"off: {n['compiler']} could not build them (see the warning); plain PyTorch"
    flash = "available" if s["cpu_flash"] else "not in this torch build (a slower fallback)"
    cuda = "not available"
    if s["cuda"] is not None:
        cuda = f"{s['cuda']['devices']} device(s), {s['cuda']['name']}"
    lines = [
        f"sharpattn {s['version']}, torch {s['torch']}, {s['threads']} CPU thread(s)",
        *_thread_lines(s),
        f"C++ tile loops (CPU, float32): {loops}",
        f"  cache folder: {n['cache']}",
        f"  turn them off: {TURN_OFF} (now "
        f"SHARPATTN_COMPILE={os.environ.get('SHARPATTN_COMPILE', 'auto')})",
        f"CPU flash kernel (softmax family, adaptive's second pass): {flash}",
        f"CUDA: {cuda}",
        f"Triton: {s['triton'] or 'not installed'}"
        + (" (unused without CUDA)" if s["triton"] and s["cuda"] is None else ""),
        *_kernel_lines(s["kernels"]),
    ]
    return "\n".join(lines)


def _thread_lines(s: dict) -> list[str]:
    """How the CPU paths use threads here: torch's setting against the cores and the load, and
    what to do where the machine is busier than the setting allows for."""
    if "cores" not in s:  # a dict from an older sharpattn
        return []
    load = "no load average here" if s["load"] is None else f"load {s['load']:.1f} (1 min)"
    lines = [
        f"  threads: attend's CPU paths use torch's setting ({s['threads']}; "
        f"torch.set_num_threads or OMP_NUM_THREADS); {s['cores']} core(s) usable, {load}, "
        f"{s['free_cores']} free now"
    ]
    if s["threads"] > s["free_cores"]:
        lines.append(
            f"  busy machine: a thread that waits for a core slows every tile; "
            f"torch.set_num_threads({s['free_cores']}) uses the free cores only"
        )
    return lines


def _kernel_lines(table: dict) -> list[str]:
    """The kernel each family's call takes (`kernels`): a CPU column, and a CUDA one where
    there is a CUDA device."""
    columns = [(name.upper(), table[name]) for name in ("cpu", "cuda") if table.get(name)]
    head = " | ".join(name for name, _ in columns)
    lines = [f"Kernel per family (float32, no statistics or user mask): {head}"]
    for family, methods in columns[0][1].items():
        cells = [_kernels_cell(col[family]) for _, col in columns]
        lines.append(f"  {family} ({', '.join(methods)}): " + " | ".join(cells))
    return lines
