"""run_jobs: the same sweep gives the same table in-process, on a spawn pool and on a real local
Ray instance; Ray retries a job whose worker is killed; progress and errors reach the caller."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from sharpattn.lab import ray_jobs, sweep
from sharpattn.lab.runner import threads
from sharpattn.lab.sweep import run_jobs

SRC = Path(sweep.__file__).resolve().parents[2]
JOBS = [
    {"seed": s, "method": m, "size": n}
    for s in (0, 1)
    for m in ("softmax", "sigmoid")
    for n in (4, 16)
]


def train_tiny(job: dict, progress) -> dict:
    """Fit one attention layer for a few steps from a seed: deterministic on CPU, one thread."""
    from sharpattn import normalizers as nz

    with threads(1):  # restored after: in-process jobs run in the test's own process
        g = torch.Generator().manual_seed(job["seed"])
        x = torch.randn(8, job["size"], 6, generator=g)
        target = x.max(dim=1).values
        q = torch.nn.Parameter(torch.randn(6, generator=g) * 0.1)
        w = torch.nn.Parameter(torch.randn(6, 6, generator=g) * 0.1)
        opt = torch.optim.SGD([q, w], lr=0.1)
        steps = 5
        for step in range(steps):
            weights = nz.get(job["method"])(x @ q)
            out = torch.einsum("bn,bnd->bd", weights, x @ w)
            loss = ((out - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            progress(
                {
                    "task": f"{job['method']}/{job['seed']}/{job['size']}",
                    "phase": "train",
                    "step": step + 1,
                    "total": steps,
                    "loss": float(loss.detach()),
                }
            )
        return {**job, "loss": float(loss.detach()), "q0": float(q.detach()[0])}


def die_once(job: dict, progress) -> dict:
    """The first attempt of job 1 kills its own worker process (as an OOM kill would)."""
    marker = Path(job["marker"])
    if job["seed"] == 1 and not marker.exists():
        marker.write_text("killed once")
        os.kill(os.getpid(), signal.SIGKILL)
    return train_tiny({k: v for k, v in job.items() if k != "marker"}, progress)


def fail_on_seed_one(job: dict, progress) -> dict:
    if job["seed"] == 1:
        raise ValueError("the size must be positive")
    return train_tiny(job, progress)


@pytest.fixture(scope="module", autouse=True)
def unreachable():
    """run_jobs(ray='nonsense:1') in a fresh interpreter (this one may be connected to the
    module's Ray instance), started first so that its waiting overlaps the other tests."""
    code = (
        "import time\n"
        "start = time.monotonic()\n"
        "from sharpattn.lab.sweep import run_jobs\n"
        "try:\n"
        "    run_jobs(print, [1], ray='nonsense:1')\n"
        "except ValueError as e:\n"
        "    print('VALUEERROR', e)\n"
        "print('SECONDS', time.monotonic() - start)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    yield proc, time.monotonic()
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def local_table():
    return run_jobs(train_tiny, JOBS)


@pytest.fixture(scope="module")
def ray_local():
    """One real local Ray instance (2 CPUs) for the module."""
    ray = pytest.importorskip("ray")  # the dev extra installs it; `make test` always runs these
    started = ray_jobs.connect("local", num_cpus=2)
    yield ray
    if started:
        ray.shutdown()


def test_in_process_table_is_deterministic(local_table):
    assert len(local_table) == len(JOBS)
    assert [{k: r[k] for k in ("seed", "method", "size")} for r in local_table] == JOBS
    assert run_jobs(train_tiny, JOBS[:2]) == local_table[:2]


def test_pool_gives_the_same_table_and_forwards_progress(local_table):
    events: list[dict] = []
    table = run_jobs(train_tiny, JOBS, workers=2, progress=events.append)
    assert table == local_table
    assert len(events) == 5 * len(JOBS)
    assert {e["task"] for e in events} == {f"{j['method']}/{j['seed']}/{j['size']}" for j in JOBS}
    assert all(e["phase"] == "train" and e["total"] == 5 for e in events)


def test_ray_gives_the_same_table_and_forwards_progress(ray_local, local_table):
    events: list[dict] = []
    table = run_jobs(train_tiny, JOBS, ray="auto", progress=events.append)
    assert table == local_table
    assert len(events) == 5 * len(JOBS)
    assert sorted(e["step"] for e in events if e["task"] == "softmax/0/4") == [1, 2, 3, 4, 5]


def test_ray_retries_a_job_whose_worker_is_killed(ray_local, local_table, tmp_path):
    marker = tmp_path / "killed"
    jobs = [{**j, "marker": str(marker)} for j in JOBS[:2] + JOBS[4:6]]
    table = run_jobs(die_once, jobs, ray="auto", retries=2)
    assert marker.exists()  # the kill happened, and the retry finished the job
    assert table == local_table[:2] + local_table[4:6]


def test_ray_worker_killed_more_often_than_retries_fails_naming_the_job(ray_local, tmp_path):
    marker = tmp_path / "killed"
    with pytest.raises(RuntimeError, match="seed=1"):
        run_jobs(die_once, [{**JOBS[4], "marker": str(marker)}], ray="auto", retries=0)


@pytest.mark.parametrize("backend", ["in-process", "pool", "ray"])
def test_job_value_error_stays_a_value_error_naming_the_job(backend, request):
    kwargs = {"in-process": {}, "pool": {"workers": 2}, "ray": {"ray": "auto"}}[backend]
    if backend == "ray":
        request.getfixturevalue("ray_local")
    with pytest.raises(ValueError, match=r"the size must be positive \(in job seed=1, method"):
        run_jobs(fail_on_seed_one, JOBS[:1] + JOBS[4:5], **kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="workers"):
        run_jobs(train_tiny, JOBS, workers=0)
    assert run_jobs(train_tiny, []) == []


def test_unreachable_address_is_one_quick_sentence(unreachable):
    proc, start = unreachable
    # A hang guard, not a speed target: Ray alone keeps trying for ~10 minutes (600 s); ours gives
    # up after ~3 × CONNECT_TIMEOUT_S (16 s) plus start-up, which a saturated 2-core machine
    # stretched to 193 s once: the bound sits between the two. It is the process's own time:
    # the module's other tests run while it waits, and a loaded machine stretches them.
    out, err = proc.communicate(timeout=max(1.0, 400 - (time.monotonic() - start)))
    (seconds,) = [float(s.split()[1]) for s in out.splitlines() if s.startswith("SECONDS")]
    assert seconds < 400
    line = [s for s in out.splitlines() if s.startswith("VALUEERROR")]
    assert line, out + err
    assert "Could not connect to a Ray cluster at 'nonsense:1'" in line[0]
    assert line[0].count(". ") == 0


# ---------------------------------------------------------------- SIGTERM to the process group


@pytest.fixture
def signal_handlers():
    """SIGINT's and SIGTERM's handlers restored after the test."""
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in old.items():
        signal.signal(s, handler)


def _forked(parent: int | None) -> tuple[int, int]:
    """A child process with an idle pool worker's signals (its parent taken to be ``parent``),
    returned with its pid once they are installed, and a pipe's read end it holds open."""
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12 warns of fork in a process with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: signals only, then waits to be signalled
        try:
            sweep._parent = parent
            sweep._idle_signals()
            os.write(write, b"ready")
            # Short sleeps: the child may hold a thread of torch's (seen: a thread pool's
            # worker), and a signal the kernel hands to it does not end the main thread's
            # sleep; Python runs the handler once the main thread next wakes.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 5) == b"ready"
    return pid, read


def _exit_after(pid: int, seconds: float) -> int | None:
    """The child's wait status once it ends within ``seconds``, else None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child")
def test_an_idle_worker_ignores_sigterm_while_its_parent_lives(signal_handlers):
    """``timeout`` sends SIGTERM to every process of its group: an idle worker and the progress
    manager ignore it, as Ctrl-C, for the parent stops them itself (a manager gone first left
    each worker a queue it could not reach, and a 27-line ConnectionRefusedError); sent by the
    kernel after the parent died (`die_with_parent`), it ends the process at once, quietly."""
    pid, pipe = _forked(os.getpid())
    try:
        os.kill(pid, signal.SIGTERM)
        assert _exit_after(pid, 0.5) is None  # still there
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):  # ended already
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(pipe)
    pid, pipe = _forked(-1)  # a parent that is not its parent: the parent died
    os.kill(pid, signal.SIGTERM)
    status = _exit_after(pid, 10)
    os.close(pipe)
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1


def test_a_job_stops_once_on_sigint_or_sigterm(signal_handlers):
    """In a job, Ctrl-C or SIGTERM interrupts it once (a training job checkpoints); then the
    worker is idle again: Ctrl-C ignored, SIGTERM as `_term_idle` has it."""
    seen = {}

    def job(_, progress):
        seen["term"] = signal.getsignal(signal.SIGTERM)
        seen["int"] = signal.getsignal(signal.SIGINT)
        return 1

    assert sweep._pool_call(job, None, None) == 1
    assert seen == {"term": sweep._interrupt_once, "int": sweep._interrupt_once}
    assert signal.getsignal(signal.SIGTERM) is sweep._term_idle
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    signal.signal(signal.SIGTERM, sweep._interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        sweep._interrupt_once(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) is sweep._term_idle  # a second one: not again
