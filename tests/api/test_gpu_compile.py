"""benchmarks/gpu_compile.py compiles the Triton kernels for Hopper on a machine without a GPU
(Triton's bundled ptxas): one small method, in a process of its own, since this one runs Triton
in its interpreter (tests/conftest.py sets TRITON_INTERPRET before triton is imported)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> Path:
    """Triton's bundled ptxas, found without importing triton here; skips the test where there
    is none or it does not run on this machine."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("triton is not installed")
    ptxas = Path(spec.submodule_search_locations[0], "backends", "nvidia", "bin", "ptxas")
    try:
        subprocess.run([str(ptxas), "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"Triton's ptxas cannot run here ({err})")
    return ptxas


def test_sigmoid_compiles_for_hopper_without_a_gpu(tmp_path):
    _ptxas()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_compile.py"),
            "--methods",
            "sigmoid",
            "--dtype",
            "bfloat16",
            "--head-dims",
            "64",
            "--causal",
            "causal",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    kernels = {r["kernel"].rsplit(".", 1)[-1]: r for r in rows}
    assert set(kernels) == {"_forward_kernel", "_dkdv_kernel", "_dq_kernel"}, rows
    for row in rows:
        assert "error" not in row, row
        assert row["methods"] == ["sigmoid"] and row["causal"] is True and row["D"] == 64
        assert row["regs"] > 0 and row["ctas_per_sm"] >= 1
        assert row["mufu"] > 0  # σ's exponential: ex2.approx
    forward = kernels["_forward_kernel"]
    assert forward["wgmma"] > 0 and forward["mufu_ops"].get("ex2.approx.f32", 0) > 0
    assert "| `template._forward_kernel` | sigmoid | bf16 | 64 | yes |" in done.stdout
