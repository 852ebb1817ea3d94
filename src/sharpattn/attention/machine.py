"""Which of `attend`'s code paths run on this machine: `info` (also ``sharpattn.info()`` and the
``sharpattn info`` command)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch

from . import fused, native

__all__ = ["TURN_OFF", "info", "info_text"]

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


def info() -> dict:
    """The code paths `attend` can take in this process, and where the native build is cached.

    Returns a dict: ``version`` (sharpattn's), ``torch``, ``threads`` (torch's CPU threads),
    ``compile`` (``SHARPATTN_COMPILE``: ``"0"``, ``"1"`` or ``"auto"``), ``native`` (the C++ tile
    loops: ``active``, ``compiler``, ``cache``, ``library``, as
    ``sharpattn.attention.native.status()`` gives them, and ``turn_off``, the setting
    that disables them), ``cpu_flash`` (whether torch's CPU flash kernel with log-sum-exp is
    there: the softmax family's fused path), ``cuda`` (None, or the device count and the first
    device's name) and ``triton`` (its version, or None). Builds the C++ loops if this process
    has not yet (one line on stderr while it compiles)."""
    try:
        version = importlib.metadata.version("sharpattn")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        version = "(not installed)"
    cuda = None
    if torch.cuda.is_available():
        cuda = {"devices": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0)}
    return {
        "version": version,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compile": native.mode(),
        "native": {**native.status(), "turn_off": TURN_OFF},
        "cpu_flash": fused.flash_kernel_available(),
        "cuda": cuda,
        "triton": _triton(),
    }


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
    cuda = "not available" if s["cuda"] is None else (
        f"{s['cuda']['devices']} device(s), {s['cuda']['name']}"
    )  # fmt: skip
    lines = [
        f"sharpattn {s['version']}, torch {s['torch']}, {s['threads']} CPU thread(s)",
        f"C++ tile loops (CPU, float32): {loops}",
        f"  cache folder: {n['cache']}",
        f"  turn them off: {TURN_OFF} (now "
        f"SHARPATTN_COMPILE={os.environ.get('SHARPATTN_COMPILE', 'auto')})",
        f"CPU flash kernel (softmax family, adaptive's second pass): {flash}",
        f"CUDA: {cuda}",
        f"Triton: {s['triton'] or 'not installed'}"
        + (" (unused without CUDA)" if s["triton"] and s["cuda"] is None else ""),
    ]
    return "\n".join(lines)
