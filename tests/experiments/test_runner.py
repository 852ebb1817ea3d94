"""The experiment runner: run folders, seeds, threads, progress events, the Trainer and its resume,
the report kit; and max-retrieval resuming after a real ``kill -9``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from processes import ctrl_c_as_at_a_terminal, kill_9_once_written, sharpattn
from sharpattn.lab import report, runner
from sharpattn.lab.runner import MetricsLog, RunFolder, Trainer

# --- run folders ------------------------------------------------------------------------------


def test_run_folder_writes_config_once_and_refuses_another(tmp_path):
    RunFolder(tmp_path / "r", "exp", {"steps": 10, "sizes": (1, 2), "threads": 1}, ["steps"])
    stored = json.loads((tmp_path / "r" / "config.json").read_text())
    assert stored == {"experiment": "exp", "steps": 10, "sizes": [1, 2], "threads": 1}
    # same identity, other evaluation settings: accepted, config.json records the latest
    RunFolder(tmp_path / "r", "exp", {"steps": 10, "sizes": (4,), "threads": 2}, ["steps"])
    assert json.loads((tmp_path / "r" / "config.json").read_text())["sizes"] == [4]
    with pytest.raises(ValueError, match=r"different steps \(10 there, 11 now\)") as err:
        RunFolder(tmp_path / "r", "exp", {"steps": 11}, ["steps"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="holds a exp run, not a other run"):
        RunFolder(tmp_path / "r", "other", {"steps": 10})
    with pytest.raises(ValueError, match="different"):  # identity=None: every key counts
        RunFolder(tmp_path / "r", "exp", {"steps": 10, "sizes": [4], "threads": 3})
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot use"):
        RunFolder(tmp_path / "file", "exp", {})


def test_run_folder_lists_the_code_versions_that_ran_it(tmp_path, monkeypatch):
    import sharpattn

    here = runner.code_version()
    assert here["version"] == sharpattn.__version__
    # in a git checkout (the tests' own): the commit that the checkout has
    head = subprocess.run(
        ["git", "-C", str(Path(runner.__file__).parent), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert here["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    RunFolder(tmp_path, "demo", {"a": 1})
    RunFolder(tmp_path, "demo", {"a": 1})  # resumed by the same code: listed once
    listed = json.loads((tmp_path / "code_versions.json").read_text())
    assert [{k: v[k] for k in here} for v in listed] == [here]
    other = {"version": "9.9", "commit": "f" * 40, "modified": False}
    monkeypatch.setattr(runner.folder, "code_version", lambda: other)
    RunFolder(tmp_path, "demo", {"a": 1})  # resumed by other code: listed after
    listed = json.loads((tmp_path / "code_versions.json").read_text())
    assert [{k: v[k] for k in here} for v in listed] == [here, other]
    text = report.write_report(tmp_path, "t", ["body"]).read_text()
    assert text.endswith(f"then sharpattn 9.9 at commit {'f' * 12} (resumed by other code).\n")
    assert report.code_line([]) == ""


def test_read_config_names_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a exp run folder"):
        runner.read_config(tmp_path, "exp")
    (tmp_path / "config.json").write_text('{"experiment": "other"}')
    with pytest.raises(ValueError, match="another's"):
        runner.read_config(tmp_path, "exp")


def test_metrics_log_appends_truncates_and_survives_a_cut_line(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    assert log.read() == []
    for s in range(5):
        log.append({"step": s, "x": float("nan") if s == 2 else s / 2})
    assert [r["step"] for r in log.read()] == [0, 1, 2, 3, 4]
    assert log.read()[2]["x"] is None  # NaN written as null: strict JSON
    assert [r["step"] for r in log.keep_until(2)] == [0, 1, 2]
    with open(log.path, "a") as f:
        f.write('{"step": 3, "x"')  # a crash mid-append
    assert [r["step"] for r in log.read()] == [0, 1, 2]
    log.path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        log.read()


def test_write_metrics_is_atomic_and_reads_back_equal(tmp_path, monkeypatch):
    folder = RunFolder(tmp_path / "r", "exp", {"steps": 1})
    metrics = {"wall_seconds": 1.5, "rows": [{"n": 2, "acc": 0.25}], "threads": 1, "x": None}
    path = runner.write_metrics(folder, metrics)
    assert path == tmp_path / "r" / "metrics.json"
    assert json.loads(path.read_text()) == metrics
    assert runner.read_json(path) == metrics
    # a path works as well as a RunFolder, and another name for a run's result file
    assert runner.write_metrics(folder.path, [1, 2], "results.json") == folder / "results.json"
    assert json.loads((folder / "results.json").read_text()) == [1, 2]

    # a crash before the rename leaves the previous file whole and no temporary behind
    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        runner.write_metrics(folder, {"wall_seconds": 2.0})
    assert json.loads(path.read_text()) == metrics
    assert sorted(p.name for p in folder.path.iterdir()) == [
        "code_versions.json",
        "config.json",
        "metrics.json",
        "results.json",
    ]


# --- timing -----------------------------------------------------------------------------------


def test_clock_measures_wall_and_cpu_seconds():
    with runner.Clock() as sleep:
        time.sleep(0.2)
    assert sleep.wall >= 0.199  # a sleep lasts at least its time
    assert 0 <= sleep.cpu < sleep.wall  # and costs (almost) no CPU
    held = (sleep.wall, sleep.cpu)
    time.sleep(0.01)
    assert (sleep.wall, sleep.cpu) == held  # stopped at the end of the block
    busy = runner.Clock()  # not stopped: reads the seconds so far
    while busy.cpu < 0.05 and busy.wall < 30:
        pass
    assert busy.cpu >= 0.05  # a busy loop accrues CPU seconds
    first = busy.wall
    assert busy.wall >= first > 0  # later reads mark later points
    assert busy.stop() is busy and busy.stop().wall == busy.wall


#: the package's source folder
PACKAGE = Path(runner.__file__).parents[2]


def _client_sources() -> list[Path]:
    """Every module of the reproductions and of their kit (lab/), checked to be there."""
    paths = sorted([*(PACKAGE / "experiments").rglob("*.py"), *(PACKAGE / "lab").rglob("*.py")])
    assert any(p.parent.name == "runner" for p in paths) and len(paths) > 60
    return paths


def test_experiments_time_and_write_metrics_only_through_the_runner():
    """No reproduction reads a clock or writes metrics.json itself: runner.Clock and
    runner.write_metrics do."""
    import re

    root = PACKAGE
    pattern = re.compile(
        r"time\.(perf_counter|process_time|time|monotonic)\(|write_json\(.*metrics\.json"
    )
    found = [
        f"{path.relative_to(root)}:{i}"
        for path in _client_sources()
        if path.parent.name != "runner"
        and path.name not in ("sweep.py", "ray_jobs.py")  # deadlines of worker processes
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"timed or metrics written outside the runner: {found}"


# --- seeds, threads, events ---------------------------------------------------------------------


def test_seeds_are_independent_per_purpose_and_reproducible():
    a, b = runner.seed_int(0, 1), runner.seed_int(0, 2)
    assert a != b and a == runner.seed_int(0, 1) and 0 <= a < 2**63
    assert runner.seed_int(1, 0) != runner.seed_int(0, 1)  # the order of the key matters
    x = torch.rand(5, generator=runner.generator(3, 4))
    assert torch.equal(x, torch.rand(5, generator=runner.generator(3, 4)))
    state = torch.random.get_rng_state()
    with runner.seeded(7):
        y = torch.rand(3)
    with runner.seeded(7):
        assert torch.equal(y, torch.rand(3))
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is left alone
    with pytest.raises(ValueError):
        runner.seed_int()
    u = runner.numpy_generator(3, 4).normal(size=4)
    assert (u == runner.numpy_generator(3, 4).normal(size=4)).all()
    assert (u != runner.numpy_generator(3, 5).normal(size=4)).all()


def test_experiments_seed_only_through_the_runner():
    """Every random stream of a reproduction comes from runner.seed_int's keys: no module seeds
    torch's or NumPy's generators itself."""
    import re

    root = PACKAGE
    pattern = re.compile(
        r"manual_seed\(|np\.random\.(seed|default_rng|RandomState)\(|random\.seed\("
    )
    found = [
        f"{path.relative_to(root)}:{i}"
        for path in _client_sources()
        if path.parent.name != "runner"
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"seeded outside the runner: {found}"


# --- profiles ---------------------------------------------------------------------------------


def test_profile_settings_are_the_profile_then_the_given_overrides():
    profiles = {"quick": {"steps": 10, "sizes": [1, 2]}, "paper": {"steps": 100}}
    got = runner.profile_settings(profiles, "quick", {"steps": None, "seeds": 3})
    assert got == {"steps": 10, "sizes": [1, 2], "seeds": 3}  # None: the option was not given
    assert runner.profile_settings(profiles, "paper", {"steps": 5}) == {"steps": 5}
    assert runner.profile_settings(profiles, "paper") == {"steps": 100}
    got["sizes"].append(4)
    got["steps"] = 0
    assert profiles == {"quick": {"steps": 10, "sizes": [1, 2]}, "paper": {"steps": 100}}
    with pytest.raises(ValueError) as err:
        runner.profile_settings(profiles, "huge", {"steps": 1})
    assert str(err.value) == "unknown profile 'huge'; profiles: quick, paper."


def _resolvers():
    from sharpattn.experiments import backcopy, clrs, leaderboard, max_retrieval, selective

    return {
        "backcopy": (backcopy.PROFILES, lambda p: backcopy.profile_config(p, "1L-softmax-adam")),
        "clrs": (clrs.PROFILES, clrs.make_config),
        "leaderboard": (leaderboard.PROFILES, leaderboard.make_config),
        "max_retrieval": (max_retrieval.PROFILES, max_retrieval.make_config),
        "selective": (selective.PROFILES, selective.make_config),
    }


@pytest.mark.parametrize("name", ["backcopy", "clrs", "leaderboard", "max_retrieval", "selective"])
def test_experiments_resolve_their_profiles_through_the_runner(name):
    """Every experiment's profiles are one dict resolved by runner.profile_settings: an unknown
    profile is the runner's sentence, and each profile resolves."""
    profiles, resolve = _resolvers()[name]
    with pytest.raises(ValueError) as err:
        resolve("huge")
    assert str(err.value) == f"unknown profile 'huge'; profiles: {', '.join(profiles)}."
    for profile in profiles:
        resolve(profile)


def test_profile_overrides_reach_the_configuration():
    from sharpattn.experiments import max_retrieval as mr
    from sharpattn.experiments import selective

    cfg = mr.make_config("paper", steps=7, seeds=None, method="softmax", checkpoint_every=50)
    assert cfg == mr.Config(**{**mr.PROFILES["paper"], "steps": 7, "checkpoint_every": 50})
    assert mr.make_config() == mr.Config(**mr.PROFILES["quick"])
    assert selective.make_config("paper") == selective.ReproduceConfig()
    quick = selective.make_config("quick", seed=3)
    assert quick == selective.quick_config(3) and quick.quick and quick.seed == 3
    assert quick.graph == selective.PROFILES["quick"]["graph"]
    assert quick.graph is not selective.PROFILES["quick"]["graph"]  # a copy: the profile stays


def test_no_experiment_reads_its_profiles_by_hand():
    """Profiles are resolved only by runner.profile_settings."""
    import re

    root = Path(runner.__file__).parents[1]
    paths = [*sorted(root.rglob("*.py")), *sorted(root.parent.glob("cli*.py"))]
    found = [
        f"{path.name}:{i}"
        for path in paths
        if path.parent.name != "runner"
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"PROFILES\[|unknown profile", line) and not line.lstrip().startswith("#")
    ]
    assert not found, f"profiles read outside runner.profile_settings: {found}"


def test_threads_are_set_for_the_block_and_restored():
    old = torch.get_num_threads()
    with runner.threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == old
    with runner.threads() as n:
        assert n == runner.cores() and torch.get_num_threads() == n
    assert torch.get_num_threads() == old


_FAULTS_PER_STEP = """
import resource, torch
from sharpattn.lab import runner
torch.set_num_threads(1)
with runner.threads(1):
    w = [torch.randn(128, 128, requires_grad=True) for _ in range(3)]

    def step():  # activations and gradients of 3 MiB each (768 pages), freed every step
        h = torch.randn(6000, 128)
        for m in w:
            h = torch.nn.functional.gelu(h @ m)
        h.square().mean().backward()

    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and __import__("platform").libc_ver()[0] == "glibc"),
    reason="the allocator policy is glibc's mallopt",
)
def test_the_runner_keeps_freed_memory_so_steps_do_not_fault_pages_in_again():
    # glibc's defaults fault in and zero ~1,700 pages per step of this loop (measured); with the
    # runner's policy the freed blocks are reused: fewer faults per step than one tensor has pages
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_STEP],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert float(out.stdout.split()[-1]) < 768 / 4


def test_events_are_plain_picklable_dicts():
    import pickle

    seen = []
    runner.emit(seen.append, "seeds 0-9", "train", 5, 10, loss=0.5)
    runner.emit(None, "x", "y", 0, 1)  # no renderer: nothing happens
    assert seen == [{"task": "seeds 0-9", "phase": "train", "step": 5, "total": 10, "loss": 0.5}]
    assert pickle.loads(pickle.dumps(seen)) == seen


# --- the Trainer ----------------------------------------------------------------------------------


def _toy(folder: Path, steps: int = 40, members: int = 1, progress=None, log_at=None) -> Trainer:
    """A tiny regression model whose batches come from a checkpointed generator."""
    with runner.seeded(0):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = runner.generator(0, 1)

    def batch(step):
        x = torch.randn(16, 4, generator=data)
        return x, x.sum(-1, keepdim=True).sin()

    def loss(m, b):
        per = F.mse_loss(m(b[0]), b[1], reduction="none").mean()
        return per.expand(members)  # an ensemble's vector of losses

    def on_log(step, losses):
        with torch.no_grad():
            return {"w_norm": float(sum(p.norm() for p in model.parameters()))}

    return Trainer(
        folder,
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        steps=steps,
        batch=batch,
        loss=loss,
        generators={"data": data},
        checkpoint_every=10,
        log_every=5,
        on_log=on_log,
        progress=progress,
        report_every=5,
        log_at=log_at,
    )


class _Batch:
    """A batch that records where the Trainer moves it."""

    def __init__(self, x: torch.Tensor, moves: list):
        self.x, self.moves = x, moves

    def to(self, device):
        self.moves.append(torch.device(device))
        return _Batch(self.x.to(device), self.moves)


def test_trainer_moves_the_model_and_every_batch_to_its_device(tmp_path):
    with runner.seeded(0):
        model = torch.nn.Linear(3, 1)
    data, moves, seen = runner.generator(0, 1), [], []

    def loss(m, b):
        seen.append(b)
        return m(b.x).square().mean()

    t = Trainer(
        tmp_path / "run",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        steps=3,
        batch=lambda step: _Batch(torch.randn(4, 3, generator=data), moves),
        loss=loss,
        generators={"data": data},
        device="cpu",
    )
    assert t.device == torch.device("cpu") and Trainer(
        tmp_path / "other", model, t.optimizer, steps=1, batch=None, loss=None
    ).device == torch.device("cpu")  # the default
    assert t.run()["step"] == 3
    assert moves == [torch.device("cpu")] * 3  # each batch moved once, before the loss sees it
    assert all(b.x.device == torch.device("cpu") and b.moves is moves for b in seen)
    assert all(p.device == torch.device("cpu") for p in t.model.parameters())


def test_to_device_moves_the_tensors_of_nested_batches_without_copying():
    from collections import namedtuple

    moves: list = []
    x = torch.ones(2)
    pair = namedtuple("Pair", "a b")
    batch = {"x": x, "pair": pair(_Batch(x, moves), 3), "list": [x, "name"], "n": 4}
    got = runner.to_device(batch, "cpu")
    assert got["x"] is x and got["list"][0] is x and got["list"][1] == "name" and got["n"] == 4
    assert isinstance(got["pair"], pair) and got["pair"].b == 3 and moves == [torch.device("cpu")]
    assert got["pair"].a.x is x and isinstance(got["list"], list)


def test_experiments_read_tensors_into_numpy_through_the_cpu():
    """A tensor may live on the Trainer's device: every ``.numpy()`` of the reproductions and
    the diagnostics goes through ``.cpu()`` first."""
    import re

    src = PACKAGE
    bare = re.compile(r"(?<!\.cpu\(\))\.numpy\(\)")
    found = [
        f"{path.relative_to(src)}:{i}"
        for path in [*_client_sources(), *sorted((src / "diagnostics").rglob("*.py"))]
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if bare.search(line)
    ]
    assert not found, f".numpy() without .cpu(): {found}"


def test_trainer_resumes_to_the_numbers_of_an_uninterrupted_run(tmp_path, one_thread):
    full = _toy(tmp_path / "a")
    done = full.run()
    assert done["step"] == 40 and not full.checkpoint.exists() and full.final.is_file()

    _toy(tmp_path / "b").run(stop_at=27)  # a crash after step 27: checkpoint from step 20
    assert not (tmp_path / "b" / "model.safetensors").exists()
    assert [r["step"] for r in MetricsLog(tmp_path / "b" / "metrics.jsonl").read()][-1] == 25

    def interrupt(ev):
        if ev["step"] == 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C writes a checkpoint at step 30
        _toy(tmp_path / "b", progress=interrupt).run()
    resumed = _toy(tmp_path / "b")
    resumed.run()
    for p, r in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, r)
    a = MetricsLog(tmp_path / "a" / "metrics.jsonl").read()
    b = MetricsLog(tmp_path / "b" / "metrics.jsonl").read()
    assert a == b and [r["step"] for r in a] == list(range(0, 41, 5))
    assert a[0]["loss"] is None and len(a[1]["loss"]) == 1
    # finished: run() loads the final weights instead of training
    again = _toy(tmp_path / "b", steps=40)
    state = again.run()
    assert state["step"] == 40
    for p, r in zip(full.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, r)


def test_trainer_reports_a_non_finite_loss_in_one_sentence(tmp_path):
    t = _toy(tmp_path)
    t.loss = lambda m, b: torch.tensor([float("nan")], requires_grad=True)
    with pytest.raises(FloatingPointError, match="the loss became nan at step 5"):
        t.run()


def test_trainer_logs_at_chosen_steps_when_given(tmp_path):
    _toy(tmp_path, steps=12, log_at=[1, 3, 7, 30]).run()  # log_every=5 is then not used
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").read()] == [0, 1, 3, 7, 12]


def test_trainer_sums_member_losses(tmp_path):
    t = _toy(tmp_path, steps=5, members=3)
    t.run()
    rec = MetricsLog(tmp_path / "metrics.jsonl").read()[-1]
    assert len(rec["loss"]) == 3 and rec["loss"][0] == rec["loss"][2]


# --- the report kit ---------------------------------------------------------------------------------


def test_markdown_table_csv_and_report(tmp_path):
    md = report.markdown_table(["n", "acc"], [[16, 0.5], [1024, float("nan")]])
    assert md.splitlines() == ["| n | acc |", "|:---|---:|", "| 16 | 0.5 |", "| 1,024 | n/a |"]
    with pytest.raises(ValueError):
        report.markdown_table(["a"], [[1, 2]])
    report.write_table(tmp_path, "t", ["n", "acc"], [[16, "50%"]], raw=[[16, 0.5]])
    assert (tmp_path / "t.csv").read_text() == "n,acc\n16,0.5\n"
    with report.figure(tmp_path / "f.png", figsize=(2, 2)) as (fig, ax):
        ax.plot([0, 1], [0, 1])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(RuntimeError), report.figure(tmp_path / "g.png") as (fig, ax):
        raise RuntimeError  # a failed drawing leaves no file
    assert not (tmp_path / "g.png").exists()
    path = report.write_report(tmp_path, "Title", ["a", None, report.image("f.png", "cap")])
    assert path.read_text().startswith("# Title\n\na\n\n![cap](f.png)")


# --- every reproduce command resumes after kill -9: max retrieval -------------------------------


def test_max_retrieval_resumes_after_kill_9(tmp_path):
    args = [
        "reproduce",
        "max-retrieval",
        "--quick",
        "--seeds",
        "2",
        "--group",
        "2",
        "--steps",
        "400",
        "--sizes",
        "16,64",
        "--test-sets",
        "200",
        "--checkpoint-every",
        "50",
        "--threads",
        "1",
    ]
    assert sharpattn(*args, "--out", str(tmp_path / "a")).wait(timeout=300) == 0
    proc = sharpattn(*args, "--out", str(tmp_path / "b"))
    kill_9_once_written(proc, tmp_path / "b" / "train" / "seeds0-1" / "checkpoint.safetensors")
    assert sharpattn(*args, "--out", str(tmp_path / "b")).wait(timeout=300) == 0  # resumes
    a = json.loads((tmp_path / "a" / "table1.json").read_text())
    b = json.loads((tmp_path / "b" / "table1.json").read_text())
    assert a == b
    ma = MetricsLog(tmp_path / "a" / "train" / "seeds0-1" / "metrics.jsonl").read()
    mb = MetricsLog(tmp_path / "b" / "train" / "seeds0-1" / "metrics.jsonl").read()
    assert ma == mb
    assert np.isfinite([r["baseline_mean"] for r in a]).all()


_SIGINT_CHILD = """
import sys, torch
sys.path[:0] = [{tests!r}, {helpers!r}]
from test_runner import _toy
from sharpattn.lab import runner
torch.set_num_threads(1)
said = []
def ready(ev):  # training has started
    if not said:
        said.append(print("ready", flush=True))
try:
    _toy(__import__("pathlib").Path({folder!r}), steps=100000, progress=ready).run()
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("delay", [0.3, 0.7, 1.1])
def test_ctrl_c_at_any_moment_checkpoints_a_state_an_uninterrupted_run_passes(tmp_path, delay):
    """SIGINT is held during a training step, so the checkpoint Ctrl-C writes is the state after
    a whole step: resuming it to step N gives the uninterrupted run's numbers at step N."""
    folder = tmp_path / "killed"
    here = Path(__file__).parent  # test_runner, and the helpers beside conftest (processes.py)
    code = _SIGINT_CHILD.format(tests=str(here), helpers=str(here.parent), folder=str(folder))
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:  # a failed test leaves no trainer of 100,000 steps running
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    state = json.loads(
        __import__("safetensors")
        .safe_open(str(folder / "checkpoint.safetensors"), "pt")
        .metadata()["sharpattn.state"]
    )["state"]
    steps = state["step"] + 7  # resume a few steps past the interrupt
    with runner.threads(1):
        resumed = _toy(folder, steps=steps)
        resumed.run()
        clean = _toy(tmp_path / "clean", steps=steps)
        clean.run()
    for p, r in zip(clean.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, r)
