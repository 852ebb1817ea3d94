"""Table 1 under each reading of its L2 term: one run per reading, compared with the paper."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from sharpattn.cli import main
from sharpattn.experiments import max_retrieval as mr
from sharpattn.experiments import regularisers as rg
from sharpattn.lab.stats import paired_effect

pytestmark = pytest.mark.numerical

TINY = dict(
    seeds=2,
    group=2,
    steps=20,
    batch=16,
    threads=1,
    sizes=(16, 64),
    test_sets=100,
    checkpoint_every=10,
    log_every=10,
)


def test_study_trains_each_reading_and_compares_with_the_paper(tmp_path):
    config = mr.Config(**TINY)
    out = rg.study(tmp_path, config, ["l2", "adamw"])
    assert [r["regulariser"] for r in out["rows"]] == ["l2", "adamw"]
    for name in ("l2", "adamw"):
        run = tmp_path / name
        assert mr.read_config(run).regulariser == name
        assert (run / "table1.md").is_file() and (run / "accuracy.json").is_file()
    # the gap recomputed from the run's own accuracies, against the paper's Table 1
    acc = json.loads((tmp_path / "l2" / "accuracy.json").read_text())
    ours = [acc["baseline"][s]["64"] for s in ("0", "1")]
    e = paired_effect(np.full(2, mr.PAPER_TABLE1["baseline"][64]), ours)
    row = out["rows"][0]
    assert row["gap_sizes"] == [64]  # no size of GAP_SIZES: those beyond training
    assert row["baseline"]["gap"] == pytest.approx(e.mean)
    assert (row["baseline"]["low"], row["baseline"]["high"]) == pytest.approx((e.low, e.high))
    assert row["verdict"].split(" (")[0] in (
        "consistent with the paper's column",
        "below the paper's column",
        "above the paper's column",
    )
    # adamw against l2, paired over the same seeds
    other = json.loads((tmp_path / "adamw" / "accuracy.json").read_text())
    v = paired_effect(ours, [other["baseline"][s]["64"] for s in ("0", "1")])
    assert out["rows"][1]["versus_l2"]["effect"] == pytest.approx(v.mean)
    assert "versus_l2" not in row
    md = (tmp_path / "regularisers.md").read_text()
    assert "| adamw |" in md and "Readings whose interval holds" in md
    assert (tmp_path / "report.md").is_file()
    # the two readings trained different models from the same seeds
    assert out["rows"][0]["sum_w2"] != out["rows"][1]["sum_w2"]
    # Σw² from the training log is the final weights'; the comparison needs no weights
    models = [mr.load_model(tmp_path / "l2", config, s) for s in (0, 1)]
    final = [sum(float(p.detach().double().pow(2).sum()) for p in m.parameters()) for m in models]
    assert out["rows"][0]["sum_w2"] == pytest.approx(np.mean(final), rel=1e-12)
    packed = tmp_path / "packed"
    shutil.copytree(tmp_path, packed, ignore=shutil.ignore_patterns("*.safetensors", "packed"))
    again, _ = rg.compare({n: packed / n for n in ("l2", "adamw")})
    assert json.dumps(again) == json.dumps(out["rows"])


def test_study_refuses_unknown_readings_and_changed_training(tmp_path):
    config = mr.Config(**TINY)
    with pytest.raises(ValueError, match="unknown regulariser 'l3'; known: l2, half_l2"):
        rg.study(tmp_path, config, ["l2", "l3"])
    assert not (tmp_path / "l2").exists()  # refused before any work
    mr.open_run(tmp_path / "l2", mr.Config(**{**TINY, "steps": 5}))
    with pytest.raises(ValueError, match="different steps"):
        rg.study(tmp_path, config, ["l2"])


def test_gap_sizes():
    assert rg.gap_sizes(mr.PAPER_SIZES) == rg.GAP_SIZES
    assert rg.gap_sizes((16, 32, 64)) == (32, 64)


def test_cli_refuses_an_unknown_reading(tmp_path, capsys):
    argv = [
        "reproduce",
        "max-retrieval-regularisers",
        "--regularisers",
        "l2,l1",
        "--out",
        str(tmp_path / "s"),
    ]
    assert main(argv) == 2
    assert "unknown regulariser 'l1'" in capsys.readouterr().err


def test_verdict_never_calls_a_wide_interval_the_same():
    v = rg._verdict({"gap": -1.0, "low": -40.0, "high": 38.0})
    assert v.startswith("consistent with the paper's column") and "78.0 points wide" in v
    assert rg._verdict({"gap": -10.0, "low": -14.0, "high": -6.0}).startswith("below")
    assert rg._verdict({"gap": 3.0, "low": 1.0, "high": 5.0}).startswith("above")
    nan = float("nan")
    assert "too few seeds" in rg._verdict({"gap": 3.0, "low": nan, "high": nan})


def test_a_reading_takes_the_trained_seeds_of_a_run_with_its_settings(tmp_path, monkeypatch):
    config = mr.Config(**TINY)
    source = tmp_path / "table1"
    mr.reproduce(source, config)  # a Table 1 run: the "l2" reading's settings
    fresh = rg.study(tmp_path / "fresh", config, ["l2"])  # the premise: l2 trained again ...
    log = "train/seeds0-1/metrics.jsonl"
    assert (tmp_path / "fresh" / "l2" / log).read_bytes() == (source / log).read_bytes()
    out = tmp_path / "study"
    trained = []
    real = mr.train_runs
    monkeypatch.setattr(
        mr,
        "train_runs",
        lambda runs, *a: (
            trained.extend(p.name for p, c in runs if not mr.group_dir(p, [0, 1]).exists())
            or real(runs, *a)
        ),
    )
    result = rg.study(out, config, ["l2", "adamw"], reuse=source)
    assert trained == ["adamw"]  # ... so only the other reading trains
    assert (out / "l2" / log).read_bytes() == (source / log).read_bytes()
    assert result["rows"][0] == fresh["rows"][0]
    assert result["summary"]["reused"] == {"from": str(source), "groups": ["l2/seeds0-1"]}
    assert f"Trained seeds taken from `{source}`" in (out / "regularisers.md").read_text()
    again = rg.study(out, config, ["l2", "adamw"], reuse=source)  # resumed: still says so
    assert again["summary"]["reused"] == result["summary"]["reused"]
    with pytest.raises(ValueError, match="is not a max-retrieval run folder"):
        rg.study(out, config, ["l2"], reuse=tmp_path / "nothing")


def test_a_lambda_sweep_trains_each_reading_at_each_lambda(tmp_path):
    """--lambdas crosses the readings with values of λ: the default λ keeps the reading's plain
    name and folder, another is NAME@lambda=X in OUT/NAME-lambdaX, trained with that λ; the
    comparison names each row's convention and λ and the readings that hold both columns."""
    study = rg.configure("quick", regularisers="l2,adamw", lambdas="1e-3,2e-3")
    assert study.regularisers == ("l2", "adamw", "l2@lambda=0.002", "adamw@lambda=0.002")
    assert rg.parse_reading("l2_kernels@lambda=5e-4") == ("l2_kernels", 5e-4)
    config = mr.Config(**TINY)
    out = rg.study(tmp_path, config, ["l2", "l2@lambda=0.01"])
    assert mr.read_config(tmp_path / "l2-lambda0.01").l2 == 0.01
    assert mr.read_config(tmp_path / "l2").l2 == config.l2
    rows = out["rows"]
    assert [(r["convention"], r["lambda"]) for r in rows] == [("l2", config.l2), ("l2", 0.01)]
    assert rows[1]["versus_l2"]["effect"] == pytest.approx(
        paired_effect(rows[0]["baseline"]["per_seed"], rows[1]["baseline"]["per_seed"]).mean
    )
    assert rows[0]["sum_w2"] != rows[1]["sum_w2"]  # another λ trains another model
    md = (tmp_path / "regularisers.md").read_text()
    assert "λ = 0.01 |" in md and "hold both of the paper's columns" in md
    assert out["summary"]["matching_both"] == "none" or set(out["summary"]["matching_both"]) <= set(
        out["summary"]["matching"]
    )


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(lambdas="x"), "--lambdas must be values of λ >= 0"),
        (dict(lambdas="-1e-3"), "--lambdas must be values of λ >= 0"),
        (dict(regularisers="l3"), "unknown regulariser 'l3'"),
    ],
)
def test_a_malformed_sweep_is_refused_in_one_sentence(bad, words):
    with pytest.raises(ValueError, match=words):
        rg.configure("quick", **bad)
    with pytest.raises(ValueError, match="a reading's λ must be a number >= 0"):
        rg.parse_reading("l2@lambda=nan")
