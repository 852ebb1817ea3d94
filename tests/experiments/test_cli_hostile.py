"""Issue 16, items 10-13 and 15: every mistake on the command line or in a run folder is one
sentence on stderr with exit code 2; signals exit 130 / 143; run files follow the user's umask."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_checks import one_sentence
from processes import sharpattn, wait_until_in_main
from sharpattn.cli import main
from sharpattn.lab import checkpoint as ckpt
from sharpattn.lab import report
from sharpattn.lab.runs import write_json

HUGE = "1000000000000"


# ---------------------------------------------------------------- item 10


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["demo", "--sizes", HUGE], ["--sizes"]),
        (["demo", "--sizes", "10000000000000000000000000"], ["--sizes"]),
        (["dispersion", "--sizes", HUGE], ["--sizes"]),
        (["demo", "--rows", HUGE, "--sizes", "16"], ["GiB", "memory"]),
        (["dispersion", "--rows", HUGE, "--sizes", "16"], ["GiB", "memory"]),
        (["reproduce", "max-retrieval", "--quick", "--sizes", HUGE], ["--sizes"]),
    ],
)
def test_huge_sizes_are_refused_before_any_work(argv, needles, capsys, tmp_path):
    out = tmp_path / "run"
    started = time.perf_counter()
    assert main([*argv, "--out", str(out)]) == 2
    one_sentence(capsys, *needles)
    assert time.perf_counter() - started < 30  # refused, not attempted
    assert not (out / "config.json").exists()


def test_out_paths_that_cannot_be_run_folders(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    loop = tmp_path / "loop"
    os.symlink(loop, loop)  # a symlink loop
    for out in (afile / "sub", loop / "sub"):
        assert main(["demo", "--sizes", "16", "--rows", "2", "--out", str(out)]) == 2
        one_sentence(capsys, "cannot use", str(out))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores modes")
def test_read_only_folder(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        for out in (ro, ro / "sub"):
            assert main(["demo", "--sizes", "16", "--rows", "2", "--out", str(out)]) == 2
            one_sentence(capsys, "cannot use", "permission")
    finally:
        ro.chmod(0o700)


# ---------------------------------------------------------------- item 11


@pytest.mark.parametrize(
    "content, needle",
    [('{"x": 1}', '"coefficients"'), ("not json", "not a valid JSON"), ("", "not a valid JSON")],
)
def test_bad_coefficient_files_name_the_file(content, needle, capsys, tmp_path):
    path = tmp_path / "coeffs.json"
    path.write_text(content)
    argv = ["reproduce", "max-retrieval", "--quick", "--coefficients", str(path)]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    one_sentence(capsys, str(path), needle)


def test_damaged_run_json_names_the_file(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{ not json")
    assert main(["fit-temperature", str(run)]) == 2
    one_sentence(capsys, str(run / "config.json"), "not valid JSON")


@pytest.mark.parametrize("content", ["[]", "3", '"text"'])
def test_a_config_json_of_another_shape_is_named(content, capsys, tmp_path):
    (tmp_path / "config.json").write_text(content)
    for argv in (["reproduce", "max-retrieval", "--out"], ["fit-temperature"]):
        assert main([*argv, str(tmp_path)]) == 2
        one_sentence(capsys, str(tmp_path / "config.json"), "damaged", "not an object")


def test_a_missing_study_is_one_sentence(capsys):
    assert main(["reproduce", "backcopy-study"]) == 2
    one_sentence(capsys, "STUDY", "structures")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["demo", "--seed", str(2**70)], "--seed"),
        (["demo", "--margin", "inf"], "--margin"),
        (["dispersion", "--margin", "nan"], "margin"),
        (["reproduce", "max-retrieval", "--quick", "--paper"], "--quick and --paper"),
    ],
)
def test_bad_options_fail_before_a_run_folder_is_written(argv, needle, capsys, tmp_path):
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out)]) == 2
    one_sentence(capsys, needle)
    assert not out.exists()


# ---------------------------------------------------------------- item 12


def damaged_files(tmp_path: Path, good: bytes) -> dict[str, Path]:
    rng = torch.Generator().manual_seed(0)
    files = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "random": bytes(torch.randint(0, 256, (4096,), generator=rng, dtype=torch.uint8).tolist()),
    }
    out = {}
    for name, data in files.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        out[name] = path
    return out


def test_damaged_checkpoints_are_one_sentence_naming_the_file(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    good = tmp_path / "good.safetensors"
    ckpt.save_checkpoint(good, model=model, optimizer=opt, state={"step": 1})
    for path in damaged_files(tmp_path, good.read_bytes()).values():
        with pytest.raises(ValueError, match="is damaged") as err:
            ckpt.load_checkpoint(path, model=model, optimizer=opt)
        assert str(path) in str(err.value) and "delete it" in str(err.value)


def test_cli_run_with_a_damaged_checkpoint_and_a_damaged_model(capsys, tmp_path, made):
    out = made("max-retrieval", tmp_path)
    argv = [*COMMANDS["max-retrieval"], "--out", str(out)]
    model = out / "train" / "seed0" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])  # a finished model, truncated
    shutil.rmtree(out / "eval")  # so the model is read again
    assert main(argv) == 2
    one_sentence(capsys, str(model), "is damaged")


# ---------------------------------------------------------------- item 13


@pytest.mark.parametrize(
    "sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_signals_exit_with_the_shell_convention(sig, code, word, tmp_path):
    proc = sharpattn("dispersion", "--sizes", "65536", "--rows", "64", "--out", str(tmp_path))
    wait_until_in_main(proc)  # past start-up however loaded the machine is
    time.sleep(1.0)  # inside the work
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert word in err and "Traceback" not in err


# ---------------------------------------------------------------- item 15


def test_run_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "config.json", {"a": 1})
        mode = stat.S_IMODE((tmp_path / "config.json").stat().st_mode)
    finally:
        os.umask(old)
    assert mode == 0o644
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}


def _children(pid: int) -> set[int]:
    """Live child processes of ``pid`` (Linux /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry.name))
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(p)
    return alive


def _start_workers(tmp_path):
    args = ["reproduce", "max-retrieval", "--quick", "--seeds", "2", "--workers", "2"]
    proc = sharpattn(*args, "--steps", "100000", "--sizes", "16", "--out", str(tmp_path))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_children(proc.pid)) < 3:  # manager + 2 workers
        time.sleep(0.5)
    kids = _children(proc.pid)
    assert len(kids) >= 3, kids
    time.sleep(2.0)
    return proc, kids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)]
)
def test_workers_die_with_their_parent(sig, code, tmp_path):
    """Signals to the parent alone (not its process group): it stops within seconds with the
    shell's exit code, and its workers and the queue manager stop too (kill -9: via the kernel's
    parent-death signal)."""
    proc, kids = _start_workers(tmp_path)
    proc.send_signal(sig)
    proc.wait(timeout=30)  # the parent itself stops promptly
    assert proc.returncode == code
    deadline = time.monotonic() + 15
    while _alive(kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(kids), "worker processes outlived their parent"
    # stderr closes once every process that holds it is gone; multiprocessing's resource
    # tracker, which cleans up after a kill -9, does so without a "leaked semaphore" warning
    err = proc.communicate(timeout=30)[1]
    assert "leaked" not in err, err


# ---------------------------------------------------------------- empty selections


def test_an_empty_selection_is_refused_and_the_report_kept(capsys, tmp_path):
    """``--variants ""`` trains nothing: refused in one sentence, the folder's report untouched."""
    kept = {"report.md": "# old\n", "results.json": '{"old": 1}\n', "residual.png": "png"}
    for name, text in kept.items():
        (tmp_path / name).write_text(text)
    for variants in ("", " , "):
        argv = ["reproduce", "backcopy-study", "sgd", "--variants", variants]
        assert main([*argv, "--out", str(tmp_path)]) == 2
        one_sentence(capsys, "variant")
    argv = ["reproduce", "selective", "--quick", "--tasks", "lm", "--lm-variants", ","]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    one_sentence(capsys, "variant")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == kept
    with pytest.raises(ValueError, match="no runs to report"):
        report.require({}, "runs")


# ---------------------------------------------------------------- damaged run folders

#: the smallest run of each command (selective-llm on tests/tiny_hf.py's Llama)
COMMANDS = {
    "leaderboard": [
        "leaderboard",
        "--quick",
        "--tasks",
        "flip_flop",
        "--methods",
        "softmax",
        "--seeds",
        "1",
        "--steps",
        "2",
        "--eval-sets",
        "1",
        "--eval-factor",
        "1",
        "--threads",
        "1",
    ],
    "max-retrieval": [
        "reproduce",
        "max-retrieval",
        "--quick",
        "--steps",
        "4",
        "--sizes",
        "16",
        "--test-sets",
        "4",
        "--checkpoint-every",
        "2",
        "--threads",
        "1",
    ],
    "selective-llm": [
        "reproduce",
        "selective-llm",
        "--quick",
        "--steps",
        "2",
        "--eval-windows",
        "1",
        "--context",
        "16",
        "--threads",
        "1",
    ],
}
SEQUENCE, MAX_RETRIEVAL, SELECTIVE_LLM = COMMANDS.values()


@pytest.fixture
def tiny_pretrained(monkeypatch):
    import tiny_hf
    from sharpattn.integrations import pretrained

    monkeypatch.setattr(pretrained, "load_pretrained", tiny_hf.pretrained)


@pytest.fixture(scope="module")
def _finished(tmp_path_factory):
    """One finished run folder per command, made once for the module (max-retrieval's figures
    alone take seconds)."""
    import tiny_hf
    from sharpattn.integrations import pretrained

    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(pretrained, "load_pretrained", tiny_hf.pretrained)
                assert main([*COMMANDS[name], "--out", str(out)]) == 0
            done[name] = out
        return done[name]

    return get


@pytest.fixture
def made(_finished, capsys):
    """``made(command, tmp_path)``: a copy of that command's finished run folder."""

    def copy(name: str, where: Path) -> Path:
        out = where / name
        shutil.copytree(_finished(name), out)
        capsys.readouterr()
        return out

    return copy


def another_runs_checkpoint(tmp_path: Path) -> bytes:
    """A valid sharpattn checkpoint of another model (other keys and shapes)."""
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "another.safetensors"
    ckpt.save_checkpoint(
        path,
        model=model,
        optimizer=torch.optim.Adam(model.parameters()),
        state={"step": 1, "seconds": 0.0},
    )
    return path.read_bytes()


def refused(capsys, argv, path: Path, *needles) -> str:
    assert main(argv) == 2
    return one_sentence(capsys, str(path), *needles)


def test_another_runs_weights_are_named_and_deleting_them_retrains(capsys, tmp_path, made):
    run = made("leaderboard", tmp_path)
    argv = [*SEQUENCE, "--out", str(run)]
    [model] = run.rglob("model.safetensors")
    model.write_bytes(another_runs_checkpoint(tmp_path))
    err = refused(capsys, argv, model, "another run's file", "delete it")
    assert "Traceback" not in err
    # a checkpoint of another run where a run resumes from
    checkpoint = model.with_name("checkpoint.safetensors")
    model.rename(checkpoint)
    refused(capsys, argv, checkpoint, "another run's file", "delete it")
    checkpoint.unlink()  # as the sentence says
    assert main(argv) == 0 and model.is_file()


@pytest.mark.usefixtures("tiny_pretrained")
def test_another_runs_weights_in_the_other_commands(capsys, tmp_path, made):
    run = made("max-retrieval", tmp_path)
    model = run / "train" / "seed0" / "model.safetensors"
    model.write_bytes(another_runs_checkpoint(tmp_path))
    refused(capsys, ["corollary-b1", str(run), "--pairs", "2"], model, "another run's file")
    argv = ["fit-temperature", str(run), "--sizes", "16", "--sets", "16", "--no-eval"]
    refused(capsys, argv, model, "another run's file")
    llm = made("selective-llm", tmp_path)
    (llm / "train" / "model.safetensors").write_bytes(another_runs_checkpoint(tmp_path))
    refused(capsys, [*SELECTIVE_LLM, "--out", str(llm)], llm / "train" / "model.safetensors")


@pytest.mark.parametrize("content", ["{}", "[]", '{"acc": "high"}', '"x"'])
def test_json_of_another_shape_is_named_and_deleting_it_recomputes(content, capsys, tmp_path, made):
    run = made("leaderboard", tmp_path)
    argv = [*SEQUENCE, "--out", str(run)]
    [cache, *_] = sorted(run.rglob("n*.sets1.json"))
    cache.write_text(content)
    refused(capsys, argv, cache, "is damaged", "delete it")
    cache.unlink()
    assert main(argv) == 0 and json.loads(cache.read_text())["sets"] == 1


@pytest.mark.usefixtures("tiny_pretrained")
def test_summary_and_cache_files_of_another_shape(capsys, tmp_path, made):
    run = made("max-retrieval", tmp_path)
    (run / "fit_temperature.json").write_text("[]")
    refused(capsys, ["corollary-b1", str(run), "--pairs", "2"], run / "fit_temperature.json")
    llm = made("selective-llm", tmp_path)
    [nll, *_] = sorted((llm / "base").glob("*.json"))
    nll.write_text("{}")
    refused(capsys, [*SELECTIVE_LLM, "--out", str(llm)], nll, "delete it")


@pytest.mark.parametrize("damage", ["random bytes", "a list", "deleted"])
def test_a_damaged_training_log_is_named_with_a_fix_that_works(damage, capsys, tmp_path, made):
    run = made("leaderboard", tmp_path)
    argv = [*SEQUENCE, "--out", str(run)]
    [log] = run.rglob("metrics.jsonl")
    if damage == "random bytes":
        log.write_bytes(bytes(range(128, 256)) * 4)
    elif damage == "a list":
        log.write_text('{"step": 0}\n[]\n{"step": 2}\n')
    else:
        log.unlink()
    err = refused(capsys, argv, log, "delete the folder")
    folder = Path(err.split("delete the folder ", 1)[1].split(" to train", 1)[0])
    assert folder == log.parent
    shutil.rmtree(folder)  # as the sentence says
    assert main(argv) == 0 and log.is_file()


def test_a_deleted_training_log_of_the_simplified_study(capsys, tmp_path):
    argv = ["reproduce", "backcopy-study", "simplified", "--steps", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    [log] = tmp_path.rglob("metrics.jsonl")
    log.unlink()
    refused(capsys, argv, log, "delete the folder")
    shutil.rmtree(log.parent)
    assert main(argv) == 0


# ---------------------------------------------------------------- workers: interrupts and deaths


def _seed_folders(tmp_path: Path) -> list[Path]:
    return [tmp_path / "run" / "train" / "flip_flop" / "softmax" / f"seed{s}" for s in (0, 1)]


def _leaderboard_with_workers(tmp_path: Path, group: bool = False, until: str = "training"):
    """``leaderboard --workers 2`` on two long jobs, returned once both workers are training
    (each job has logged its step 0) or, ``until="started"``, as soon as both pool workers
    exist (their Python is starting: importing, unpickling their first job)."""
    args = ["leaderboard", "--tasks", "flip_flop", "--methods", "softmax", "--seeds", "2"]
    args += ["--steps", "1000000", "--workers", "2", "--out", str(tmp_path / "run")]
    proc = sharpattn(*args, group=group)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if until == "started" and len(_pool_workers(proc.pid)) >= 2:
            return proc
        if all((f / "metrics.jsonl").is_file() for f in _seed_folders(tmp_path)):
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the workers did not start: {proc.communicate()[1]}")


def _pool_workers(pid: int) -> list[int]:
    """The pool workers among the children of ``pid``: the spawned processes but the first
    started, the progress queue's manager (started before the pool); not multiprocessing's
    resource tracker."""

    def started(kid: int) -> int:  # field 22 of /proc/PID/stat: start time in clock ticks
        return int(Path(f"/proc/{kid}/stat").read_text().rsplit(")", 1)[1].split()[19])

    spawned = [
        k for k in _children(pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()
    ]
    return sorted(spawned, key=started)[1:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("when", ["started", "training"])
def test_ctrl_c_to_the_process_group_is_one_line(when, tmp_path):
    """A terminal's Ctrl-C reaches the workers and the queue's manager too, while the workers
    start or while they train: each job stops once (writing its checkpoint), an idle or starting
    worker ignores it, the parent stops the workers and says so once."""
    proc = _leaderboard_with_workers(tmp_path, group=True, until=when)
    kids = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted.", err
    if when == "training":
        for folder in _seed_folders(tmp_path):
            assert (folder / "checkpoint.safetensors").is_file()  # re-running resumes there
    deadline = time.monotonic() + 15
    while _alive(kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(kids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_is_one_sentence(tmp_path):
    """A pool worker killed as the out-of-memory killer would: one sentence saying so, that the
    run folder keeps what finished and to run the command again; no BrokenProcessPool trace."""
    proc = _leaderboard_with_workers(tmp_path)
    # the newest worker: the executor's own watch can miss it (it may wait on the workers it
    # knew before that one started), so the pool must notice the death itself
    os.kill(_pool_workers(proc.pid)[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in ("worker process died", "SIGKILL", "out-of-memory", "run the same command"):
        assert needle in err, (needle, err)


def test_a_job_os_error_keeps_its_path(tmp_path):
    from sharpattn.lab.sweep import run_jobs

    with pytest.raises(IsADirectoryError) as err:
        run_jobs(_write_into, [str(tmp_path)])
    assert err.value.filename == str(tmp_path) and "in job" in str(err.value)


def _write_into(path: str, progress) -> None:
    Path(path).write_text("x")


# ---------------------------------------------------------------- counts and sizes bounded


def _max_retrieval_folder(tmp_path: Path) -> Path:
    """A folder that reads as a max-retrieval run (its config.json only)."""
    from dataclasses import asdict

    from sharpattn.experiments import max_retrieval as mr

    run = tmp_path / "mr"
    write_json(run / "config.json", {"experiment": "max-retrieval", **asdict(mr.Config())})
    return run


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["corollary-b1", "RUN", "--pairs", HUGE], ["--pairs"]),
        (["corollary-b1", "RUN", "--pairs", "1000000"], ["--pairs", "GiB", "memory"]),
        (["fit-temperature", "RUN", "--sizes", str(2**31 - 1)], ["--sizes", "GiB", "memory"]),
        (["fit-temperature", "RUN", "--sets", HUGE], ["--sets"]),
        (["reproduce", "max-retrieval", "--quick", "--steps", str(10**30)], ["--steps"]),
        (["reproduce", "max-retrieval", "--quick", "--sizes", str(2**31 - 1)], ["GiB"]),
        (["leaderboard", "--quick", "--steps", str(10**30)], ["--steps"]),
        (["leaderboard", "--quick", "--eval-sets", HUGE], ["--eval-sets"]),
        (["reproduce", "clrs", "--quick", "--eval-factor", HUGE], ["--eval-factor"]),
        (["reproduce", "selective-llm", "--quick", "--steps", str(10**30)], ["--steps"]),
        (["reproduce", "selective", "--quick", "--lm-steps", HUGE], ["--lm-steps"]),
        (["reproduce", "backcopy-study", "simplified", "--steps", HUGE], ["--steps"]),
        (["llm", "--prompts", HUGE], ["--prompts"]),
        (["diagnose", "--max-items", HUGE], ["--max-items"]),
    ],
)
def test_counts_beyond_their_bound_or_memory_are_refused_at_once(argv, needles, capsys, tmp_path):
    run = _max_retrieval_folder(tmp_path)
    out = tmp_path / "out"
    extra = [] if "RUN" in argv else ["--out", str(out)]  # commands on a run take no --out
    argv = [str(run) if a == "RUN" else a for a in argv]
    started = time.perf_counter()
    assert main([*argv, *extra]) == 2
    one_sentence(capsys, *needles)
    assert time.perf_counter() - started < 30
    assert not out.exists()
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_every_count_option_has_an_upper_bound():
    """Every integer option of every command is bounded (click prints the range in --help) or
    checked against memory before any work (--rows: dispersion's estimate)."""
    import click

    from sharpattn.cli import cli

    def commands(group, prefix=()):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from commands(cmd, (*prefix, name))
            else:
                yield (*prefix, name), cmd

    unbounded = [
        (" ".join(path), p.name)
        for path, cmd in commands(cli)
        for p in cmd.params
        if isinstance(p.type, click.IntRange) and p.type.max is None and p.name != "rows"
    ]
    assert not unbounded


# ---------------------------------------------------------------- late or noisy refusals


def test_a_method_name_with_spaces_is_accepted(capsys):
    argv = ["leaderboard", "--list", "--methods", "adaptive (inference), softmax"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "*adaptive (inference)" in out and "*softmax" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["leaderboard", "--list", "--methods", "nosuch"], "'nosuch'"),
        (["leaderboard", "--list", "--tasks", "nosuch"], "'nosuch'"),
        (["reproduce", "clrs", "--list", "--tasks", "nosuch"], "'nosuch'"),
    ],
)
def test_list_refuses_unknown_names(argv, needle, capsys):
    assert main(argv) == 2
    one_sentence(capsys, needle)


def test_an_unreachable_ray_address_is_refused_before_anything_is_written(capfd, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "run"
    for address in ("127.0.0.1:1", "nosuchhost.invalid:1"):
        started = time.perf_counter()
        argv = ["leaderboard", "--quick", "--ray", address, "--out", str(out)]
        assert main(argv) == 2
        err = capfd.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"Could not connect to a Ray cluster at {address!r}" in err
        assert time.perf_counter() - started < 30
        assert not out.exists()


def test_selective_llm_targets_are_checked_before_any_work(capsys, tmp_path):
    out = tmp_path / "run"
    started = time.perf_counter()
    assert (
        main(["reproduce", "selective-llm", "--quick", "--targets", "qq", "--out", str(out)]) == 2
    )
    one_sentence(capsys, "targets", "'qq'")
    assert time.perf_counter() - started < 10  # before the model is loaded
    assert not out.exists()


def test_a_directory_where_a_run_file_belongs_is_refused_before_training(tmp_path):
    from sharpattn.lab import runner

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = []

    def batch(step):
        batches.append(step)
        return torch.ones(1, 2)

    for name in ("model.safetensors", "checkpoint.safetensors", "metrics.jsonl"):
        folder = tmp_path / name.split(".")[0]
        (folder / name).mkdir(parents=True)
        trainer = runner.Trainer(
            folder, model, opt, steps=3, batch=batch, loss=lambda m, b: m(b).sum()
        )
        with pytest.raises(ValueError, match="is a directory") as err:
            trainer.run()
        assert str(folder / name) in str(err.value)
        assert not batches  # refused before the first step
    cache = tmp_path / "cache.json"
    cache.mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        runner.once(cache, lambda: batches.append(1))
    assert not batches


def test_a_directory_where_a_file_is_written_is_named(tmp_path):
    (tmp_path / "report.md").mkdir()
    with pytest.raises(IsADirectoryError) as err:
        write_json(tmp_path / "report.md", {})
    assert err.value.filename == str(tmp_path / "report.md")
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # no temporary file left


def test_an_os_error_without_a_path_is_one_clean_line(capsys, monkeypatch):
    import sharpattn.cli as cli_module

    def broken(*a, **k):
        raise IsADirectoryError("[Errno 21] Is a directory: 'x.tmp' -> 'x'")

    monkeypatch.setattr(cli_module.cli, "main", broken)
    assert main(["list"]) == 2
    err = one_sentence(capsys, "Is a directory")
    assert "error::" not in err


def test_a_symlink_loop_as_out_is_named(capsys, tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    assert main(["demo", "--sizes", "16", "--rows", "2", "--out", str(loop)]) == 2
    one_sentence(capsys, str(loop), "symbolic link")


def test_a_binary_text_file_is_named(capsys, tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 100)
    argv = ["reproduce", "selective", "--quick", "--tasks", "lm", "--text", str(binary)]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    one_sentence(capsys, str(binary), "UTF-8")
