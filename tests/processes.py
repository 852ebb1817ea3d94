"""The `sharpattn` command in a real process, killed with SIGKILL mid-run: the resume tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_MAIN = "import sys; from sharpattn.cli import main; sys.exit(main(sys.argv[1:]))"


def ctrl_c_as_at_a_terminal() -> None:
    """A child's ``preexec_fn``: SIGINT with its default action, as a shell's foreground job has
    it, whatever the test runner inherited (``nohup`` and background jobs of a non-interactive
    shell ignore SIGINT, and a child inherits that, so Ctrl-C tests could not interrupt it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


#: the child's pretrained models are :func:`tiny_hf.pretrained`, and its global torch generator
#: starts from an arbitrary state (what a command does not seed itself differs between runs)
_TINY = (
    "import os, sys; sys.path.insert(0, {tests!r}); import tiny_hf, torch; "
    "tiny_hf.stand_in_for_pretrained(); torch.manual_seed(int.from_bytes(os.urandom(7), 'big')); "
)


def sharpattn(*args: str, tiny_pretrained: bool = False, group: bool = False) -> subprocess.Popen:
    """``sharpattn ARGS`` in a child process on one OpenMP thread (stdout dropped, stderr piped),
    Ctrl-C reaching it as at a terminal; ``tiny_pretrained``: on tests/tiny_hf.py's models.
    ``group``: the child leads a process group of its own, as a shell's foreground job does, so
    ``os.killpg(proc.pid, SIGINT)`` is a terminal's Ctrl-C (the child and every process it
    started) without reaching the test runner."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = (
        _TINY.format(tests=str(Path(__file__).resolve().parent)) + _MAIN
        if tiny_pretrained
        else _MAIN
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
        process_group=0 if group else None,
    )


def kill_9_once_written(proc: subprocess.Popen, path: Path, timeout: float = 300) -> None:
    """``kill -9`` ``proc`` as soon as ``path`` exists (a checkpoint: mid-run, after it); fails
    if the process ended first or never wrote it."""
    deadline = time.monotonic() + timeout
    while not Path(path).exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    err = proc.stderr.read() if proc.stderr is not None else ""
    assert proc.returncode == -9, f"the run ended before it could be killed: {err}"
    assert Path(path).exists(), "killed before it wrote a checkpoint"


def wait_until_in_main(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the ``sharpattn`` child is inside ``cli.main`` — it has installed its SIGTERM
    handler (bit 15 of ``SigCgt`` in /proc/PID/status), so imports are over — however long a
    loaded machine takes to start it. A signal sent earlier would meet Python's start-up, not the
    program."""
    deadline = time.monotonic() + timeout
    status = Path(f"/proc/{proc.pid}/status")
    while time.monotonic() < deadline and proc.poll() is None:
        for line in status.read_text().splitlines():
            if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
                return
        time.sleep(0.02)
    raise AssertionError(f"the child did not reach cli.main in {timeout} s (exit {proc.poll()})")


def same_fine_tunings(a: Path, b: Path, trainings: list[str]) -> None:
    """Two run folders hold the same numbers: ``metrics.json`` without its timings (as text, so
    NaN p-values compare equal), and each training's log and trained weights (``trainings``:
    their sub-folders)."""
    import json

    import torch
    from safetensors.torch import load_file

    timing = ("seconds", "steps_per_s", "wall_seconds", "cpu_seconds")

    def untimed(folder: Path) -> str:
        m = json.loads(
            (folder / "metrics.json").read_text(),
            object_hook=lambda d: {k: v for k, v in d.items() if k not in timing},
        )
        return json.dumps(m, sort_keys=True)

    assert untimed(a) == untimed(b)
    for t in trainings:
        assert (a / t / "metrics.jsonl").read_text() == (b / t / "metrics.jsonl").read_text()
        wa, wb = (load_file(p / t / "model.safetensors") for p in (a, b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    steps = [
        json.loads(line)["step"]
        for line in (a / trainings[0] / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == sorted(set(steps))  # no step logged twice after a resume


def killed_and_whole(args: list[str], tmp_path: Path, checkpoint: str, monkeypatch) -> None:
    """``sharpattn ARGS`` on tests/tiny_hf.py's models killed with ``kill -9`` once
    ``checkpoint`` (a path in its run folder) is written, then the command again in this process
    to finish that folder ("killed") and an uninterrupted run ("whole"), each after another
    state of the global generator."""
    import torch

    import tiny_hf
    from sharpattn.cli import main
    from sharpattn.integrations import pretrained

    killed = sharpattn(*args, "--out", str(tmp_path / "killed"), tiny_pretrained=True)
    kill_9_once_written(killed, tmp_path / "killed" / checkpoint)
    monkeypatch.setattr(pretrained, "load_pretrained", tiny_hf.pretrained)
    for i, out in enumerate(("killed", "whole")):
        torch.manual_seed(i)
        assert main([*args, "--out", str(tmp_path / out)]) == 0
