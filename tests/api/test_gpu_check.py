"""The prepared GPU check (``benchmarks/gpu_check.sh``) runs end to end here, in its dry mode
(the CPU, tiny sizes, the kernels in Triton's interpreter, the CUDA tests only collected), so a
broken script is found before a GPU is at hand; a library that does not import stops it with one
sentence; a step that hangs leaves its stack and ends the step, not the run; the table reads
both its own cells and the older whole-result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
pytest.importorskip("triton", reason="the dry run walks the Triton kernels in the interpreter")


def _check(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "SHARPATTN_TEST_DEVICE"}
    environ |= {"PYTHON": sys.executable, "TRITON_INTERPRET": "1", **(env or {})}
    environ.pop("OUT", None)
    return subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--out", str(tmp_path), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def _cells(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("part", [1, 2])
def test_the_gpu_check_runs_end_to_end_in_its_dry_mode(tmp_path, part):
    got = _check(tmp_path, "--dry-run", "--part", str(part))
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    # the device tool brings back at most eight files from a call
    assert files == [f"{k}-{part}.{ext}" for k, ext in
                     (("cells", "jsonl"), ("check", "log"), ("env", "json"),
                      ("summary", "md"), ("tests", "log"))]  # fmt: skip
    rows = _cells(tmp_path / f"cells-{part}.jsonl")
    steps = [r for r in rows if r["kind"] == "step"]
    assert steps and all(r["status"] == "ok" for r in steps), steps
    bench = [r for r in rows if r["kind"] == "bench"]
    measured = [r for r in bench if "ms" in r]
    assert measured, bench
    for r in measured:  # both baselines, the kernel and the host time
        assert {"ratio_flash", "ratio_default", "flash_ms", "default_ms", "host_ms"} <= set(r)
        assert r["ms"] > 0 and r["host_ms"] > 0
    tests = [r for r in rows if r["kind"] == "tests"]
    assert len(tests) == 1 and "collected" in tests[0]["collected"]
    summary = (tmp_path / f"summary-{part}.md").read_text()
    assert "| method | family | setting |" in summary
    assert got.stdout.strip().splitlines()[-1].startswith(f"gpu_check part {part}: ")
    assert summary.splitlines()[0] in got.stdout
    if part == 1:
        smoke = [r for r in rows if r["kind"] == "smoke"]
        assert {r["family"] for r in smoke} == {"Elementwise", "Sparse"}
        assert all(not r["failed"] for r in smoke), smoke
    else:  # an anchor that cannot run is a line of the table, never the end of the run
        anchor = [r for r in bench if r["method"] == "anchor:adasplash"]
        assert anchor and all("error" in r for r in anchor)
        assert "anchor:adasplash" in summary and "Not measured" in summary
        for key in ("docs", "window"):  # packed documents and a sliding window, causal
            structured = [r for r in measured if r.get(key) == 8]
            assert structured and all(r["causal"] for r in structured), key
            assert f" {key}8 |" in summary


def test_a_library_that_does_not_import_stops_the_check_with_one_sentence(tmp_path):
    """entmax made unimportable: the check names it and says how to bring it, exit 2, before
    any step runs."""
    fake = tmp_path / "site" / "entmax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'entmax'\", name='entmax')\n"
    )
    env = {"PYTHONPATH": str(tmp_path / "site"), "GPU_WHEELS": str(tmp_path / "no-wheels")}
    got = _check(tmp_path / "out", "--dry-run", env=env)
    assert got.returncode == 2, got.stdout + got.stderr
    last = got.stdout.strip().splitlines()[-1]
    assert "No module named 'entmax'" in last and "make gpu-wheels" in last
    assert not (tmp_path / "out" / "cells-1.jsonl").exists()


def test_a_step_that_hangs_leaves_its_stack_and_ends_alone(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    log = gpu_check.Log(tmp_path / "log")
    hang = "import time\ndef stuck_in_a_kernel():\n    time.sleep(60)\nstuck_in_a_kernel()\n"
    got = gpu_check.run_step([sys.executable, "-X", "faulthandler", "-c", hang], {}, 2.0, log)
    assert got["timed_out"] and got["seconds"] < 30
    text = (tmp_path / "log").read_text()
    assert "Fatal Python error" in text and "stuck_in_a_kernel" in text


def test_the_table_reads_older_whole_results():
    """A result of the earlier benchmark (one ratio, against SDPA as torch picked it) is read
    as such: its ratios land in the default-SDPA column, none in flash's."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    rows = gpu_check.load([BENCH / "results" / "gpu_bf16_triton.json"])
    assert rows and all("ratio_flash" not in r for r in rows)
    table = gpu_check.summary(rows)
    assert "| sigmoid | Elementwise | bf16 D64 H4 fwd+bwd | no |" in table
    assert "| – / 3.67 | – / 3.46 |" in table  # sigmoid forward+backward, 1k and 4k, as published
