"""A planned leaderboard run end to end, on tiny decoders: the jobs of unequal arms, logn at
inference on softmax's models, the plateau rule in a job, the plan fixed in the run folder, the
record written after every sitting (also one cut by Ctrl-C) and resumed from, Welch's effects
for unequal arms, and the command line's ``--power``, ``--plan-from`` and ``--detect``."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from cli_checks import one_sentence
from sharpattn.cli import main
from sharpattn.experiments import leaderboard
from sharpattn.experiments import sequence as seq
from sharpattn.experiments.sequence import training
from sharpattn.lab import plan as planning
from sharpattn.lab import runner
from sharpattn.lab import sweep as lab_sweep
from sharpattn.lab.stats import PairedEffect, WelchEffect

pytestmark = pytest.mark.usefixtures("one_thread")

SOFTMAX_RECIPE = ("softmax", "adaptive (inference)", "logn (inference)")

# --- the sequence engine --------------------------------------------------------------------------


def _tiny(profile: str = "quick", **overrides) -> seq.SequenceConfig:
    """A tiny leaderboard configuration on two_back: one layer of width 16, sizes to 2x."""
    values = {
        "tasks": ("two_back",),
        "methods": ("softmax",),
        "seeds": 1,
        "steps": 30,
        "eval_factor": 2,
        "eval_sets": 16,
        "d_model": 16,
        "heads": 2,
        "layers": 1,
        "workers": 1,
        **overrides,
    }
    return leaderboard.make_config(profile, **values)


def test_a_recipe_runs_the_most_seeds_any_of_its_methods_has(tmp_path):
    cfg = _tiny(methods=(*SOFTMAX_RECIPE, "sigmoid"), seeds=2, arm_seeds={"softmax": 4})
    assert [seq.seeds_of(cfg, m) for m in (*SOFTMAX_RECIPE, "sigmoid")] == [4, 2, 2, 2]
    jobs = seq.jobs(tmp_path, cfg)
    by = {}
    for j in jobs:
        by.setdefault(tuple(m.name for m in j.methods), []).append(j.seed)
    assert by == {SOFTMAX_RECIPE: [0, 1, 2, 3], ("sigmoid",): [0, 1]}
    # a method on softmax's models with more seeds gives softmax's models that many
    more = _tiny(methods=(*SOFTMAX_RECIPE, "sigmoid"), seeds=2, arm_seeds={"logn (inference)": 3})
    assert sum(j.methods[0].name == "softmax" for j in seq.jobs(tmp_path, more)) == 3
    # the power profile's arms; seeds given without arm_seeds give every method that many
    assert leaderboard.make_config("power").arm_seeds == {"softmax": 17}
    assert leaderboard.make_config("power", seeds=3).arm_seeds is None
    kept = leaderboard.make_config("power", seeds=3, arm_seeds={"softmax": 5})
    assert kept.arm_seeds == {"softmax": 5} and seq.seeds_of(kept, "sigmoid") == 3
    with pytest.raises(ValueError, match=r"arm_seeds\['softmax'\] must be an integer >= 1"):
        _tiny(arm_seeds={"softmax": 0})


def test_logn_at_inference_is_softmax_up_to_the_training_length(tmp_path):
    """logn's scale is 1 up to the training length: on a softmax-trained decoder, logn
    (inference) has softmax's rows at the training sizes, and its own beyond them."""
    cfg = _tiny(methods=("softmax", "logn (inference)"), steps=40)
    (job,) = seq.jobs(tmp_path, cfg)
    t = seq.task("two_back")
    logn = seq.methods()["logn (inference)"]
    assert logn.recipe == seq.methods()["softmax"].recipe and logn.evaluate == "logn"
    assert seq.evaluation_params(logn, t) == {"train_length": seq.train_length(t)}
    rows = seq.run_job(job)
    hi = t.train_sizes[1]
    keys = ("size", "acc", "token_acc", "sets", "train_seconds", "train_steps")
    soft = [{k: r[k] for k in keys} for r in rows if r["method"] == "softmax"]
    scaled = [{k: r[k] for k in keys} for r in rows if r["method"] == "logn (inference)"]
    inside = [r for r in soft if r["size"] <= hi]
    assert len(inside) == 2 and inside == [r for r in scaled if r["size"] <= hi]
    assert 0 < inside[0]["token_acc"] < 1  # a partly trained model: the equality says something
    assert (job.folder / "eval" / "logn").is_dir()
    # the decoder itself: logn's logits are softmax's at the training length, not beyond it
    model = seq.build_model(cfg, seq.methods()["softmax"], t, 0)
    model.eval()
    length = seq.train_length(t)
    tokens = torch.randint(
        0, t.vocab_size, (2, 4 * length), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        plain = model(tokens)
        training.switch(model, "logn", **seq.evaluation_params(logn, t))
        scaled_logits = model(tokens)
    torch.testing.assert_close(scaled_logits[:, :length], plain[:, :length], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(scaled_logits[:, length:], plain[:, length:])


def test_a_job_stops_where_its_checks_have_plateaued(tmp_path, monkeypatch):
    """Checks that never reach ``converge`` and never improve: the job trains its schedule's
    steps and stops at the first check after them (not before), its checks kept in checks.json;
    without the plateau rule it trains every step it may."""
    monkeypatch.setattr(
        training, "check_accuracy", lambda m, t, sizes, c, s: dict.fromkeys(sizes, 0.5)
    )
    cfg = _tiny(steps=20, converge=1.0, check_every=5, plateau=2, extend=2.0)
    (job,) = seq.jobs(tmp_path / "a", cfg)
    rows = seq.run_job(job)
    assert {r["train_steps"] for r in rows} == {20}
    checks = runner.read_json(job.folder / training.CHECKS, list)
    assert checks == [{"step": s, "acc": 0.5} for s in (5, 10, 15, 20)]
    off = _tiny(steps=20, converge=1.0, check_every=5, plateau=0, extend=2.0)
    (job,) = seq.jobs(tmp_path / "b", off)
    assert {r["train_steps"] for r in seq.run_job(job)} == {40}


# --- a planned leaderboard run --------------------------------------------------------------------

METHODS = ("softmax", "sigmoid", "logn (inference)")


def _planned(tmp: Path, **overrides) -> seq.SequenceConfig:
    """The power profile on tiny decoders: softmax 3 seeds, sigmoid 2, recorded in tmp."""
    values = {
        "methods": METHODS,
        "seeds": 2,
        "arm_seeds": {"softmax": 3},
        "steps": 20,
        "check_every": 10,
        "check_sets": 8,
        "record": str(tmp / "r.tar.gz"),
        **overrides,
    }
    return _tiny("power", **values)


def _rows(rows) -> list[str]:
    """Rows in a comparable order."""
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def _packed(record: Path) -> set[str]:
    with tarfile.open(record, "r:gz") as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


def test_a_planned_run_fixes_its_plan_records_it_and_resumes_from_the_record(tmp_path, monkeypatch):
    cfg = _planned(tmp_path)
    assert cfg.planned and cfg.converge > 0 and cfg.plateau > 0
    out = tmp_path / "a"
    first = leaderboard.run(out, cfg)
    plan = planning.read_plan(out)
    assert plan == json.loads(json.dumps(leaderboard.plan_of(cfg)))
    assert plan["tasks"] == ["two_back"] and plan["reference"] == "softmax"
    # the seeds each method has in the rows: logn (inference) on softmax's three models
    assert plan["seeds"] == {"softmax": 3, "sigmoid": 2, "logn (inference)": 3}
    for m, n in plan["seeds"].items():
        assert {r["seed"] for r in first["rows"] if r["method"] == m} == set(range(n))
    record = Path(cfg.record)
    names = _packed(record)
    assert {"a/plan.json", "a/config.json", "a/sittings.json"} <= names
    assert any(n.endswith("/checks.json") for n in names)
    assert sum("/rows-" in n for n in names) == 5  # softmax's three jobs and sigmoid's two
    assert not any(n.endswith((".safetensors", "metrics.jsonl", ".png")) for n in names)
    report = (out / "report.md").read_text()
    assert "## The plan" in report and "## Runs not converged in distribution" in report
    assert leaderboard.WELCH_TEXT in report
    # the effects: Welch's for the trained method, paired for the one on softmax's models
    by = {e["method"]: e for e in first["table"]}
    sig, logn = by["sigmoid"]["effect"], by["logn (inference)"]["effect"]
    assert isinstance(sig, WelchEffect) and (sig.n, sig.n_ref) == (2, 3)
    assert isinstance(logn, PairedEffect) and logn.n == 3
    assert isinstance(by["sigmoid"]["tasks"]["two_back"]["effect"], WelchEffect)
    plain = {e["method"]: e for e in leaderboard.rank(first["rows"], ["two_back"])}
    assert isinstance(plain["sigmoid"]["effect"], PairedEffect)  # arms unset: paired as before
    assert plain["sigmoid"]["effect"].n == 2
    shown, _ = leaderboard.effects(first["table"], ["two_back"])
    assert ["overall", "sigmoid", "2 vs 3"] in [r[:3] for r in shown]

    # the next sitting, on another machine: the folder is gone, the record is all there is
    shutil.rmtree(out)
    monkeypatch.setattr(training, "build_model", lambda *a: pytest.fail("a finished job trained"))
    again = leaderboard.run(out, cfg)
    assert _rows(again["rows"]) == _rows(first["rows"])
    assert not list(out.rglob("*.safetensors"))
    assert len(json.loads((out / "sittings.json").read_text())) == 2
    assert planning.read_plan(out) == plan

    # another plan with the same record, or in the same folder: refused before any work
    other = _planned(tmp_path, seeds=3)
    with pytest.raises(ValueError, match=r"planned otherwise \(seeds differ\)") as err:
        leaderboard.run(tmp_path / "c", other)
    assert "another --record" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "c" / "train").exists()
    with pytest.raises(ValueError, match=r"planned otherwise \(seeds differ\).*another --out"):
        leaderboard.run(out, _planned(tmp_path, seeds=3, record=str(tmp_path / "new.tar.gz")))
    assert not (tmp_path / "new.tar.gz").exists()


def test_a_sitting_cut_by_ctrl_c_still_writes_its_record(tmp_path, monkeypatch):
    """KeyboardInterrupt after the first job of the sweep: the record holds that job's rows and
    the sitting, and the interrupt goes on up; the next sitting does not train that job again."""
    cfg = _planned(tmp_path)
    done = []

    def cut(fn, todo, **kwargs):
        done.append(todo[0])
        fn(todo[0], None)
        raise KeyboardInterrupt

    monkeypatch.setattr(lab_sweep, "run_jobs", cut)
    with pytest.raises(KeyboardInterrupt):
        leaderboard.run(tmp_path / "a", cfg)
    names = _packed(Path(cfg.record))
    (job,) = done
    rows = seq.rows_file(job, cfg).relative_to(tmp_path)
    assert {"a/plan.json", str(rows)} <= names and sum("/rows-" in n for n in names) == 1
    sittings = json.loads((tmp_path / "a" / "sittings.json").read_text())
    assert len(sittings) == 1 and sittings[0]["cpu"] >= 0 and sittings[0]["wall"] >= 0
    monkeypatch.undo()
    built = []
    real = training.build_model
    monkeypatch.setattr(training, "build_model", lambda *a: built.append(a[-1]) or real(*a))
    result = leaderboard.run(tmp_path / "b", cfg)  # a fresh folder, from the record
    assert len(built) == len(seq.jobs("", cfg)) - 1
    assert {(r["method"], r["seed"]) for r in result["rows"]} >= {
        (m.name, job.seed) for m in job.methods
    }


# --- the command line -----------------------------------------------------------------------------

#: a pilot's overall score per method and seed (on two_back, the same at every size)
PILOT = {
    "softmax": [0.90, 0.95, 0.85, 0.92],
    "sigmoid": [0.60, 0.70, 0.65, 0.55],
    "relu": [0.80, 0.82, 0.78, 0.85],
    "logn (inference)": [0.91, 0.94, 0.86, 0.92],
}


@pytest.fixture
def pilot(tmp_path) -> Path:
    """A pilot's record, written by hand as a run would write it: its config.json and each
    job's rows (accuracy the pilot's score at every size, 60 s of training a seed), packed."""
    cfg = _tiny(methods=tuple(PILOT), seeds=4)
    folder = tmp_path / "pilot"
    runner.RunFolder(folder, "leaderboard", cfg.to_dict(), identity=seq.IDENTITY)
    for job in seq.jobs(folder, cfg):
        rows = [
            {
                "task": job.task,
                "method": m.name,
                "seed": job.seed,
                "size": size,
                "acc": PILOT[m.name][job.seed],
                "token_acc": PILOT[m.name][job.seed],
                "sets": 16,
                "length": 2 * size,
                "skipped": False,
                "train_seconds": 60.0,
                "train_steps": 30,
            }
            for m in job.methods
            for size in seq.sizes_of(cfg, job.task)
        ]
        runner.write_json(seq.rows_file(job, cfg), seq.rows_record(job, cfg, rows))
    return planning.pack(folder, tmp_path / "pilot.tar.gz")


PLANNED = ["--tasks", "two_back", "--methods", ",".join(PILOT)]


def test_plan_from_a_pilot_prints_the_plan_and_trains_nothing(pilot, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["leaderboard", "--power", "--plan-from", str(pilot), *PLANNED, "--out", str(out)]
    assert main([*argv, "--detect", "0.5"]) == 0
    printed = capsys.readouterr()
    text = " ".join(printed.out.split())
    assert "Pilot: " in text and "3 methods against softmax" in text
    assert "Cheapest allocation that detects 0.5" in text
    assert printed.err == "" and not out.exists()
    assert main([*argv, "--detect", "0.0001"]) == 0
    assert "No allocation up to 60 seeds an arm detects 0.0001." in " ".join(
        capsys.readouterr().out.split()
    )
    # the pilot's folder reads as its record does
    shutil.unpack_archive(pilot, tmp_path / "unpacked")
    folder = ["--plan-from", str(tmp_path / "unpacked" / "pilot")]
    assert main(["leaderboard", "--power", *folder, *PLANNED, "--out", str(out)]) == 0
    assert "Cheapest allocation that detects 0.05" in " ".join(capsys.readouterr().out.split())
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--power", "--detect", "0.1"], "--detect sets what --plan-from plans for"),
        (["--plan-from", "/nonexistent/pilot"], "is neither a leaderboard run folder nor"),
        (["--power", "--standard"], "--standard and --power exclude each other"),
        (["--quick", "--power"], "--quick and --power exclude each other"),
        (["--power", "--paper"], "--power and --paper exclude each other"),
        (["--standard", "--record", "r.tar.gz"], "--record applies to a planned run (--power)"),
        (["--record", "r.tar.gz"], "the quick profile's run is not packed"),
    ],
)
def test_plan_options_and_profiles_are_refused_in_one_sentence(argv, needle, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["leaderboard", *argv, "--out", str(out)]) == 2
    one_sentence(capsys, needle)
    assert not out.exists()


def test_a_pilot_without_the_boards_tasks_is_refused_in_one_sentence(pilot, capsys):
    """The power board's six tasks from a pilot of two_back: no spread to plan them from."""
    assert main(["leaderboard", "--power", "--plan-from", str(pilot)]) == 2
    one_sentence(capsys, "has no finished runs of flip_flop, passkey", "--tasks (two_back)")


def test_a_damaged_pilot_record_is_refused_in_one_sentence(tmp_path, capsys):
    bad = tmp_path / "pilot.tar.gz"
    bad.write_bytes(b"not a record")
    assert main(["leaderboard", "--power", "--plan-from", str(bad)]) == 2
    one_sentence(capsys, "is not a readable record")


def test_the_help_lists_every_profile(capsys):
    assert main(["leaderboard", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--quick", "--standard", "--power", "--paper", "--plan-from", "--detect"):
        assert flag in text, flag
    assert "--record" in text
