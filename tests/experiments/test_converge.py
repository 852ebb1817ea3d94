"""Training until converged: the Trainer's ``until`` (it ends a run as its steps would, and a
resumed run ends where an uninterrupted one does), the sequence engine's ``converge`` (checked
on its own sequences at the in-distribution sizes, recorded in the rows as ``train_steps``), and
run folders and rows from before it, which read as they did."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sharpattn.experiments import leaderboard
from sharpattn.experiments import sequence as seq
from sharpattn.experiments.sequence import evaluation, training
from sharpattn.lab import runner
from sharpattn.lab.runner import MetricsLog, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# --- the Trainer ----------------------------------------------------------------------------------


def _toy(folder: Path, steps: int = 100, until=None, progress=None) -> Trainer:
    """A tiny regression model, its batches from a checkpointed generator, checked every 10
    steps and checkpointed every 10; its loss refuses a model left in eval mode."""
    with runner.seeded(0):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = runner.generator(0, 1)

    def batch(step):
        x = torch.randn(16, 4, generator=data)
        return x, x.sum(-1, keepdim=True).sin()

    def loss(m, b):
        assert m.training, "the check left the model in eval mode"
        return F.mse_loss(m(b[0]), b[1])

    return Trainer(
        folder,
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        steps=steps,
        batch=batch,
        loss=loss,
        generators={"data": data},
        checkpoint_every=10,
        log_every=25,
        progress=progress,
        until=None if until is None else (lambda step: until(model, step)),
        check_every=10,
    )


def _state(path: Path) -> dict:
    """The state stored with the final weights at ``path``."""
    from safetensors import safe_open

    return json.loads(safe_open(str(path), "pt").metadata()["sharpattn.state"])["state"]


def _norm(model) -> float:
    return float(sum(p.detach().norm() for p in model.parameters()))


def test_until_ends_training_as_its_steps_would(tmp_path):
    asked, events = [], []

    def until(model, step):
        asked.append(step)
        model.eval()  # the Trainer puts it back in train mode
        torch.rand(3)  # the global random state is forked around the check
        return step == 20

    t = _toy(tmp_path, until=until, progress=events.append)
    drawn = torch.get_rng_state()
    done = t.run()
    assert torch.equal(torch.get_rng_state(), drawn)  # the check's draw left no trace
    assert asked == [10, 20]
    assert done["step"] == 20 and done["stopped_early"] is True
    assert t.final.is_file() and not t.checkpoint.exists()
    assert _state(t.final) == done
    steps = [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").read()]
    assert steps == [0, 10, 20]  # the checked steps are logged; the log ends where training did
    assert (events[-1]["step"], events[-1]["total"]) == (20, 20)  # the bar ends
    again = _toy(tmp_path, until=lambda m, s: pytest.fail("a finished run is not checked"))
    assert again.run() == done  # finished: loaded, whatever its step
    for p, q in zip(t.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_until_never_true_trains_every_step(tmp_path):
    asked = []
    t = _toy(tmp_path, steps=40, until=lambda m, s: asked.append(s) or False)
    done = t.run()
    assert asked == [10, 20, 30] and done["step"] == 40 and "stopped_early" not in done
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").read()] == [
        0,
        10,
        20,
        25,
        30,
        40,
    ]


def test_a_resumed_run_stops_where_an_uninterrupted_one_does(tmp_path):
    """The check depends on the weights: the run stops at the first check whose weight norm is
    the one an uninterrupted run has at step 30. Killed after the checkpoint at step 20 and
    resumed (the check at 20 asked again), it stops there with the same weights and log."""
    probe = {}
    _toy(tmp_path / "probe", until=lambda m, s: probe.setdefault(s, _norm(m)) and False).run()
    target = probe[30]
    assert sum(v == target for v in probe.values()) == 1

    full = _toy(tmp_path / "a", until=lambda m, s: _norm(m) == target)
    assert full.run()["step"] == 30

    _toy(tmp_path / "b", until=lambda m, s: _norm(m) == target).run(stop_at=25)
    assert (tmp_path / "b" / "checkpoint.safetensors").is_file()
    asked = []
    resumed = _toy(tmp_path / "b", until=lambda m, s: asked.append(s) or _norm(m) == target)
    state = resumed.run()
    assert asked == [20, 30] and state["step"] == 30 and state["stopped_early"] is True
    for p, q in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    a = MetricsLog(tmp_path / "a" / "metrics.jsonl").read()
    assert a == MetricsLog(tmp_path / "b" / "metrics.jsonl").read()
    assert a[-1]["step"] == 30


def test_a_check_cut_by_ctrl_c_is_asked_again_on_resume(tmp_path):
    """Ctrl-C inside the check at step 20 checkpoints step 20; the resumed run asks that check
    again and, where it says stop, ends there at once (its log already holds step 20)."""

    def cut(model, step):
        if step == 20:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        _toy(tmp_path, until=cut).run()
    resumed = _toy(tmp_path, until=lambda m, s: s == 20)
    state = resumed.run()
    assert state["step"] == 20 and state["stopped_early"] is True
    assert not resumed.checkpoint.exists()
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").read()] == [0, 10, 20]


def test_trainer_refuses_a_check_every_below_one(tmp_path):
    with pytest.raises(ValueError, match="check_every >= 1"):
        Trainer(
            tmp_path, torch.nn.Linear(1, 1), None, steps=1, batch=None, loss=None, check_every=0
        )


# --- the sequence engine --------------------------------------------------------------------------


def _cfg(**overrides) -> seq.SequenceConfig:
    """A tiny leaderboard configuration: one softmax decoder on flip_flop, one seed."""
    values = {
        "methods": ("softmax",),
        "seeds": 1,
        "steps": 40,
        "eval_factor": 1,
        "eval_sets": 4,
        "d_model": 16,
        "heads": 2,
        "layers": 1,
        "workers": 1,
        **overrides,
    }
    return leaderboard.make_config("quick", **values)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("converge", 1.5, "converge must be 0 (off) or in (0, 1]"),
        ("converge", -0.1, "converge must be 0 (off) or in (0, 1]"),
        ("converge", math.nan, "converge must be 0 (off) or in (0, 1]"),
        ("check_every", 0, "check_every must be >= 1"),
        ("check_sets", 0, "check_sets must be >= 1"),
    ],
)
def test_bad_converge_settings_are_refused_in_one_sentence(field, value, words):
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        seq.SequenceConfig(tasks=("flip_flop",), methods=("softmax",), **{field: value})
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_converge_checks_the_in_distribution_sizes_and_rows_say_how_long_it_trained(
    tmp_path, monkeypatch
):
    """The check (exact match 1.0 from the second one on, here) stops training at step
    2 x check_every; it is asked at the evaluation sizes inside the training range, with the
    job's seed, and every row records the steps trained."""
    cfg = _cfg(converge=1.0, check_every=5)
    (job,) = seq.jobs(tmp_path, cfg)
    inside = seq.in_distribution(cfg, job.task)
    lo, hi = seq.task(job.task).train_sizes
    assert inside == [s for s in seq.sizes_of(cfg, job.task) if lo <= s <= hi] == [16, 32]
    asked = []

    def check(model, t, sizes, c, seed):
        asked.append((t.name, list(sizes), seed))
        return dict.fromkeys(sizes, 1.0 if len(asked) >= 2 else 0.5)

    monkeypatch.setattr(training, "check_accuracy", check)
    rows = seq.run_job(job)
    assert asked == [(job.task, inside, job.seed)] * 2
    assert {r["train_steps"] for r in rows} == {2 * cfg.check_every}
    assert _state(job.folder / "model.safetensors")["stopped_early"] is True
    assert seq.read_rows(seq.rows_file(job, cfg), job, cfg) == rows
    # without converge, every task trains its steps, and the rows say so
    fixed = _cfg(steps=6)
    assert {r["train_steps"] for r in seq.run_job(seq.jobs(tmp_path / "fixed", fixed)[0])} == {6}


def test_a_run_that_never_converges_trains_its_steps(tmp_path):
    """The real check, asked at step 5 of 10 of an untrained decoder, finds it unsolved: the job
    trains its steps, and its weights say it was not stopped."""
    cfg = _cfg(steps=10, converge=1.0, check_every=5)
    (job,) = seq.jobs(tmp_path, cfg)
    assert {r["train_steps"] for r in seq.run_job(job)} == {10}
    assert "stopped_early" not in _state(job.folder / "model.safetensors")
    steps = [r["step"] for r in MetricsLog(job.folder / "metrics.jsonl").read()]
    assert 5 in steps and steps[-1] == 10


def test_check_sequences_are_their_own_stream_and_counted_as_evaluate_counts(monkeypatch):
    cfg = _cfg(eval_sets=16, check_sets=16)
    t = seq.task("flip_flop")
    first = next(seq.check_sequences(t, 16, cfg, 0))
    again = next(seq.check_sequences(t, 16, cfg, 0))
    assert torch.equal(first.tokens, again.tokens)  # the same at every check
    gen = runner.generator(0, seq.STREAM_CHECK, seq.task_key(t.name), 16)
    assert torch.equal(first.tokens, t.batch(16, cfg.eval_batch, gen).tokens)
    assert not torch.equal(first.tokens, next(seq.test_sets(t, 16, cfg)).tokens)
    assert not torch.equal(first.tokens, next(seq.check_sequences(t, 16, cfg, 1)).tokens)
    assert sum(b.tokens.shape[0] for b in seq.check_sequences(t, 32, cfg, 0)) == cfg.check_sets
    model = seq.build_model(cfg, seq.resolve(["softmax"])[0], t, 0)
    monkeypatch.setattr(evaluation, "test_sets", lambda *a: pytest.fail("the test stream"))
    accs = seq.check_accuracy(model, t, [16, 32], cfg, 0)
    assert set(accs) == {16, 32} and all(0 <= a <= 1 for a in accs.values()) and model.training
    monkeypatch.undo()
    # on the test sequences, the check's count is evaluate's
    monkeypatch.setattr(
        evaluation, "check_sequences", lambda t, size, c, seed: seq.test_sets(t, size, c)
    )
    for size in (16, 32):
        want = seq.evaluate(model, t, size, cfg)["acc"]
        assert seq.check_accuracy(model, t, [size], cfg, 0) == {size: want}


def test_a_task_with_no_size_to_check_at_is_refused_before_any_work(tmp_path):
    cfg = _cfg(converge=1.0, eval_sizes={"flip_flop": [64, 128]})
    with pytest.raises(ValueError, match="inside its training range 16-48") as err:
        seq.jobs(tmp_path, cfg)
    assert not any(tmp_path.iterdir())
    assert str(err.value).endswith("or train without converge.")


# --- what was made before converge ----------------------------------------------------------------

#: the training settings of a job's identity before converge
OLD_IDENTITY = (
    "seed",
    "batch",
    "lr",
    "weight_decay",
    "warmup",
    "d_model",
    "heads",
    "layers",
    "positions",
)


def test_without_converge_a_jobs_identity_and_rows_file_are_what_they_were(tmp_path):
    cfg = _cfg()
    (job,) = seq.jobs(tmp_path, cfg)
    c = cfg.to_dict()
    old = {k: c[k] for k in OLD_IDENTITY} | {"steps": seq.steps_of(cfg, job.task)}
    assert seq.job_identity(job, cfg)["training"] == json.loads(json.dumps(old))
    other = seq.SequenceConfig(**{**c, "check_every": 7, "check_sets": 3})
    assert seq.job_identity(job, other) == seq.job_identity(job, cfg)
    assert seq.rows_file(job, other) == seq.rows_file(job, cfg)
    on = seq.SequenceConfig(**{**c, "converge": 0.9})
    training_on = seq.job_identity(job, on)["training"]
    assert {k: training_on[k] for k in seq.CONVERGE_KEYS} == {
        "converge": 0.9,
        "check_every": 250,
        "check_sets": 64,
        "extend": 1.0,
        "plateau": 0,
        "plateau_gain": 0.05,
    }


def test_a_run_folder_from_before_converge_resumes_as_a_fixed_steps_run(tmp_path):
    """A config.json without the converge settings reads as converge off: the same profile
    resumes it, and converge on is refused there in one sentence, before any training."""
    cfg = _cfg(steps=2)
    old = {k: v for k, v in cfg.to_dict().items() if k not in seq.CONVERGE_KEYS}
    tmp_path.joinpath("config.json").write_text(
        json.dumps({"experiment": "leaderboard", **runner.jsonable(old)})
    )
    on = _cfg(steps=2, converge=1.0)
    with pytest.raises(ValueError, match=r"different converge \(0.0 there, 1.0 now\)"):
        seq.sweep(tmp_path, "leaderboard", on)
    assert not (tmp_path / "train").exists()
    _, rows = seq.sweep(tmp_path, "leaderboard", cfg)
    assert {r["train_steps"] for r in rows} == {2}


def test_rows_with_or_without_train_steps_are_read(tmp_path):
    cfg = _cfg(steps=3)
    (job,) = seq.jobs(tmp_path, cfg)
    rows = seq.run_job(job)
    path = seq.rows_file(job, cfg)
    before = [{k: v for k, v in r.items() if k != "train_steps"} for r in rows]
    for kept in (before, rows):  # a bare list, as published records hold
        path.write_text(json.dumps(kept))
        assert seq.read_rows(path, job, cfg) == kept
    for bad in (-1, 2.5, True, None):
        path.write_text(json.dumps([{**r, "train_steps": bad} for r in rows]))
        with pytest.raises(ValueError, match=f"row 0 has train_steps {bad!r}, not a count"):
            seq.read_rows(path, job, cfg)
