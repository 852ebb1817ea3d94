"""Run a sweep of independent jobs (seeds × methods × sizes) here, on a local process pool, or on
a Ray cluster.

`run_jobs` is the one entry point::

    results = run_jobs(train_one, jobs, workers=4, progress=bar)   # local spawn pool
    results = run_jobs(train_one, jobs, ray="auto", progress=bar)  # the running Ray cluster

``fn(job, progress)`` must be a picklable top-level function and every job a picklable object
(a dataclass or a dict). Results come back in the order of ``jobs`` whichever backend ran them,
so a deterministic job gives the same table everywhere.

Progress events (``{"task", "phase", "step", "total"}`` plus optional ``"loss"``, ``"note"``)
that a job sends through its ``progress`` argument reach the caller's ``progress`` callable:
through a manager queue on the local pool, through a `ray.util.queue.Queue` on Ray.

Ray is optional (``pip install -c constraints.txt -e '.[distributed]'``) and imported only when asked for.
Ray Core does the scheduling and the retries; the only socket opened here is one connection to a
``host:port`` address before Ray is asked, so that a wrong address is one quick sentence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ProgressFn = Callable[[dict[str, Any]], None]


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------


def run_jobs(
    fn: Callable[[Any, ProgressFn], Any],
    jobs: Sequence[Any],
    *,
    workers: int = 1,
    ray: str | None = None,
    progress: ProgressFn | None = None,
    retries: int = 3,
) -> list:
    """Call ``fn(job, progress)`` for every job and return the results in the order of ``jobs``.

    - ``workers == 1`` and ``ray is None``: in this process, one job after another.
    - ``workers > 1``: a local spawn-context process pool of ``workers`` processes. The workers
      exit with this process, even when it is killed with ``kill -9`` (`die_with_parent`).
    - ``ray`` set: one Ray Core task per job (``max_retries=retries``: a task whose worker process
      dies is run again; an exception raised by ``fn`` is not retried). ``ray`` is
      ``"auto"`` (the cluster this machine is part of, as ``ray start`` left it), an address
      ``"host:port"`` or ``"ray://host:port"`` (Ray Client, needs ``ray[client]``), or
      ``"local"`` (start a private local instance for this call). If this process is already
      connected to Ray (``ray.init`` was called, e.g. by `connect`), that connection is
      used whatever ``ray`` says, and left open.

    Same code on every worker: a local instance started here passes this interpreter's
    ``sys.path`` to its workers through ``PYTHONPATH``; an existing cluster (``auto`` or an
    address, on this machine or not: its workers never inherit this process's environment) gets
    this ``sharpattn`` package directory shipped as ``runtime_env={"py_modules": [...]}``. The
    cluster's Python still needs torch and sharpattn's other dependencies, and ``fn`` must be
    importable there (a function of ``sharpattn`` or of a script's ``__main__``, which Ray
    pickles by value).

    ``progress`` receives every job's events in this process. Ctrl-C / SIGTERM (as
    ``KeyboardInterrupt``) interrupts every running local job once (a training job writes its
    checkpoint) and stops the workers within ``STOP_GRACE_S``, or cancels every unfinished Ray
    task (``ray.cancel(ref, force=True)``), before re-raising. An interrupted worker does not
    report it (a terminal sends Ctrl-C to every process of the group; an idle worker and the
    progress queue's process ignore it): the interrupt is reported once, here. An exception
    raised by a job is raised here with the job named; its
    type is kept when it can be (a ``ValueError`` stays one, an ``OSError`` keeps its path). A
    worker process that dies (killed by the out-of-memory killer, ``kill -9``) raises
    `WorkerDied`, on Ray once it has died more often than ``retries``.
    """
    jobs = list(jobs)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if retries < 0:
        raise ValueError(f"retries must be at least 0, got {retries}")
    if ray is not None:
        from .ray_jobs import run_ray  # Ray is optional: imported only when asked for

        return run_ray(fn, jobs, ray, progress, retries)
    if workers == 1 or len(jobs) <= 1:
        report = progress if progress is not None else ignore_progress
        results = []
        for job in jobs:
            try:
                results.append(fn(job, report))
            except Exception as exc:
                raise job_error(exc, job) from exc
        return results
    return _run_pool(fn, jobs, workers, progress)


def ignore_progress(event: dict[str, Any]) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Errors name the job
# ---------------------------------------------------------------------------------------------


def job_label(job: Any) -> str:
    """A short name for a job: its ``name`` if it has one, else ``key=value`` of its scalar
    fields (a dataclass or a dict), else its ``repr``; at most 100 characters."""
    name = job.get("name") if isinstance(job, dict) else getattr(job, "name", None)
    if isinstance(name, str):
        text = name
    else:
        if dataclasses.is_dataclass(job) and not isinstance(job, type):
            items = [(f.name, getattr(job, f.name)) for f in dataclasses.fields(job)]
        elif isinstance(job, dict):
            items = list(job.items())
        else:
            items = None
        if items is None:
            text = repr(job)
        else:
            scalars = (str, int, float, bool, type(None))
            text = ", ".join(f"{k}={v}" for k, v in items if isinstance(v, scalars))
    return text if len(text) <= 100 else text[:97] + "..."


class WorkerDied(RuntimeError):
    """A worker process ended before its job did (the out-of-memory killer, ``kill -9``): one
    sentence naming the job where it is known. The jobs that finished are whatever they wrote."""


def job_error(exc: BaseException, job: Any) -> Exception:
    """``exc`` again, as the same type when it takes one message, with the job in the message
    (an ``OSError`` keeps its errno and paths)."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f" (in job {job_label(job)})"
        try:
            return type(exc)(exc.errno, exc.strerror + where, exc.filename, None, exc.filename2)
        except Exception:
            pass
    message = f"{str(exc).rstrip('.')} (in job {job_label(job)})"
    try:
        new = type(exc)(message)
        if str(new) == message and isinstance(new, Exception):
            return new
    except Exception:
        pass
    return RuntimeError(f"{type(exc).__name__}: {message}")


# ---------------------------------------------------------------------------------------------
# Local process pool
# ---------------------------------------------------------------------------------------------


#: seconds an interrupted pool gives its workers to stop their jobs (a training job writes its
#: checkpoint first) before it terminates them
STOP_GRACE_S = 10.0


def _pool_call(fn: Callable, job: Any, queue: Any) -> Any:
    """A job in a pool worker: Ctrl-C or SIGTERM (from the terminal or ``timeout``, to the whole
    process group, or forwarded by the parent as Ctrl-C) interrupts it once, as
    ``KeyboardInterrupt``, so a training job checkpoints; the pool sends the interrupted job
    back as its result, and an idle worker ignores both (`worker_init`)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.signal(signal.SIGINT, _interrupt_once)
        signal.signal(signal.SIGTERM, _interrupt_once)
    try:
        return fn(job, queue.put if queue is not None else ignore_progress)
    finally:
        if main:
            _idle_signals()


def _interrupt_once(signum: int, frame: Any) -> None:
    if _orphaned():  # the parent is gone (killed with kill -9): nothing to checkpoint for
        os._exit(1)
    _idle_signals()  # a second Ctrl-C must not cut the checkpoint
    raise KeyboardInterrupt


#: the parent of this worker process (`worker_init`); None in any other process
_parent: int | None = None


def _orphaned() -> bool:
    return _parent is not None and os.getppid() != _parent


def _idle_signals() -> None:
    """An idle worker's (and the progress manager's) signals: Ctrl-C ignored, SIGTERM too while
    the parent lives (`_term_idle`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _term_idle)


def _term_idle(signum: int, frame: Any) -> None:
    """SIGTERM in an idle worker or the progress manager: sent to the whole process group
    (``timeout``, a service manager), it is ignored as Ctrl-C is, for the parent, which has it
    too, stops its workers and the manager itself (a manager gone first would leave the workers
    a progress queue they cannot reach); sent by the kernel when the parent died
    (`die_with_parent`), the process exits at once, quietly."""
    if _orphaned():
        os._exit(1)


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the process that removes the pool's semaphores
    once every user of them is gone) told to do so silently: after a ``kill -9`` of this
    process it would print "There appear to be N leaked semaphore objects" at the end of a
    run it has cleaned up properly."""
    from multiprocessing import resource_tracker

    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{before},{quiet}" if before else quiet
    try:
        resource_tracker.ensure_running()  # it reads PYTHONWARNINGS once, as it starts
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before


def _run_pool(fn: Callable, jobs: list, workers: int, progress: ProgressFn | None) -> list:
    import multiprocessing as mp
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing.managers import SyncManager

    ctx = mp.get_context("spawn")
    _quiet_resource_tracker()
    manager = None
    queue = None
    if progress is not None:
        manager = SyncManager(ctx=ctx)
        with _sigint_held():
            manager.start(worker_init)
    pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=worker_init)
    results: dict[int, Any] = {}
    procs: list = []
    try:
        if manager is not None:
            queue = manager.Queue()
        with _sigint_held():  # the workers start here (one per submit, up to `workers`)
            futures = {pool.submit(_pool_call, fn, job, queue): i for i, job in enumerate(jobs)}
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pending = set(futures)

        def drain() -> None:
            try:
                while queue is not None and not queue.empty():
                    progress(queue.get())  # type: ignore[misc]
            except (EOFError, ConnectionError):  # the manager process is gone
                dead = [getattr(manager, "_process", None)]
                raise _worker_died(dead, "the process forwarding the jobs' progress") from None

        while pending:
            drain()
            # a worker that died is noticed here, not left to the executor: with the spawn
            # context it starts workers after waking its management thread, which can then wait
            # on a list of workers without the newest and never learn that it died
            live = list((getattr(pool, "_processes", None) or {}).values())
            procs += [p for p in live if p not in procs]
            if any(p.exitcode is not None for p in procs):
                raise _worker_died(procs)
            for f in [f for f in pending if f.done()]:
                i = futures[f]
                pending.discard(f)
                exc = f.exception()
                if isinstance(exc, BrokenProcessPool):
                    _reap(procs, 2.0)
                    raise _worker_died(procs) from None
                if exc is not None:
                    raise job_error(exc, jobs[i]) from exc
                results[i] = f.result()
            if pending:
                time.sleep(0.05)
        drain()
    except BaseException as exc:  # Ctrl-C, SIGTERM (as KeyboardInterrupt by the CLI), an error
        procs += list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        try:
            if isinstance(exc, KeyboardInterrupt):  # the jobs stop as they would alone
                _interrupt(procs, STOP_GRACE_S)
        finally:
            for proc in procs:  # otherwise (or past the grace period, or a second Ctrl-C) now:
                if proc.exitcode is None:  # killed, for a worker ignores SIGTERM (`_term_idle`)
                    proc.kill()
        raise
    finally:
        pool.shutdown(wait=True)
        if manager is not None:
            manager.shutdown()
    return [results[i] for i in range(len(jobs))]


def _interrupt(procs: list, grace: float) -> None:
    """Ctrl-C to each live worker (a terminal has sent it already; a signal to this process
    alone has not), then wait up to ``grace`` seconds for them to end their jobs and exit."""
    for proc in procs:
        if proc.exitcode is None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def _reap(procs: list, timeout: float) -> None:
    """Wait up to ``timeout`` seconds until one of ``procs`` has an exit code (a broken pool
    can be reported before its dead worker is reaped, and the sentence says how it died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.exitcode is None for p in procs):
        time.sleep(0.01)


def _worker_died(procs: list, who: str = "a worker process") -> WorkerDied:
    """The sentence for a pool whose worker process died, with how it died where that is known
    (a pool breaks for every job at once, so which job it ran is not)."""
    codes = [p.exitcode for p in procs if p is not None and p.exitcode not in (None, 0)]
    # the pool terminates (SIGTERM) the other workers once one has died: name the first death
    code = next((c for c in codes if c != -signal.SIGTERM), codes[0] if codes else None)
    how = ""
    if code is not None and code < 0:
        try:
            how = f" (killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f" (killed by signal {-code}"
        how += ", as the out-of-memory killer does)"
    elif code is not None:
        how = f" (exit code {code})"
    return WorkerDied(f"{who} died{how} before the jobs finished")


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Block SIGINT in this thread while worker processes start: they inherit the blocked
    signal and `worker_init` ignores it before unblocking, so a Ctrl-C during their start
    never reaches their Python start-up as a ``KeyboardInterrupt``; here it is delivered when the
    block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def worker_init() -> None:
    """In a local worker (or the progress queue's manager) process: ignore Ctrl-C, which a
    terminal sends to every process of the foreground group, and SIGTERM, which ``timeout``
    sends to every process of its group (`_term_idle`); the parent stops its workers itself and
    reports the interrupt once. Then `die_with_parent`."""
    global _parent
    _parent = os.getppid()
    _idle_signals()  # SIGINT ignored: also discards one pending from start-up
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent()


def die_with_parent() -> None:
    """In a worker process: exit when the parent dies, even by ``kill -9`` (Linux asks the kernel
    to send SIGTERM then; elsewhere a thread polls the parent's pid)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
