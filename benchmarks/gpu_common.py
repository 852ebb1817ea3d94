"""What the GPU scripts share (``gpu.py``, ``gpu_smoke.py``, ``gpu_check.py``): the cases they
run, their families, the Triton route for a dry run on the CPU, and the cells file.

Nothing here imports sharpattn at module level: ``gpu_check.py`` reads the plan before it has
checked that the library imports on the machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: the maps of the headline cells, forward+backward in bfloat16 at 16k, 4k and 32k
HEADLINE = (
    *("softmax", "ssmax", "sink", "adaptive"),
    *("sigmoid", "relu", "power", "signed", "softpick", "stick_breaking"),
)
#: the maps of the decoding cells (Lq 1 and 16 against long caches: the split-K forwards), an
#: element-wise and a row-normalised map (the template's), then stick-breaking, top-k and
#: 1.5-entmax (their own: each row's rule over the whole cache), last so that a hang in one of
#: them leaves the others' cells
DECODING = ("sigmoid", "softpick", "stick_breaking", "topk", "entmax15")
#: the maps of the packed (documents as ``cu_seqlens``) and sliding-window cells: the softmax
#: family, an element-wise map and a sparse one (each new structure compiles its own kernels, so
#: few fit in the step's limit)
STRUCTURED = ("softmax", "sigmoid", "entmax15")
#: the maps that may not end in bounded time (data-dependent passes): each in its own process
SPARSE = ("sparsemax", "entmax15", "asentmax", "topk", "hardmax")
#: every case a GPU run of ``gpu.py`` launches: the cases of the check's cells (a method name,
#: or ``method@param=value``)
CASES = (*HEADLINE, "relu@p=2", *SPARSE, "entmax@alpha=1.3")
#: methods that refuse a query seeing a later key: measured in the causal cases only
CAUSAL_ONLY = {"stick_breaking"}
#: other projects' kernels of the same maps (rows ``anchor:NAME``): their package, and the case of
#: ours they compute. AdaSplash's α-entmax (PyPI ``adasplash``, 0.2: causal α = 1.5 through
#: AdaSplash-2, the rest through AdaSplash-1) and Tan et al.'s stick-breaking kernel
#: (``stickbreaking_attention``, GitHub only: no wheel, so a line in the table)
ANCHORS = {
    "adasplash": ("adasplash", "entmax15"),
    "stickbreaking": ("stickbreaking_attention", "stick_breaking"),
}


def versions() -> dict:
    """Python, torch, CUDA, cuDNN and Triton versions and the GPU's name, as far as they can be
    read (None where a module is missing or no GPU is visible)."""
    import platform

    env = {"python": platform.python_version()}
    try:
        import torch
    except ImportError:
        return env | dict.fromkeys(("torch", "cuda", "cudnn", "triton", "gpu"))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env |= {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return env


def method_case(name: str) -> tuple[str, dict[str, float]]:
    """``"entmax@alpha=1.3"`` → ``("entmax", {"alpha": 1.3})``; ``"sigmoid:tiles"`` keeps its
    suffix in the method (``gpu.py`` reads it); a plain name → no parameters."""
    method, _, param = name.partition("@")
    params = {}
    if param:
        key, value = param.split("=")
        params[key] = float(value)
    return method, params


def family(name: str) -> str:
    """The registry family of a case (``RowScaled``, ``Sparse``, ...), or ``anchor``."""
    if name.startswith("anchor:"):
        return "anchor of " + family(ANCHORS[name.partition(":")[2]][1])
    from sharpattn import normalizers as nz

    method = method_case(name)[0].partition(":")[0]
    entry = nz.get(method)
    return type(entry.family).__name__ if entry.family is not None else str(entry.fused)


def route_triton_to_cpu() -> None:
    """CPU tensors of float32 and float16 take the Triton kernels (in Triton's interpreter, which
    needs ``TRITON_INTERPRET=1`` before triton is imported) wherever CUDA tensors would: the dry
    run of the GPU scripts walks the kernels' launches without a GPU (as tests/conftest.py does
    with ``SHARPATTN_TEST_TRITON_CPU=1``)."""
    import torch

    from sharpattn.attention import devices

    def ready(device, dtype) -> bool:
        return dtype in (torch.float32, torch.float16) and not torch.compiler.is_compiling()

    devices.triton_ready = ready  # the one readiness check every backend choice asks


def append_cell(path: str | os.PathLike | None, row: dict) -> None:
    """One JSON line appended to ``path`` (one ``write`` in append mode: whole lines even when
    several processes append to the same file), flushed to disk at once."""
    if not path:
        return
    line = (json.dumps(row, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_cells(*paths: str | os.PathLike) -> list[dict]:
    """Every row of the cells files ``paths`` (a torn last line, from a process killed while
    writing, is skipped)."""
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
