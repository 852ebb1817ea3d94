"""The `sharpattn` command: list, demo, and one-sentence errors with exit code 2."""

import json
import shutil
import subprocess
import sys

import pytest

from sharpattn.cli import main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "softmax" in out and "adaptive" in out


def test_demo_writes_a_run_folder(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    assert main(["demo", "--sizes", "16,256,4096", "--rows", "32", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert "Lemma 2.1" in printed
    for name in ("config.json", "metrics.json", "report.md", "dispersion.png"):
        assert (out_dir / name).stat().st_size > 0
    for name in ("config.json", "metrics.json", "report.md", "winner_weight.png"):
        assert (out_dir / "dispersion" / name).stat().st_size > 0  # then every method
    rows = json.loads((out_dir / "metrics.json").read_text())
    soft = [r for r in rows if r["method"] == "softmax"]
    assert len(rows) == 2 * 2 * 3
    for r in soft:  # Lemma 2.1 holds for every measured row
        assert r["n_max_weight"] <= r["lemma_bound"]
    margin = {r["n"]: r for r in soft if r["setting"] == "margin"}
    assert (
        margin[16]["winner_weight"] > margin[256]["winner_weight"] > margin[4096]["winner_weight"]
    )
    adaptive = {r["n"]: r for r in rows if r["setting"] == "margin" and r["method"] == "adaptive"}
    assert adaptive[16]["winner_weight"] > margin[16]["winner_weight"]  # sharper at small n


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["demo", "--sizes", "16,x"], "--sizes"),
        (["demo", "--sizes", "1"], "integers from 2 to"),
        (["demo", "--margin", "-1"], "--margin"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_console_script_runs_without_traceback():
    exe = shutil.which("sharpattn") or str(
        __import__("pathlib").Path(sys.executable).with_name("sharpattn")
    )
    done = subprocess.run([exe, "demo", "--rows", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--rows" in done.stderr
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "demo" in done.stdout


def test_readme_quick_start_runs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 11
    exec(compile(code, "README quick start", "exec"), {})
