"""The install beside a user's own torch (a CUDA one on a GPU machine): the wheel asks for torch
as a lower bound only, and pip adds sharpattn to an environment that has a torch without touching
it; ``kernels`` (what ``sharpattn info`` lists) follows the library's own dispatch, on the CPU and
on a CUDA device that is only pretended (no GPU here).

Offline: the wheel is built from a copy of the sources without build isolation, and pip installs
it with ``--no-index`` into a throwaway venv that sees this environment's packages (torch among
them) through a ``.pth`` file, but not sharpattn's own editable install."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from sharpattn import normalizers as nz
from sharpattn.attention import devices
from sharpattn.attention.cpu import native
from sharpattn.attention.dispatch import machine

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])


def _env() -> dict:
    """This environment without PYTHONPATH (the installed wheel must be what imports)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONFIG_FILE")}


def _run(*cmd, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=_env(), cwd=cwd, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """sharpattn's wheel, built offline from a copy of the sources (the checkout stays clean)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    out = tmp / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        out,
        source,
    )
    (found,) = out.glob("sharpattn-*.whl")
    return found


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(name).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def test_the_wheel_asks_for_torch_as_a_lower_bound_only(wheel):
    """Any torch from 2.1 on satisfies it (a CUDA build too): no pin, no upper bound; the gpu
    extra adds triton, on Linux only, and nothing else."""
    requires = _requires(wheel)
    (torch_req,) = [r for r in requires if re.match(r"torch\b", r)]
    assert re.fullmatch(r"torch\s*>=\s*2\.1", torch_req), torch_req
    gpu = [r for r in requires if 'extra == "gpu"' in r]
    assert len(gpu) == 1 and gpu[0].startswith("triton") and "sys_platform" in gpu[0], gpu


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


def test_pip_installs_the_wheel_beside_an_existing_torch_without_touching_it(wheel, tmp_path):
    """A venv whose python sees this environment's torch (a stand-in for a user's CUDA torch):
    pip, offline, plans to install sharpattn alone, installs it, and torch is the same files,
    same version, same place; ``import sharpattn`` then runs from the wheel on that torch."""
    torch_init = Path(torch.__file__).resolve()
    (torch_info,) = SITE.glob(f"torch-{torch.__version__.split('+')[0]}*.dist-info")
    before = (_stamp(torch_init), _stamp(torch_info / "RECORD"))
    # this environment's packages, minus sharpattn's editable install (else pip finds it there)
    shared = tmp_path / "shared"
    shared.mkdir()
    for entry in SITE.iterdir():
        if "sharpattn" not in entry.name and not entry.name.endswith(".pth"):
            (shared / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        ).stdout.strip()
    )
    (purelib / "shared.pth").write_text(f"{shared}\n")
    pip = (
        python,
        "-m",
        "pip",
        "--disable-pip-version-check",
        "install",
        "--no-index",
        "--find-links",
        wheel.parent,
    )

    report = json.loads(_run(*pip, "--dry-run", "--quiet", "--report", "-", "sharpattn").stdout)
    planned = [item["metadata"]["name"] for item in report["install"]]
    assert planned == ["sharpattn"], planned  # torch, numpy, entmax: already satisfied
    _run(*pip, "--quiet", "sharpattn")

    code = "import sharpattn, torch; print(torch.__version__, torch.__file__, sharpattn.__file__)"
    version, torch_file, sharpattn_file = _run(python, "-c", code, cwd=tmp_path).stdout.split()
    assert version == torch.__version__
    assert Path(torch_file).resolve() == torch_init
    assert Path(sharpattn_file).is_relative_to(purelib)
    assert (_stamp(torch_init), _stamp(torch_info / "RECORD")) == before


# ---------------------------------------------------------------------------------------------
# What `sharpattn info` lists: the kernel per family


def _fake_triton(monkeypatch):
    """`devices.triton_ready` says yes for a CUDA tensor, as where triton imports (no GPU)."""
    monkeypatch.setattr(devices, "triton_kernels", lambda: object())


def test_kernels_follow_the_dispatch_on_a_pretended_cuda_device(monkeypatch):
    """With triton ready on CUDA (pretended), every method with a Triton kernel is listed with
    it, exactly those `devices.backend` sends there (of their kernel records); the softmax
    family takes torch's SDPA; and passing ``triton=True`` gives the same table."""
    _fake_triton(monkeypatch)
    cuda = torch.device("cuda")
    table = machine.kernels(cuda, torch.bfloat16)
    assert table == machine.kernels("cuda", torch.bfloat16, triton=True)
    for family in ("Elementwise", "RowNormalised"):
        for name, kernel in table[family].items():
            where = devices.backend(nz.get(name).family.kernel, cuda, torch.bfloat16, False)
            assert (kernel == "Triton kernel") == (where == "triton"), (name, kernel)
    stick = nz.get("stick_breaking").family.kernel
    assert devices.backend(stick, cuda, torch.bfloat16, False) == "triton"
    assert set(table["StickBreaking"].values()) == {"Triton kernel"}
    assert set(table["Sparse"].values()) == set(table["TopK"].values()) == {"Triton kernel"}
    assert set(table["RowScaled"].values()) == {"torch SDPA"}
    assert "C++" not in json.dumps(table)  # the loops are the CPU's only


def test_kernels_without_triton_on_cuda_are_the_tiles():
    """CUDA without triton (or with ``SHARPATTN_TRITON=0``): the tiles in PyTorch, SDPA."""
    table = machine.kernels("cuda", triton=False)
    assert set(table["Elementwise"].values()) == {"tiles (PyTorch)"}
    assert set(table["Sink"].values()) == {"torch SDPA (sink as a key)"}
    assert "Triton" not in json.dumps(table)


def test_kernels_on_this_cpu_and_in_sharpattn_info():
    """On the CPU the C++ loops where `native.wanted` says they run (else the tiles), never
    Triton; ``sharpattn info`` prints one line per family, with a CUDA column only where there
    is CUDA."""
    table = machine.kernels("cpu")
    loops = native.wanted(torch.device("cpu"), torch.float32)
    assert set(table["Elementwise"].values()) == {"C++ loops" if loops else "tiles (PyTorch)"}
    assert table["Adaptive"]["adaptive"] == (
        "C++ slabs" if loops else "entropy tiles + CPU flash kernel"
    )
    assert "Triton" not in json.dumps(table)
    off = machine.kernels("cpu", loops=False, flash=False)
    assert set(off["Sparse"].values()) == {"tiles (PyTorch)"}
    assert off["RowScaled"]["softmax"] == "torch SDPA"

    state = {"cpu": table, "cuda": None}
    lines = machine._kernel_lines(state)
    assert lines[0].endswith(": CPU") and len(lines) == 1 + len(table)
    both = machine._kernel_lines({"cpu": table, "cuda": machine.kernels("cuda", triton=True)})
    assert both[0].endswith("CPU | CUDA")
    assert any(
        line.startswith("  Elementwise (sigmoid, relu): ") and "| Triton kernel" in line
        for line in both
    )
