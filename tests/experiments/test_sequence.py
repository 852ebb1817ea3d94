"""The sequence-task engine (experiments/sequence/) behind `reproduce clrs` and `leaderboard`:
its measures against independent computations, the method list, training/evaluation of one job,
resume, and both commands end to end on a tiny configuration."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from processes import kill_9_once_written, sharpattn
from sharpattn import normalizers as nz
from sharpattn.cli import main
from sharpattn.experiments import leaderboard
from sharpattn.experiments import sequence as seq
from sharpattn.lab import runner

pytestmark = pytest.mark.usefixtures("one_thread")


def test_area_is_the_trapezoid_on_log2_size_normalised():
    sizes, acc = [4, 8, 32, 256], [1.0, 0.5, 0.25, 0.0]
    x = [math.log2(s) for s in sizes]  # 2, 3, 5, 8: independent trapezoid by hand
    by_hand = sum((x[i + 1] - x[i]) * (acc[i] + acc[i + 1]) / 2 for i in range(3)) / (x[-1] - x[0])
    assert seq.area(sizes, acc) == pytest.approx(by_hand, rel=1e-12)
    assert seq.area(sizes, [1.0] * 4) == pytest.approx(1.0, rel=1e-12)
    assert seq.area(sizes, [0.0] * 4) == 0.0
    assert seq.area([16], [0.75]) == 0.75


def test_test_sampling_weighs_each_sizes_binomial_error_by_its_share_of_the_area():
    """Two sizes (16 and 64: area weights ½ and ½), two seeds: the test sd is the root of the
    mean over seeds of ¼·p̃(1 − p̃)/n at each size, p̃ Agresti–Coull's, written out here; a
    skipped size adds nothing; the ratio is to the score's sd over seeds."""
    rows = [
        dict(task="t", method="m", seed=0, size=16, acc=1.0, sets=16),
        dict(task="t", method="m", seed=0, size=64, acc=0.5, sets=32),
        dict(task="t", method="m", seed=1, size=16, acc=0.75, sets=16),
        dict(task="t", method="m", seed=1, size=64, acc=0.0, sets=0, skipped=True),
    ]
    assert seq.area_weights([16, 64]).tolist() == [0.5, 0.5]
    assert seq.area_weights([16, 32, 64]).tolist() == [0.25, 0.5, 0.25]

    def ac(k, n):
        p = (k + 2) / (n + 4)
        return p * (1 - p) / n

    v0 = 0.25 * ac(16, 16) + 0.25 * ac(16, 32)
    v1 = 0.25 * ac(12, 16)
    got = seq.test_sampling(rows)[("t", "m")]
    assert got["test_sd"] == pytest.approx(math.sqrt((v0 + v1) / 2), rel=1e-12)
    scores = [0.5 * 1.0 + 0.5 * 0.5, 0.5 * 0.75]
    assert got["seed_sd"] == pytest.approx(np.std(scores, ddof=1))
    assert got["ratio"] == pytest.approx(got["test_sd"] / got["seed_sd"])
    text = leaderboard._test_share(rows)
    assert f"a median {got['ratio']:.2f} of" in text and "under half of it in every cell" in text
    close = [dict(r, seed=1, acc=17 / 32 if r["size"] == 64 else 1.0) for r in rows[:2]]
    text = leaderboard._test_share(rows[:2] + close)  # two seeds 0.016 apart
    assert "more than half of it in 1: t/m (" in text


def test_every_trainable_registry_method_is_on_the_leaderboard():
    ms = seq.methods()
    for name in nz.available():
        assert (name in ms) != (name in seq.UNTRAINABLE), name
    assert ms["adaptive (inference)"].recipe == ms["softmax"].recipe  # shares the softmax model
    assert ms["adaptive"].recipe != ms["softmax"].recipe
    assert {"selective_q", "selective_v", "selective_qv"} <= set(ms)
    with pytest.raises(ValueError, match="unknown leaderboard method"):
        seq.resolve(["softmax", "nope"])


def test_shifted_stick_breaking_trains_its_own_model_with_scores_shifted_by_minus_log_i():
    import torch

    from sharpattn.normalizers import stick_breaking

    (m,) = seq.resolve(["stick_breaking_shifted"])
    assert m.train == "stick_breaking" and m.recipe != seq.methods()["stick_breaking"].recipe
    cfg = seq.SequenceConfig(tasks=("flip_flop",), methods=(m.name,), seeds=1, steps=1)
    model = seq.build_model(cfg, m, seq.task("flip_flop"), 0)
    attn = [mod for mod in model.modules() if hasattr(mod, "method_params")]
    assert attn and all(a.method_params["shift_log_position"] == -1.0 for a in attn)
    s = torch.randn(1, 1, 5, 5, dtype=torch.float64)
    i = torch.arange(1, 6, dtype=torch.float64)[:, None]  # query i's 1-based position
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.allclose(
        stick_breaking(s, mask, shift_log_position=-1.0), stick_breaking(s - torch.log(i), mask)
    )


def test_compare_is_scipys_paired_t_test():
    a = {0: {"auc": 0.1}, 1: {"auc": 0.3}, 2: {"auc": 0.2}}
    b = {0: {"auc": 0.4}, 1: {"auc": 0.35}, 2: {"auc": 0.6}}
    mean, sd, p = seq.compare(b, a, "auc")
    vb = [0.4, 0.35, 0.6]
    assert mean == pytest.approx(np.mean(vb), rel=1e-12)
    assert sd == pytest.approx(np.std(vb, ddof=1), rel=1e-12)
    assert p == pytest.approx(stats.ttest_rel(vb, [0.1, 0.3, 0.2]).pvalue, rel=1e-9)
    one = seq.compare({0: {"auc": 0.5}}, {0: {"auc": 0.1}}, "auc")
    assert one[0] == 0.5 and math.isnan(one[1]) and math.isnan(one[2])


# --- one job, and the commands end to end ------------------------------------------------------

TINY = ["--seeds", "2", "--steps", "30", "--eval-factor", "2", "--eval-sets", "8", "--workers", "1"]


def test_adaptive_at_inference_is_the_softmax_model_evaluated_with_adaptive(tmp_path):
    """One training per recipe: `adaptive (inference)` evaluates the softmax job's model with
    adaptive temperature, on the same test sequences (paired), and differs from softmax only
    there; every accuracy is a fraction of the test sequences."""
    cfg = leaderboard.make_config(
        "quick",
        methods=("softmax", "adaptive (inference)"),
        steps=30,
        eval_factor=2,
        eval_sets=8,
        workers=1,
    )
    job = seq.jobs(tmp_path, cfg)[0]
    assert [m.name for m in job.methods] == ["softmax", "adaptive (inference)"]
    rows = seq.run_job(job)
    t = seq.task(job.task)
    model = seq.build_model(cfg, job.methods[0], t, job.seed)
    from sharpattn.lab.runner import read_weights

    read_weights(job.folder / "model.safetensors", model)
    for size in seq.sizes_of(cfg, job.task):
        got = {r["method"]: r for r in rows if r["size"] == size}
        assert got["softmax"]["acc"] == seq.evaluate(model, t, size, cfg)["acc"]
        seq.switch(model, "adaptive")
        assert got["adaptive (inference)"]["acc"] == seq.evaluate(model, t, size, cfg)["acc"]
        seq.switch(model, "softmax")
        for r in got.values():
            assert r["acc"] * r["sets"] == round(r["acc"] * r["sets"]) and 0 <= r["acc"] <= 1
    # the test sequences depend on the task and size only
    a = next(seq.test_sets(t, 32, cfg))
    b = next(seq.test_sets(t, 32, seq.SequenceConfig(**{**cfg.to_dict(), "methods": ("sink",)})))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)


def test_leaderboard_command_writes_ranked_tables_and_plots(tmp_path):
    out = tmp_path / "lb"
    args = ["leaderboard", "--quick", "--methods", "softmax,sink", *TINY, "--out", str(out)]
    assert main(args) == 0
    for name in (
        "leaderboard.md",
        "leaderboard.csv",
        "accuracy.md",
        "leaderboard.png",
        "report.md",
    ):
        assert (out / name).is_file(), name
    lines = (out / "leaderboard.csv").read_text().splitlines()
    assert lines[0].startswith("rank,method,score") and len(lines) == 3
    scores = [float(line.split(",")[2]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert main(args) == 0  # re-running loads every finished job: same table
    assert (out / "leaderboard.csv").read_text().splitlines() == lines


def test_curves_of_many_methods_keep_every_line_apart_and_the_legend_inside(tmp_path, monkeypatch):
    """24 methods on 8 tasks (no spare panel): each method has its own colour, line style and
    marker, and the legend sits in a column of its own inside the saved figure."""
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))  # kept to inspect
    names = [f"m{i}" for i in range(len(seq.methods()))]
    tasks = ["copy", "flip_flop", "local_count", "mqar", "passkey", "reverse", "sort", "two_back"]
    rows = [
        {"task": t, "method": m, "seed": 0, "size": n, "acc": 0.5}
        for t in tasks
        for m in names
        for n in (16, 64)
    ]
    seq.plot_curves(tmp_path / "c.png", rows, tasks, names, "title")
    assert (tmp_path / "c.png").is_file()
    fig = figures[-1]
    lines = fig.axes[0].get_lines()
    styles = [(ln.get_color(), ln.get_linestyle()) for ln in lines]
    assert len(set(styles)) == len(names)  # no two methods drawn alike
    assert len({(ln.get_color(), ln.get_marker()) for ln in lines}) == len(names)  # in grey too
    (legend,) = fig.legends
    box = legend.get_window_extent(fig.canvas.get_renderer())
    frame = fig.bbox
    assert box.x0 >= frame.x0 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0
    assert all(box.x0 >= ax.get_window_extent().x1 for ax in fig.axes)  # beside the panels
    close(fig)


def test_reproduce_clrs_command(tmp_path):
    out = tmp_path / "clrs"
    args = [
        "reproduce",
        "clrs",
        "--quick",
        "--tasks",
        "minimum,insertion_sort",
        *TINY,
        "--out",
        str(out),
    ]
    assert main(args) == 0
    table = (out / "clrs.csv").read_text().splitlines()
    assert len(table) == 1 + 2 * 2  # two algorithms x (softmax, adaptive)
    assert (out / "fig8.png").is_file() and (out / "bars.png").is_file()
    assert "softmax vs adaptive" in (out / "report.md").read_text()
    assert "| insertion_sort | adaptive |" in (out / "report.md").read_text()  # over seeds


def test_clrs_verdicts_are_paired_over_seeds_beyond_the_training_sizes():
    """`clrs.seed_verdicts`: adaptive's exact match beyond the training range against softmax's,
    paired over seeds, recomputed here by scipy from rows written by hand."""
    from scipy import stats as sps

    from sharpattn.experiments import clrs

    hi = (0, 8)  # training range of the made-up task: sizes 4, 8 inside; 16, 32 beyond
    acc = {
        "softmax": [[0.9, 0.2, 0.0], [0.8, 0.1, 0.1], [0.9, 0.3, 0.0]],
        "adaptive": [[0.9, 0.4, 0.2], [0.9, 0.3, 0.1], [0.8, 0.4, 0.2]],
    }
    rows = [
        {"task": "t", "method": m, "seed": s, "size": n, "acc": a[s][i], "token_acc": 0.5}
        for m, a in acc.items()
        for s in range(3)
        for i, n in enumerate((8, 16, 32))
    ]
    [j] = clrs.seed_verdicts(rows, ["t"], ["softmax", "adaptive"], spans={"t": hi})
    ood = {m: np.array(a)[:, 1:].mean(1) for m, a in acc.items()}
    v = j["verdict"]
    assert v.effect.mean == pytest.approx((ood["adaptive"] - ood["softmax"]).mean())
    assert v.effect.p == pytest.approx(sps.ttest_rel(ood["adaptive"], ood["softmax"]).pvalue)
    assert v.verdict == "reproduced" and j["method"] == "adaptive"


def test_list_shows_the_tasks_and_methods_and_runs_nothing(tmp_path, monkeypatch):
    """`--list` (both commands): every task of the command's family with its training sizes and
    the evaluation sizes the options give, the chosen ones starred, and the methods; no run."""
    import io

    from rich.console import Console

    from sharpattn import cli_experiments as cli

    def listed(*args: str) -> list[str]:
        buf = io.StringIO()
        monkeypatch.setattr(cli, "console", Console(file=buf, width=2000, color_system=None))
        assert main([*args, "--list", "--out", str(tmp_path / "x")]) == 0
        return buf.getvalue().splitlines()

    out = listed(
        "leaderboard",
        "--tasks",
        "passkey",
        "--methods",
        "softmax,selective_qv",
        "--eval-factor",
        "8",
    )
    row = next(line for line in out if " passkey " in line)
    assert "* passkey" in row and "16-48" in row and "16, 32, 64, 128, 256, 512 " in row
    assert "* flip_flop" not in "\n".join(out) and " flip_flop " in "\n".join(out)
    methods = next(line for line in out if line.startswith("methods"))
    assert "*softmax" in methods and "*selective_qv" in methods and " selective_q," in methods
    out = listed("reproduce", "clrs", "--quick")
    assert any("* minimum" in line for line in out) and any(" bfs " in line for line in out)
    assert not any("passkey" in line for line in out)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("positions", ["alibi", "nape"])
def test_leaderboard_trains_with_linear_position_biases(tmp_path, positions):
    """--positions reaches every attention layer and the run's config record, and its setup
    sentence names it."""
    out = tmp_path / "lb"
    args = [
        "leaderboard",
        "--quick",
        "--methods",
        "sigmoid",
        "--seeds",
        "1",
        "--steps",
        "5",
        "--eval-factor",
        "2",
        "--eval-sets",
        "4",
        "--workers",
        "1",
        "--positions",
        positions,
        "--out",
        str(out),
    ]
    assert main(args) == 0
    from sharpattn.lab.runner import read_config

    assert read_config(out, "leaderboard")["positions"] == positions
    assert f"positions {positions}" in (out / "report.md").read_text()
    cfg = leaderboard.make_config("quick", positions=positions)
    model = seq.build_model(cfg, seq.methods()["sigmoid"], seq.task("flip_flop"), 0)
    assert {m.alibi for m in model.modules() if hasattr(m, "alibi")} == {positions}
    with pytest.raises(ValueError, match="heads >= 2"):
        leaderboard.make_config("quick", positions="nape", heads=1)


@pytest.mark.parametrize(
    "args, words",
    [
        (["leaderboard", "--quick", "--methods", "softmax,nope"], "unknown leaderboard method"),
        (["leaderboard", "--quick", "--tasks", "nope"], "unknown task"),
        (["reproduce", "clrs", "--quick", "--tasks", "flip_flopp"], "unknown task"),
        (["leaderboard", "--quick", "--positions", "rope"], "is not one of 'rotary'"),
    ],
)
def test_mistakes_are_one_sentence_exit_2(tmp_path, capsys, args, words):
    assert main([*args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert words in err.lower() and "Traceback" not in err
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_leaderboard_resumes_after_kill_9_with_the_same_numbers(tmp_path):
    args = [
        "leaderboard",
        "--quick",
        "--methods",
        "softmax",
        "--seeds",
        "1",
        "--steps",
        "300",
        "--checkpoint-every",
        "40",
        "--eval-factor",
        "2",
        "--eval-sets",
        "8",
        "--workers",
        "1",
    ]
    assert sharpattn(*args, "--out", str(tmp_path / "a")).wait(timeout=300) == 0
    proc = sharpattn(*args, "--out", str(tmp_path / "b"))
    run = "train/flip_flop/softmax/seed0"
    kill_9_once_written(proc, tmp_path / "b" / run / "checkpoint.safetensors")
    assert sharpattn(*args, "--out", str(tmp_path / "b")).wait(timeout=300) == 0  # resumes
    for name in ("leaderboard.csv", "accuracy.md", f"{run}/metrics.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


def test_a_run_stripped_of_its_weights_resumes_from_its_rows(tmp_path, monkeypatch):
    """A finished job keeps its rows: a run folder without the trainer's files (weights,
    checkpoint, training log: a published run's record) gives the same rows again without
    training, and a job whose rows are missing, or whose evaluation budget changed, is run
    (retrained where its weights are gone)."""
    cfg = leaderboard.make_config(
        "quick", methods=("softmax",), seeds=2, steps=30, eval_factor=2, eval_sets=8, workers=1
    )
    first = [seq.run_job(job) for job in seq.jobs(tmp_path, cfg)]
    for name in runner.TRAINING_FILES:
        for path in tmp_path.rglob(name):
            path.unlink()
    rows_files = sorted(tmp_path.rglob("rows-*.json"))
    assert len(rows_files) == 2
    rows_files[1].unlink()  # the second seed's job must run again
    trained = []
    real = runner.Trainer.run

    def counted(self, *args, **kwargs):
        trained.append(self.folder.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(runner.Trainer, "run", counted)
    again = [seq.run_job(job) for job in seq.jobs(tmp_path, cfg)]
    assert trained == ["seed1"]  # seed0 from its rows, seed1 retrained from nothing
    strip = ("train_seconds",)  # the retrained job's clock differs, its numbers do not

    def same(rows):
        return [{k: v for k, v in r.items() if k not in strip} for r in rows]

    assert [same(r) for r in again] == [same(r) for r in first]
    other = seq.SequenceConfig(**{**cfg.to_dict(), "eval_sets": 4})
    assert seq.rows_file(seq.jobs(tmp_path, other)[0], other) != rows_files[0]


def test_a_resumed_sweep_counts_its_finished_jobs_from_the_start(tmp_path):
    """The sweep's bar starts at the jobs finished before it (its time left is then the pace of
    the jobs it runs, not of reading old rows), and their "done" events are not counted twice."""
    cfg = leaderboard.make_config(
        "quick", methods=("softmax",), seeds=2, steps=10, eval_factor=2, eval_sets=4, workers=1
    )
    first = seq.jobs(tmp_path, cfg)[0]
    seq.run_job(first)
    events = []
    seq.sweep(tmp_path, "leaderboard", cfg, progress=events.append)
    bar = [e for e in events if e["phase"] == "jobs"]
    assert (bar[0]["step"], bar[0]["total"]) == (1, 2)
    assert [e["step"] for e in bar][-1] == 2 and max(e["step"] for e in bar) == 2


# --- rows files and --models-from: what a run folder holds is checked, another run is only read --

SMALL = [
    "leaderboard",
    "--quick",
    "--seeds",
    "1",
    "--steps",
    "5",
    "--eval-factor",
    "1",
    "--eval-sets",
    "4",
    "--workers",
    "1",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny leaderboard run of softmax and sink (one seed each), with its training files."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main([*SMALL, "--methods", "softmax,sink", "--out", str(out)]) == 0
    return out


def _copy(src, dst, strip: bool = False):
    """A copy of run folder ``src``; ``strip``: without the training files, as a record is."""
    import shutil

    shutil.copytree(src, dst)
    if strip:
        for name in runner.TRAINING_FILES:
            for path in dst.rglob(name):
                path.unlink()
    return dst


def _rows(run, recipe: str):
    (path,) = run.glob(f"train/flip_flop/{recipe}/seed0/rows-*.json")
    return path


def _listing(root):
    """Every path under ``root`` with its modification time and content hash."""
    import hashlib

    return {
        str(p.relative_to(root)): (
            p.stat().st_mtime_ns,
            p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(root.rglob("*"))
    }


def test_a_rows_file_holds_its_job_its_rows_and_their_digest(trained):
    import hashlib
    import json

    record = json.loads(_rows(trained, "softmax").read_text())
    assert set(record) == {"job", "rows", "digest"}
    canonical = json.dumps(
        {"job": record["job"], "rows": record["rows"]}, sort_keys=True, separators=(",", ":")
    )
    assert record["digest"] == hashlib.sha256(canonical.encode()).hexdigest()
    assert record["job"]["task"] == "flip_flop" and record["job"]["seed"] == 0
    assert [m["name"] for m in record["job"]["methods"]] == ["softmax"]
    assert record["job"]["training"]["steps"] == 5
    assert {r["method"] for r in record["rows"]} == {"softmax"}


def _damage(case: str, mine: dict, other: dict):
    """The text a hostile user leaves in softmax's rows file (``mine``; ``other``: sink's)."""
    import hashlib
    import json

    def _digest(job, rows):  # sha256 of the canonical JSON, computed here
        text = json.dumps({"job": job, "rows": rows}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def resealed(rows):  # a consistent digest, so the rows themselves are what is checked
        return {**mine, "rows": rows, "digest": _digest(mine["job"], rows)}

    nan_rows = [{**mine["rows"][0], "acc": float("nan")}, *mine["rows"][1:]]
    value = {
        "empty": [],
        "empty record": resealed([]),
        "empty row": [{}],
        "another job's record": other,
        "another job's rows": other["rows"],
        "nan acc": nan_rows,
        "nan acc, resealed": resealed(nan_rows),
        "acc x": [{**mine["rows"][0], "acc": "x"}, *mine["rows"][1:]],
        "acc above 1": resealed([{**mine["rows"][0], "acc": 1.5}, *mine["rows"][1:]]),
        "a row missing": resealed(mine["rows"][:-1]),
        "digest": {**mine, "rows": [{**mine["rows"][0], "acc": 1.0}, *mine["rows"][1:]]},
        "not a list": {"rows": 3},
    }[case]
    return json.dumps(value)


DAMAGE = {
    "empty": "holds no rows",
    "empty record": "holds no rows",
    "empty row": "has no 'task'",
    "another job's record": "another job's rows",
    "another job's rows": "another job's rows",
    "nan acc": "acc nan",
    "nan acc, resealed": "acc nan",
    "acc x": "not a number",
    "acc above 1": "acc 1.5",
    "a row missing": "no row for softmax",
    "digest": "digest does not match",
    "not a list": "has no 'job'",
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_rows_of_a_record_are_named_in_one_sentence(trained, tmp_path, capsys, case):
    """A job folder with rows and no training files (a record) is finished only if its rows are
    this job's: anything else names the file, what is wrong and what to do (exit 2); the
    leaderboard is not written from them."""
    import json

    run = _copy(trained, tmp_path / "run", strip=True)
    target = _rows(run, "softmax")
    mine, other = json.loads(target.read_text()), json.loads(_rows(run, "sink").read_text())
    target.write_text(_damage(case, mine, other))
    table = (run / "leaderboard.csv").read_text()
    capsys.readouterr()
    assert main([*SMALL, "--methods", "softmax,sink", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(target) in err and DAMAGE[case] in err and "delete it" in err
    assert "(in job flip_flop/softmax s0)" in err
    assert (run / "leaderboard.csv").read_text() == table


def test_rows_without_a_digest_are_read_when_they_are_the_jobs(trained, tmp_path):
    """The format before digests (a bare list, as published records hold) is read through the
    same checks and gives the same leaderboard."""
    import json

    run = _copy(trained, tmp_path / "run", strip=True)
    for path in run.rglob("rows-*.json"):
        path.write_text(json.dumps(json.loads(path.read_text())["rows"]))
    assert main([*SMALL, "--methods", "softmax,sink", "--out", str(run)]) == 0
    assert (run / "leaderboard.csv").read_text() == (trained / "leaderboard.csv").read_text()


def test_damaged_rows_are_computed_again_where_the_training_files_are(trained, tmp_path):
    import json

    run = _copy(trained, tmp_path / "run")
    target = _rows(run, "softmax")
    good = json.loads(target.read_text())
    target.write_text("[{}]")
    assert main([*SMALL, "--methods", "softmax,sink", "--out", str(run)]) == 0
    assert json.loads(target.read_text()) == good
    assert (run / "leaderboard.csv").read_text() == (trained / "leaderboard.csv").read_text()


def test_models_from_only_reads_the_other_run(trained, tmp_path):
    """--models-from SRC reads SRC's trained models and writes nothing there (a read-only SRC
    works): the evaluations and rows go to --out, where damaged rows are evaluated again."""
    import os
    import stat

    src = _copy(trained, tmp_path / "src")
    before = _listing(src)
    root = os.geteuid() == 0  # root ignores permissions: the listing is the check then
    for p in [src, *src.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        far = tmp_path / "far"
        args = [
            *SMALL,
            "--methods",
            "softmax,sink",
            "--models-from",
            str(src),
            "--eval-factor",
            "2",
            "--out",
            str(far),
        ]
        assert main(args) == 0
        assert _listing(src) == before
        rows = _rows(far, "softmax")
        assert not runner.has_training_files(rows.parent)
        assert max(int(p.name[1:].split(".")[0]) for p in rows.parent.glob("eval/*/n*.json")) > 48
        table = (far / "leaderboard.csv").read_text()
        rows.write_text("[]")  # damaged: evaluated again on SRC's model
        assert main(args) == 0
        assert (far / "leaderboard.csv").read_text() == table
        assert seq.read_rows(rows, seq.jobs(far, _far_cfg(src))[0], _far_cfg(src))
        assert _listing(src) == before
        assert root or not os.access(src, os.W_OK)
    finally:
        for p in [src, *src.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def _far_cfg(src):
    return leaderboard.make_config(
        "quick",
        methods=("softmax",),
        seeds=1,
        steps=5,
        eval_factor=2,
        eval_sets=4,
        workers=1,
        models=str(src),
    )


@pytest.mark.parametrize(
    "change, words",
    [
        (["--methods", "softmax,ssmax"], "no trained model for ssmax on flip_flop (seed 0)"),
        (
            ["--methods", "softmax", "--seeds", "2"],
            "no trained model for softmax on flip_flop (seed 1)",
        ),
        (["--methods", "softmax", "--tasks", "flip_flop,two_back"], "softmax on two_back (seed 0)"),
        (["--methods", "softmax", "--seed", "3"], "other settings (seed 0 there, 3 here)"),
    ],
)
def test_models_from_refuses_what_the_other_run_cannot_serve(
    trained, tmp_path, capsys, change, words
):
    """A method, seed or task the other run has no trained model for is refused before any work,
    naming it: nothing is trained there, nothing written here."""
    before = _listing(trained)
    capsys.readouterr()
    out = tmp_path / "far"
    args = [*SMALL, *change, "--models-from", str(trained), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert words in err and str(trained) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and _listing(trained) == before


def test_models_from_the_run_itself_is_refused(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path / "run")
    assert main([*SMALL, "--methods", "softmax", "--models-from", str(run), "--out", str(run)]) == 2
    assert "names the run folder itself" in capsys.readouterr().err


def test_an_evaluation_cache_with_an_impossible_accuracy_is_named(trained, tmp_path, capsys):
    """Rows computed again come from the evaluation caches, which pass the same checks."""
    import json

    run = _copy(trained, tmp_path / "run")
    _rows(run, "softmax").unlink()
    cache = sorted(run.glob("train/flip_flop/softmax/seed0/eval/softmax/n*.json"))[0]
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "acc": float("nan")}))
    capsys.readouterr()
    assert main([*SMALL, "--methods", "softmax,sink", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(cache) in err and "acc nan" in err and len(err.strip().splitlines()) == 1


def test_a_method_keeps_its_look_in_every_figure():
    """Styles come from the leaderboard's catalogue order: the same method looks the same
    whatever else a figure draws; methods outside it (plug-ins) take free slots, still distinct."""
    from sharpattn.lab.report import method_styles

    catalogue = list(seq.methods())
    every = method_styles(catalogue, catalogue)
    assert len({tuple(v.values()) for v in every.values()}) == len(catalogue)
    few = method_styles(["sink", "softmax", "my_plugin:f", "other:g"], catalogue)
    assert few["sink"] == every["sink"] and few["softmax"] == every["softmax"]
    assert len({tuple(v.values()) for v in few.values()}) == 4
    forty = method_styles([f"m{i}" for i in range(40)])
    assert len({tuple(v.values()) for v in forty.values()}) == 40
    assert len({(v["color"], v["marker"]) for v in forty.values()}) == 40


@pytest.mark.parametrize("tasks, methods", [(1, 2), (1, 23), (8, 24)])
def test_heat_map_is_sized_from_its_cells_and_keeps_its_labels_inside(
    tmp_path, monkeypatch, tasks, methods
):
    import matplotlib.pyplot as plt
    from PIL import Image

    from sharpattn.experiments import leaderboard

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    names = ["adaptive (inference)", *(f"method_{i}" for i in range(methods - 1))]
    task_names = [
        "local_count",
        "copy",
        "flip_flop",
        "mqar",
        "passkey",
        "reverse",
        "sort",
        "two_back",
    ][:tasks]
    table = [
        {
            "method": m,
            "score": (0.5, 0.1, 0.5),
            "tasks": {t: {"auc": (i / methods, 0.0, 1.0)} for t in task_names},
        }
        for i, m in enumerate(names)
    ]
    leaderboard.heat_map(tmp_path / "h.png", table, task_names)
    fig = figures[-1]
    fig.canvas.draw()  # laid out again at the figure's own dpi, which fig.bbox is in
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox
    texts = [
        t for ax in fig.axes for t in (ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels())
    ]
    bar_label = fig.axes[1].yaxis.label
    assert "area under accuracy" in bar_label.get_text()
    for t in texts:
        if t.get_text():
            box = t.get_window_extent(renderer)
            assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1, t.get_text()
            assert frame.y0 - 1 <= box.y0 and box.y1 <= frame.y1 + 1, t.get_text()
    width, height = Image.open(tmp_path / "h.png").size
    assert width >= 420 and height >= 380  # a one-task map was 324×252 px
    assert height >= 36 * methods  # rows of 0.3 inch at 120 dpi


def test_rows_from_before_the_failure_analysis_still_load(trained, tmp_path):
    """A run's rows carry answer_acc and failures; a record whose rows lack them (written
    before they were recorded, as the published ones) loads and gives the same ranking, its
    cells at 0 marked as not recorded."""
    import json

    record = json.loads(_rows(trained, "softmax").read_text())
    assert all(set(seq.FAILURE_KEYS) <= set(r) for r in record["rows"])
    run = _copy(trained, tmp_path / "run", strip=True)
    for path in run.rglob("rows-*.json"):
        value = json.loads(path.read_text())
        rows = [{k: v for k, v in r.items() if k not in seq.FAILURE_KEYS} for r in value["rows"]]
        value.update(rows=rows, digest=seq.rows._digest(value["job"], rows))
        path.write_text(json.dumps(value))
    assert main([*SMALL, "--methods", "softmax,sink", "--out", str(run)]) == 0
    assert (run / "leaderboard.csv").read_text() == (trained / "leaderboard.csv").read_text()
    failures = (run / "failures.md").read_text()
    assert "answer-token accuracy" in failures
    assert "not recorded" in failures or failures.count("\n") == 2  # a header alone: no cell at 0


def test_the_decoder_size_options_reach_the_config_and_bad_sizes_are_refused_first(tmp_path):
    """--layers, --d-model, --heads and --lr set the sweep's decoder and optimiser; a width the
    heads do not divide is refused in one sentence before any folder is written."""
    from sharpattn.experiments import leaderboard

    cfg = leaderboard.make_config("quick", layers=3, d_model=48, heads=3, lr=2e-3)
    assert (cfg.layers, cfg.d_model, cfg.heads, cfg.lr) == (3, 48, 3, 2e-3)
    out = tmp_path / "lb"
    code = main(["leaderboard", "--quick", "--d-model", "30", "--heads", "4", "--out", str(out)])
    assert code != 0 and not out.exists()
