"""benchmarks/packed.py runs end to end on a tiny packing and writes its table and rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_packed_benchmark_runs_and_writes_its_rows(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("packed", ROOT / "benchmarks" / "packed.py")
    packed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(packed)
    out = tmp_path / "packed.json"
    argv = ["--docs", "3", "--doc-len", "16", "--window", "4", "--repeats", "1"]
    packed.main([*argv, "--methods", "softmax,sigmoid", "--no-memory", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["method"] for r in result["rows"]] == ["softmax", "sigmoid"]
    assert all(r["packed_s"] > 0 and r["dense_s"] > 0 for r in result["rows"])
    assert "| softmax |" in capsys.readouterr().out
