"""benchmarks/decoding.py in its quick mode, tiny: it runs, prints its table, writes the JSON it
is asked for and nothing else, and refuses to replace a file without ``--force``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("decoding", ROOT / "benchmarks" / "decoding.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_writes_the_json_asked_for(tmp_path, capsys):
    bench = _module()
    assert "stick_breaking" in bench.methods_with_fast_path()
    out = tmp_path / "decoding.json"
    argv = ["--quick", "--lengths", "256", "--rows", "1,4", "--rounds", "2"]
    data = bench.main([*argv, "--methods", "stick_breaking,softmax", "--out", str(out)])
    assert json.loads(out.read_text()) == data
    printed = capsys.readouterr().out
    assert "| stick_breaking | 4 | 256 |" in printed
    rows = {(r["method"], r["lq"]): r for r in data["rows"]}
    assert set(rows) == {(m, lq) for m in ("sdpa", "stick_breaking", "softmax") for lq in (1, 4)}
    row = rows[("stick_breaking", 4)]
    assert set(row["ratio"]) == {"check_finite=False", "check_finite=True"}
    assert row["tokens_per_s"]["check_finite=False"] == pytest.approx(
        4e3 / row["ms"]["check_finite=False"]
    )
    # an existing file stays unless --force; without --out nothing is written
    with pytest.raises(SystemExit):
        bench.main([*argv, "--methods", "softmax", "--out", str(out)])
    before = set(tmp_path.iterdir())
    bench.main([*argv, "--rows", "1", "--methods", "softmax", "--check-finite", "no"])
    assert set(tmp_path.iterdir()) == before
