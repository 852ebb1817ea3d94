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

from processes import sharpattn, wait_until_in_main
from sharpattn.cli import main
from sharpattn.experiments import checkpoint as ckpt
from sharpattn.experiments.runs import write_json

HUGE = "1000000000000"


def one_sentence(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


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


def test_cli_run_with_a_damaged_checkpoint_and_a_damaged_model(capsys, tmp_path):
    out = tmp_path / "run"
    argv = ["reproduce", "max-retrieval", "--quick", "--steps", "4", "--sizes", "16"]
    argv += ["--test-sets", "4", "--checkpoint-every", "2", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    model = out / "train" / "seed0" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])  # a finished model, truncated
    shutil.rmtree(out / "eval")  # so the model is read again
    assert main(argv) == 2
    one_sentence(capsys, str(model), "is damaged")


# ---------------------------------------------------------------- item 13


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "terminated")])  # fmt: skip
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
    proc.communicate(timeout=30)  # the parent itself stops promptly
    assert proc.returncode == code
    deadline = time.monotonic() + 15
    while _alive(kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(kids), "worker processes outlived their parent"
