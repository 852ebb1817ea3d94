"""The sequence-task engine (experiments/sequence.py) behind `reproduce clrs` and `leaderboard`:
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

pytestmark = pytest.mark.usefixtures("one_thread")


def test_area_is_the_trapezoid_on_log2_size_normalised():
    sizes, acc = [4, 8, 32, 256], [1.0, 0.5, 0.25, 0.0]
    x = [math.log2(s) for s in sizes]  # 2, 3, 5, 8: independent trapezoid by hand
    by_hand = sum((x[i + 1] - x[i]) * (acc[i] + acc[i + 1]) / 2 for i in range(3)) / (x[-1] - x[0])
    assert seq.area(sizes, acc) == pytest.approx(by_hand, rel=1e-12)
    assert seq.area(sizes, [1.0] * 4) == pytest.approx(1.0, rel=1e-12)
    assert seq.area(sizes, [0.0] * 4) == 0.0
    assert seq.area([16], [0.75]) == 0.75


def test_every_trainable_registry_method_is_on_the_leaderboard():
    ms = seq.methods()
    for name in nz.available():
        assert (name in ms) != (name in seq.UNTRAINABLE), name
    assert ms["adaptive (inference)"].recipe == ms["softmax"].recipe  # shares the softmax model
    assert ms["adaptive"].recipe != ms["softmax"].recipe
    assert {"selective_q", "selective_v", "selective_qv"} <= set(ms)
    with pytest.raises(ValueError, match="unknown leaderboard method"):
        seq.resolve(["softmax", "nope"])


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

TINY = ["--seeds", "2", "--steps", "30", "--eval-factor", "2", "--eval-sets", "8",
        "--workers", "1"]  # fmt: skip


def test_adaptive_at_inference_is_the_softmax_model_evaluated_with_adaptive(tmp_path):
    """One training per recipe: `adaptive (inference)` evaluates the softmax job's model with
    adaptive temperature, on the same test sequences (paired), and differs from softmax only
    there; every accuracy is a fraction of the test sequences."""
    cfg = leaderboard.make_config("quick", methods=("softmax", "adaptive (inference)"),
                                  steps=30, eval_factor=2, eval_sets=8, workers=1)  # fmt: skip
    job = seq.jobs(tmp_path, cfg)[0]
    assert [m.name for m in job.methods] == ["softmax", "adaptive (inference)"]
    rows = seq.run_job(job)
    t = seq.task(job.task)
    model = seq.build_model(cfg, job.methods[0], t, job.seed)
    from sharpattn.experiments.runner import read_weights

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
    for name in ("leaderboard.md", "leaderboard.csv", "accuracy.md", "leaderboard.png",
                 "report.md"):  # fmt: skip
        assert (out / name).is_file(), name
    lines = (out / "leaderboard.csv").read_text().splitlines()
    assert lines[0].startswith("rank,method,score") and len(lines) == 3
    scores = [float(line.split(",")[2]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert main(args) == 0  # re-running loads every finished job: same table
    assert (out / "leaderboard.csv").read_text().splitlines() == lines


def test_curves_of_many_methods_keep_every_line_apart_and_the_legend_inside(tmp_path, monkeypatch):
    """23 methods on 8 tasks (no spare panel): colours repeat past tab20's 20, so the repeats
    are dashed, and the legend sits in a column of its own inside the saved figure."""
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))  # kept to inspect
    names = [f"m{i}" for i in range(23)]
    tasks = ["copy", "flip_flop", "local_count", "mqar", "passkey", "reverse", "sort", "two_back"]
    rows = [{"task": t, "method": m, "seed": 0, "size": n, "acc": 0.5}
            for t in tasks for m in names for n in (16, 64)]  # fmt: skip
    seq.plot_curves(tmp_path / "c.png", rows, tasks, names, "title")
    assert (tmp_path / "c.png").is_file()
    fig = figures[-1]
    lines = fig.axes[0].get_lines()
    styles = [(ln.get_color(), ln.get_linestyle()) for ln in lines]
    assert len(set(styles)) == len(names)  # no two methods drawn alike
    (legend,) = fig.legends
    box = legend.get_window_extent(fig.canvas.get_renderer())
    frame = fig.bbox
    assert box.x0 >= frame.x0 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0
    assert all(box.x0 >= ax.get_window_extent().x1 for ax in fig.axes)  # beside the panels
    close(fig)


def test_reproduce_clrs_command(tmp_path):
    out = tmp_path / "clrs"
    args = ["reproduce", "clrs", "--quick", "--tasks", "minimum,insertion_sort", *TINY,
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    table = (out / "clrs.csv").read_text().splitlines()
    assert len(table) == 1 + 2 * 2  # two algorithms x (softmax, adaptive)
    assert (out / "fig8.png").is_file() and (out / "bars.png").is_file()
    assert "softmax vs adaptive" in (out / "report.md").read_text()


def test_list_shows_the_tasks_and_methods_and_runs_nothing(tmp_path, monkeypatch):
    """`--list` (both commands): every task of the command's family with its training sizes and
    the evaluation sizes the options give, the chosen ones starred, and the methods; no run."""
    import io

    from rich.console import Console

    from sharpattn import cli

    def listed(*args: str) -> list[str]:
        buf = io.StringIO()
        monkeypatch.setattr(cli, "console", Console(file=buf, width=2000, color_system=None))
        assert main([*args, "--list", "--out", str(tmp_path / "x")]) == 0
        return buf.getvalue().splitlines()

    out = listed("leaderboard", "--tasks", "passkey", "--methods", "softmax,selective_qv",
                 "--eval-factor", "8")  # fmt: skip
    row = next(line for line in out if " passkey " in line)
    assert "* passkey" in row and "16-48" in row and "16, 32, 64, 128, 256, 512 " in row
    assert "* flip_flop" not in "\n".join(out) and " flip_flop " in "\n".join(out)
    methods = next(line for line in out if line.startswith("methods"))
    assert "*softmax" in methods and "*selective_qv" in methods and " selective_q," in methods
    out = listed("reproduce", "clrs", "--quick")
    assert any("* minimum" in line for line in out) and any(" bfs " in line for line in out)
    assert not any("passkey" in line for line in out)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["leaderboard", "--quick", "--methods", "softmax,nope"], "unknown leaderboard method"),
        (["leaderboard", "--quick", "--tasks", "nope"], "unknown task"),
        (["reproduce", "clrs", "--quick", "--tasks", "flip_flopp"], "unknown task"),
    ],
)
def test_mistakes_are_one_sentence_exit_2(tmp_path, capsys, args, words):
    assert main([*args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert words in err.lower() and "Traceback" not in err
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_leaderboard_resumes_after_kill_9_with_the_same_numbers(tmp_path):
    args = ["leaderboard", "--quick", "--methods", "softmax", "--seeds", "1", "--steps", "300",
            "--checkpoint-every", "40", "--eval-factor", "2", "--eval-sets", "8",
            "--workers", "1"]  # fmt: skip
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
    cfg = leaderboard.make_config("quick", methods=("softmax",), seeds=2, steps=30,
                                  eval_factor=2, eval_sets=8, workers=1)  # fmt: skip
    first = [seq.run_job(job) for job in seq.jobs(tmp_path, cfg)]
    for name in seq.runner.TRAINING_FILES:
        for path in tmp_path.rglob(name):
            path.unlink()
    rows_files = sorted(tmp_path.rglob("rows-*.json"))
    assert len(rows_files) == 2
    rows_files[1].unlink()  # the second seed's job must run again
    trained = []
    real = seq.runner.Trainer.run

    def counted(self, *args, **kwargs):
        trained.append(self.folder.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(seq.runner.Trainer, "run", counted)
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
    cfg = leaderboard.make_config("quick", methods=("softmax",), seeds=2, steps=10,
                                  eval_factor=2, eval_sets=4, workers=1)  # fmt: skip
    first = seq.jobs(tmp_path, cfg)[0]
    seq.run_job(first)
    events = []
    seq.sweep(tmp_path, "leaderboard", cfg, progress=events.append)
    bar = [e for e in events if e["phase"] == "jobs"]
    assert (bar[0]["step"], bar[0]["total"]) == (1, 2)
    assert [e["step"] for e in bar][-1] == 2 and max(e["step"] for e in bar) == 2
