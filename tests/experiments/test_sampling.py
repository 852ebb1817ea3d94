"""The leaderboard's evaluation budget: adaptive sampling of test sequences (blocks until the
Agresti-Coull standard error is small enough), the stopping rule for a run's larger sizes, the
Holm correction of its p-values, and the standard profile."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sharpattn.experiments import leaderboard
from sharpattn.experiments import sequence as seq
from sharpattn.lab import runner
from sharpattn.lab.stats import holm

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> seq.SequenceConfig:
    return seq.SequenceConfig(tasks=("flip_flop",), methods=("softmax",), **kw)


@pytest.mark.parametrize("solved, seqs", [(0, 32), (32, 32), (16, 32), (1, 7), (80, 160)])
def test_standard_error_is_agresti_coulls(solved, seqs):
    n = seqs + 4.0  # by hand, float64: p~ = (x + 2) / (n + 4), se = sqrt(p~ (1 - p~) / (n + 4))
    p = (solved + 2.0) / n
    assert seq.standard_error(solved, seqs) == pytest.approx(math.sqrt(p * (1 - p) / n), rel=1e-12)


def test_enough_stops_at_the_cap_and_after_the_minimum_once_the_error_is_small():
    fixed = _cfg(eval_sets=64)
    assert not seq.enough(0, 63, fixed) and seq.enough(0, 64, fixed)
    adaptive = _cfg(eval_sets=256, eval_se=0.04, eval_min=32)
    assert not seq.enough(0, 16, adaptive)  # below the minimum, whatever the error
    assert seq.enough(0, 32, adaptive)  # se(0/32) = 0.038
    assert not seq.enough(16, 32, adaptive)  # se(16/32) = 0.083
    assert seq.enough(128, 256, adaptive)  # the cap


class _Oracle(torch.nn.Module):
    """A 'model' whose argmax is the token itself: it solves a sequence whose targets are its
    tokens, and no other."""

    def forward(self, tokens):
        return torch.nn.functional.one_hot(tokens, 3).float()


def _stream(p: float):
    """test_sets' stand-in: batches of 16 sequences, each solved by :class:`_Oracle` with
    probability p (a fixed stream); the number solved of every prefix is returned too."""
    gen = torch.Generator().manual_seed(0)
    right = torch.rand(4096, generator=gen) < p
    batches = []
    for i in range(0, 4096, 16):
        tokens = torch.ones(16, 5, dtype=torch.long)
        targets = tokens.clone()
        targets[~right[i : i + 16], -1] = 2
        batches.append(SimpleNamespace(tokens=tokens, targets=targets))
    return batches, torch.cumsum(right.long(), 0)


@pytest.mark.parametrize("p", [0.0, 1.0, 0.5, 0.9])
def test_evaluate_draws_blocks_until_the_rule_says_enough(p, monkeypatch):
    batches, solved = _stream(p)
    monkeypatch.setattr(seq.evaluation, "test_sets", lambda t, size, cfg: iter(batches))
    task = SimpleNamespace(length=lambda size: 5, vocab_size=3, answer_tokens=lambda: (1, 2))
    cfg = _cfg(eval_sets=512, eval_se=0.04, eval_min=32, eval_batch=16)
    got = seq.evaluate(_Oracle(), task, 64, cfg)
    # independently: the first multiple of 16 at or above 32 where the float64 Agresti-Coull
    # error of the stream's prefix is at most 0.04, else the cap
    n = next(
        (
            n
            for n in range(32, 513, 16)
            if math.sqrt((x := (solved[n - 1] + 2.0) / (n + 4)) * (1 - x) / (n + 4)) <= 0.04
        ),
        512,
    )
    assert got["sets"] == n and got["acc"] == pytest.approx(float(solved[n - 1]) / n, abs=0)
    if p in (0.0, 1.0):
        assert n == 32
    fixed = seq.evaluate(_Oracle(), task, 64, _cfg(eval_sets=96, eval_batch=16))
    assert fixed["sets"] == 96  # without adaptive sampling: every one of eval_sets


def test_the_stopping_rule_skips_sizes_after_consecutive_zeros_beyond_training(
    tmp_path, monkeypatch
):
    """flip_flop trains at 16-48: zeros inside that range do not count, a non-zero size resets
    the count, and after two zeros beyond it the larger sizes are not evaluated (acc 0, marked
    skipped, no token accuracy), even one the model would have solved."""
    acc = {16: 0.0, 32: 0.0, 64: 0.0, 128: 0.5, 256: 0.0, 512: 0.0, 1024: 0.9, 2048: 1.0}
    seen = []

    def fake(model, t, size, cfg):
        seen.append(size)
        return {"acc": acc[size], "token_acc": 0.5, "sets": 32, "length": int(t.length(size))}

    monkeypatch.setattr(seq.training, "evaluate", fake)
    cfg = _cfg(
        steps=2, eval_sets=64, eval_se=0.04, stop_zeros=2, eval_sizes={"flip_flop": list(acc)}
    )
    rows = seq.run_job(seq.jobs(tmp_path, cfg)[0])
    assert seen == [16, 32, 64, 128, 256, 512]
    by = {r["size"]: r for r in rows}
    assert [s for s in acc if by[s]["skipped"]] == [1024, 2048]
    assert by[1024]["acc"] == 0 and by[1024]["sets"] == 0 and math.isnan(by[1024]["token_acc"])
    assert seq.stopping(rows) == {
        "runs": 1,
        "stopped": 1,
        "cells": 6,
        "skipped": 2,
        "sequences": 6 * 32,
    }
    # the token-accuracy means leave the skipped sizes out; accuracy counts them as 0
    m = seq.measures(rows)[("flip_flop", "softmax")][cfg.seed]
    assert m["ood_token"] == pytest.approx(0.5) and m["ood"] == pytest.approx(0.5 / 6)
    seen.clear()
    off = seq.run_job(
        seq.jobs(tmp_path / "off", _cfg(steps=2, eval_sizes={"flip_flop": list(acc)}))[0]
    )
    assert seen == list(acc) and not any(r["skipped"] for r in off)


def test_a_zero_on_too_few_sequences_does_not_count(tmp_path, monkeypatch):
    def fake(model, t, size, cfg):
        return {"acc": 0.0, "token_acc": 0.0, "sets": 16, "length": 1}

    monkeypatch.setattr(seq.training, "evaluate", fake)
    cfg = _cfg(steps=2, eval_min=32, stop_zeros=2, eval_sizes={"flip_flop": [64, 128, 256, 512]})
    rows = seq.run_job(seq.jobs(tmp_path, cfg)[0])
    assert not any(r["skipped"] for r in rows)


def test_holm_against_an_independent_step_down():
    p = np.array([0.01, 0.04, np.nan, 0.03, 0.005, 0.5])
    finite = [0.005, 0.01, 0.03, 0.04, 0.5]  # sorted; m = 5
    steps = [min(1.0, (5 - i) * v) for i, v in enumerate(finite)]  # 0.025, 0.04, 0.09, 0.08, 0.5
    monotone = list(np.maximum.accumulate(steps))  # 0.025, 0.04, 0.09, 0.09, 0.5
    want = {
        0.005: monotone[0],
        0.01: monotone[1],
        0.03: monotone[2],
        0.04: monotone[3],
        0.5: monotone[4],
    }
    got = holm(p)
    assert np.isnan(got[2])
    for i in (0, 1, 3, 4, 5):
        assert got[i] == pytest.approx(want[p[i]], rel=1e-12)
    assert holm([]).shape == (0,) and np.isnan(holm([np.nan])).all()


def test_standard_profile_runs_every_task_and_method_with_the_budget_rules():
    cfg = leaderboard.make_config("standard")
    assert set(cfg.tasks) == set(
        leaderboard.catalogue(cfg)["tasks"][i]["task"] for i in range(len(cfg.tasks))
    )
    assert len(cfg.tasks) == 8 and set(cfg.methods) == set(seq.methods()) and cfg.seeds == 3
    assert cfg.eval_se > 0 and cfg.stop_zeros == 2 and cfg.eval_factor >= 16
    for t in cfg.tasks:
        assert max(seq.sizes_of(cfg, t)) >= 16 * seq.task(t).train_sizes[1]


def test_the_paper_profile_is_the_standard_training_with_more_seeds_evaluated_to_256x():
    std, paper = leaderboard.make_config("standard"), leaderboard.make_config("paper")
    assert paper.seeds > std.seeds and paper.eval_factor == 256
    assert (paper.lr, paper.task_steps, paper.steps) == (std.lr, std.task_steps, std.steps)
    assert paper.eval_se > 0 and paper.stop_zeros == 2  # the same sampling and stopping rules
    for t in paper.tasks:  # beyond the tasks' own default sizes (up to 64x): powers of two
        sizes = seq.sizes_of(paper, t)
        hi = seq.task(t).train_sizes[1]
        assert max(sizes) >= 256 * hi and max(sizes) < 512 * hi
        assert all(b == 2 * a for a, b in zip(sizes[-6:], sizes[-5:], strict=False))
        assert seq.sizes_of(std, t) == [s for s in sizes if s <= max(seq.sizes_of(std, t))]


def test_sizes_given_as_a_task_option_are_kept_whatever_the_factor(monkeypatch):
    cfg = leaderboard.make_config("paper", tasks=("flip_flop",))
    own = type(seq.task("flip_flop"))(eval_sizes=(64, 100))
    monkeypatch.setattr(seq.config, "task", lambda name: own)
    assert seq.sizes_of(cfg, "flip_flop") == [16, 32, 64, 100]


def test_the_report_says_how_sequences_were_sampled_and_how_often_the_rule_fired(
    tmp_path, monkeypatch
):
    def fake(model, t, size, cfg):
        return {"acc": 0.0 if size > 48 else 1.0, "token_acc": 0.5, "sets": 32, "length": 1}

    monkeypatch.setattr(seq.training, "evaluate", fake)
    cfg = leaderboard.make_config(
        "standard",
        tasks=("flip_flop",),
        methods=("softmax", "sink"),
        seeds=2,
        steps=2,
        task_steps={},
        workers=1,
    )
    assert seq.steps_of(cfg, "flip_flop") == 2  # not the profile's steps for the task
    result = leaderboard.run(tmp_path, cfg)
    report = (tmp_path / "report.md").read_text()
    assert "Agresti-Coull" in report and "It fired in 4 of 4 runs" in report
    assert (tmp_path / "heatmap.png").stat().st_size > 1000
    assert "p (Holm)" in (tmp_path / "leaderboard.md").read_text()
    assert all("holm" in e for e in result["table"])


def test_models_from_evaluates_another_runs_models_without_training(tmp_path, capsys):
    from sharpattn.cli import main

    tiny = [
        "--quick",
        "--methods",
        "softmax",
        "--seeds",
        "1",
        "--steps",
        "5",
        "--eval-sets",
        "4",
        "--workers",
        "1",
    ]
    first, far = tmp_path / "first", tmp_path / "far"
    assert main(["leaderboard", *tiny, "--eval-factor", "1", "--out", str(first)]) == 0
    weights = next(first.glob("train/*/*/seed0/model.safetensors"))
    stamp = weights.stat().st_mtime_ns
    files = sorted(first.rglob("*"))
    args = ["leaderboard", *tiny, "--eval-factor", "4", "--models-from", str(first)]
    assert main([*args, "--out", str(far)]) == 0
    assert (far / "report.md").is_file()
    assert weights.stat().st_mtime_ns == stamp  # loaded, not trained again
    mine = far / weights.parent.relative_to(first)  # evaluations and rows are this run's
    assert not runner.has_training_files(mine) and list(mine.glob("rows-*.json"))
    sizes = {int(p.name[1:].split(".")[0]) for p in mine.glob("eval/*/n*.json")}
    assert max(sizes) >= 4 * 48  # the larger sizes were evaluated on first's models
    assert sorted(first.rglob("*")) == files  # nothing written there
    capsys.readouterr()
    bad = ["leaderboard", *[a if a != "5" else "6" for a in tiny]]  # --steps 6
    assert main([*bad, "--models-from", str(first), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "trained its models with other settings" in err and "steps 5 there, 6 here" in err
    assert len(err.strip().splitlines()) == 1


def test_steps_given_replace_the_profiles_steps_per_task():
    std = leaderboard.make_config("standard", tasks=("flip_flop",))
    assert seq.steps_of(std, "flip_flop") == std.task_steps["flip_flop"] != std.steps
    given = leaderboard.make_config("standard", tasks=("flip_flop", "copy"), steps=4000)
    assert [seq.steps_of(given, t) for t in given.tasks] == [4000, 4000]
    both = leaderboard.make_config("standard", steps=40, task_steps={"copy": 7})
    assert (seq.steps_of(both, "copy"), seq.steps_of(both, "sort")) == (7, 40)


def test_task_steps_train_a_task_for_its_own_number_of_steps(tmp_path):
    cfg = _cfg(steps=7, task_steps={"flip_flop": 3}, eval_sets=4, eval_factor=1)
    assert seq.steps_of(cfg, "flip_flop") == 3 and seq.steps_of(cfg, "copy") == 7
    job = seq.jobs(tmp_path, cfg)[0]
    seq.run_job(job)
    from sharpattn.lab.runner import MetricsLog

    assert max(r["step"] for r in MetricsLog(job.folder / "metrics.jsonl").read()) == 3
    with pytest.raises(ValueError, match="task_steps"):
        _cfg(task_steps={"copy": 0})
    # longer tasks first, so a pool's last jobs are short
    two = seq.SequenceConfig(
        tasks=("flip_flop", "copy"), methods=("softmax",), seeds=1, steps=5, task_steps={"copy": 50}
    )
    assert [j.task for j in seq.jobs(tmp_path, two)] == ["copy", "flip_flop"]
