"""Hostile inputs to the command line, second round: numbers out of range, options a run would
not use, empty lists, option pairs that exclude each other, a bare group, a training that
diverges and messages that named the wrong culprit. Each is one sentence with exit code 2
(or the group's help), before any work; none trains."""

from __future__ import annotations

import json

import click
import pytest

from cli_checks import one_sentence
from sharpattn.cli import main
from sharpattn.cli_options import ProgressRenderer

# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["leaderboard", "--lr", "inf"], "--lr"),
        (["leaderboard", "--lr", "1e400"], "--lr"),  # Python reads it as inf
        (["leaderboard", "--lr", "1e30"], "0<x<=10"),
        (["leaderboard", "--lr", "nan"], "not a finite number"),
        (["leaderboard", "--lr", "0"], "--lr"),
        (["reproduce", "clrs", "--lr", "11"], "0<x<=10"),
        (["reproduce", "clrs-llm", "--lr", "1e30"], "--lr"),
        (["reproduce", "selective-llm", "--lr", "-1"], "--lr"),
        (["reproduce", "selective-llm", "--position-lr", "inf"], "--position-lr"),
        (["reproduce", "selective-llm", "--lora", "2", "--lora-lr", "1e30"], "--lora-lr"),
        (["reproduce", "selective", "--sigmas", "0.1,1e30"], "0 < x <= 100"),
        (["reproduce", "selective", "--sigmas", "nan"], "--sigmas"),
        (["demo", "--margin", "nan"], "--margin"),
        (["dispersion", "--margin", "inf"], "--margin"),
    ],
)
def test_numbers_out_of_range_are_refused_as_they_are_read(argv, needle, capsys, tmp_path):
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out)]) == 2
    one_sentence(capsys, needle)
    assert not out.exists()


def test_every_number_option_is_finite_and_learning_rates_are_bounded():
    """Every float option refuses NaN and the infinities; every learning rate is at most 10."""
    from sharpattn.cli import cli
    from sharpattn.cli_options import MAX_RATE, Positive

    def commands(group):
        for cmd in group.commands.values():
            yield from commands(cmd) if isinstance(cmd, click.Group) else [cmd]

    numbers = [p for cmd in commands(cli) for p in cmd.params]
    numbers = [p for p in numbers if isinstance(p.type, click.FloatRange)]
    assert len(numbers) >= 6
    assert all(isinstance(p.type, Positive) for p in numbers)
    rates = [p for p in numbers if p.name.endswith("lr")]
    assert len(rates) >= 5 and all(p.type.max == MAX_RATE for p in rates)


def test_a_diverging_training_is_one_sentence(capsys, monkeypatch, tmp_path):
    """A loss that becomes NaN (a learning rate within bounds can still be too large for a
    task): one sentence that says so and what to try, not a traceback."""
    from sharpattn.experiments import dispersion

    def diverges(*args, **kwargs):
        raise FloatingPointError("flip_flop: the loss became nan at step 12.")

    monkeypatch.setattr(dispersion, "run_demo", diverges)
    assert main(["demo", "--out", str(tmp_path / "run")]) == 2
    one_sentence(capsys, "the loss became nan at step 12", "smaller learning rate")


def test_the_library_refuses_an_infinite_learning_rate():
    from sharpattn.experiments.sequence.config import SequenceConfig

    for lr in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="lr must be a finite number > 0"):
            SequenceConfig(tasks=("flip_flop",), methods=("softmax",), lr=lr)


# ---------------------------------------------------------------- the thread line


def test_a_refused_run_prints_its_sentence_without_the_thread_line(capsys, monkeypatch, tmp_path):
    """The torch thread line is said as the work starts: a run refused before any work (here a
    missing text file, found by the run itself) prints its one sentence alone."""
    from sharpattn.lab import runner

    monkeypatch.delenv("SHARPATTN_THREADS")
    monkeypatch.setattr(runner, "free_cores", lambda: (2, 0.1))
    argv = ["reproduce", "selective", "--quick", "--tasks", "lm", "--text", str(tmp_path / "no")]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = one_sentence(capsys, "no text file")
    assert "torch thread" not in err


def test_the_line_said_before_work_comes_with_the_first_event(capsys):
    renderer = ProgressRenderer(plain=True)
    renderer.before_work("sharpattn: 2 torch threads (...).")
    assert capsys.readouterr().err == ""
    with renderer:
        renderer({"task": "t", "phase": "train", "step": 0, "total": 2})
        renderer({"task": "t", "phase": "train", "step": 2, "total": 2})
    assert capsys.readouterr().err.count("2 torch threads") == 1


# ---------------------------------------------------------------- groups and option pairs


def test_bare_reproduce_prints_its_help(capsys):
    assert main(["reproduce"]) == 0
    out = capsys.readouterr()
    assert "Commands:" in out.out and "max-retrieval" in out.out and "selective-llm" in out.out
    assert out.err == ""


@pytest.mark.parametrize("command", [["leaderboard"], ["reproduce", "clrs"]])
def test_workers_with_ray_is_refused_before_connecting(command, capsys, tmp_path):
    out = tmp_path / "run"
    argv = [*command, "--workers", "2", "--ray", "127.0.0.1:1", "--out", str(out)]
    assert main(argv) == 2
    one_sentence(capsys, "--workers and --ray exclude each other")
    assert not out.exists()


# ---------------------------------------------------------------- unused options, empty lists


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["reproduce", "max-retrieval-regularisers", "--regularisers", ""], ["names no reading"]),
        (["reproduce", "max-retrieval-regularisers", "--regularisers", " , "], ["no reading"]),
        (["reproduce", "max-retrieval-regularisers", "--regularisers", "l3"], ["'l3'", "l2"]),
        (
            ["reproduce", "selective", "--tasks", "graph", "--text", "/no/such/file"],
            ["--text applies to the lm task"],
        ),
        (
            ["reproduce", "selective", "--tasks", "graph,denoise", "--lm-variants", ""],
            ["--lm-variants applies to the lm task"],
        ),
        (
            ["reproduce", "selective", "--tasks", "lm", "--lm-steps", "3", "--sigmas", "0.1"],
            ["--sigmas applies to the denoise task"],
        ),
        (
            ["reproduce", "selective-llm", "--terms", "token", "--position-lr", "0.1"],
            ["--position-lr is unused with --terms token"],
        ),
        (
            ["reproduce", "selective-llm", "--terms", "position", "--lr", "0.01"],
            ["--lr is unused with --terms position"],
        ),
    ],
)
def test_empty_lists_and_options_a_run_would_not_use_are_refused(argv, needles, capsys, tmp_path):
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out)]) == 2
    one_sentence(capsys, *needles)
    assert not out.exists()


# ---------------------------------------------------------------- words


def test_a_stored_group_that_is_not_a_number_is_not_reported_as_one(tmp_path):
    """JSON's ``true`` is an int to Python: a damaged config.json's ``"group": true`` is not a
    group size ("ensemble(s) of up to True")."""
    from sharpattn.experiments import max_retrieval as mr

    stored = {"experiment": "max-retrieval", "group": True}
    (tmp_path / "config.json").write_text(json.dumps(stored))
    picked, why = mr.seeds_together(mr.make_config("quick", seeds=3), tmp_path)
    assert type(picked) is int and "resumes" not in why
