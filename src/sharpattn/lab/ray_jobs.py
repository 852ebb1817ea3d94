"""The Ray backend of `sweep.run_jobs`: one Ray Core task per job, progress through a
`ray.util.queue.Queue`, and the connection to a cluster (`connect`, `cluster`).

Ray is optional (``pip install -c constraints.txt -e '.[distributed]'``) and imported only when
asked for. Ray Core does the scheduling and the retries; the only socket opened here is one
connection to a ``host:port`` address before Ray is asked, so that a wrong address is one quick
sentence.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..extras import install
from .sweep import ProgressFn, WorkerDied, ignore_progress, job_error, job_label

#: Seconds the driver waits for a cluster at an address to answer (Ray's default, 30 s per
#: attempt and 20 attempts, would hang for minutes); a failed connection takes about 3× this.
#: Applies when sharpattn is the first to import Ray in this process.
CONNECT_TIMEOUT_S = 5

_LOCAL = "local"
_NOT_INSTALLED = f"Ray is not installed; {install('distributed')}"


# ---------------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------------


def _import_ray():
    if "ray" in sys.modules:
        return sys.modules["ray"]
    # Ray reads how long a driver waits for a cluster to answer once, when it is imported
    # (default 30 s per attempt); shorten it for this process only, unless the user set it
    timeout = {"RAY_py_gcs_connect_timeout_s": str(CONNECT_TIMEOUT_S)}
    try:
        with _environ(**{k: os.environ.get(k, v) for k, v in timeout.items()}):
            import ray
    except ImportError:
        raise ValueError(_NOT_INSTALLED) from None
    return ray


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def cluster(address: str = _LOCAL) -> Iterator[None]:
    """This process connected to Ray at ``address`` for the block (`connect`), so that a
    wrong address is refused before the caller writes anything; `run_jobs` inside the
    block uses the connection. Disconnects at the end if the block made the connection."""
    started = connect(address)
    try:
        yield
    finally:
        if started:
            _shutdown_quietly(_import_ray())


def _check_address(address: str) -> None:
    """Refuse at once, without Ray, a ``host:port`` / ``ray://host:port`` address whose host has
    no address or whose port takes no connection (Ray itself would retry, and log each try, for
    about ``3 * CONNECT_TIMEOUT_S``). Other addresses are left to Ray."""
    import socket

    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if address in (_LOCAL, "auto") or not sep:
        return
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Bad Ray address {address!r}: expected host:port or ray://host:port")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        why = f"no host is named {host!r}"
    else:
        why = f"nothing answers on port {port} of {host}"
        for family, kind, proto, _, where in infos:
            try:
                with socket.socket(family, kind, proto) as sock:
                    sock.settimeout(CONNECT_TIMEOUT_S)
                    sock.connect(where)
                return
            except OSError:
                continue
    raise ValueError(
        f"Could not connect to a Ray cluster at {address!r} ({why}); start one with "
        "`ray start --head` or check the address"
    )


def connect(address: str = _LOCAL, *, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray at ``address`` (see `run_jobs`) unless it already is.

    Returns True when this call made the connection (the caller shuts it down with
    ``ray.shutdown()``), False when one existed. Raises a one-sentence ``ValueError`` when Ray is
    not installed or no cluster answers at ``address`` within about ``3 * CONNECT_TIMEOUT_S``.
    """
    ray = _import_ray()
    if ray.is_initialized():
        return False
    _check_address(address)
    options: dict[str, Any] = dict(
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
        logging_level="error",
    )
    env = {
        # keep Ray's own chatter (usage notices, dedup notes) out of the user's terminal
        "RAY_USAGE_STATS_ENABLED": os.environ.get("RAY_USAGE_STATS_ENABLED", "0"),
        "RAY_DEDUP_LOGS": os.environ.get("RAY_DEDUP_LOGS", "0"),
    }
    if address == _LOCAL:
        options["num_cpus"] = num_cpus
        # workers of a local instance inherit this environment: give them our sys.path
        paths = [p for p in sys.path if p] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        options["address"] = "local"  # always a new instance, never one found on this machine
        address_arg = None
    else:
        options["address"] = address
        address_arg = address
        # bound Ray's search for the cluster (by default it retries for minutes)
        env["RAY_gcs_server_port_wait_time_s"] = os.environ.get(
            "RAY_gcs_server_port_wait_time_s", "1"
        )
        # an existing cluster's workers did not inherit our environment, even on this machine:
        # ship this sharpattn to them
        import sharpattn

        options["runtime_env"] = {"py_modules": [str(Path(sharpattn.__file__).parent)]}
    # ray.init installs its own SIGTERM handler; keep ours (the CLI turns SIGTERM into Ctrl-C)
    main = threading.current_thread() is threading.main_thread()
    old_term = signal.getsignal(signal.SIGTERM) if main else None
    try:
        with _environ(**env), _stderr_silenced():
            ray.init(**options)
    except (ConnectionError, TimeoutError, RuntimeError, OSError) as exc:
        _shutdown_quietly(ray)
        if _mentions(exc, "AuthToken", "AuthenticationError"):
            raise ValueError(
                f"The Ray cluster at {address_arg!r} refused this process's authentication token; "
                "set RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH as the cluster expects"
            ) from exc
        raise ValueError(
            f"Could not connect to a Ray cluster at {address_arg!r}"
            + (" (none is running on this machine)" if address == "auto" else "")
            + "; start one with `ray start --head` or check the address"
        ) from exc
    except ValueError as exc:
        _shutdown_quietly(ray)
        if "ray[client]" in str(exc):
            raise ValueError(
                f"Ray Client addresses such as {address!r} need pip install 'ray[client]'"
            ) from exc
        raise ValueError(f"Bad Ray address {address!r}: {str(exc).splitlines()[0]}") from exc
    finally:
        if main and old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return True


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block: Ray's core writes its warnings there
    directly ("Failed to connect to GCS ... within 5 seconds", once per try), whatever
    ``logging_level`` says; a failure to connect is our one sentence instead."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (embedded, closed): leave it
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _mentions(exc: BaseException | None, *words: str) -> bool:
    """Whether ``exc`` or an exception it was raised from mentions any of ``words``."""
    seen = 0
    while exc is not None and seen < 10:
        text = f"{type(exc).__name__} {exc}"
        if any(w in text for w in words):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _shutdown_quietly(ray) -> None:
    with contextlib.suppress(Exception):
        ray.shutdown()


class _RayProgress:
    """A job's progress callable on Ray: puts each event on the driver's queue."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __call__(self, event: dict[str, Any]) -> None:
        self.queue.put(event)


def _ray_call(fn: Callable, job: Any, queue: Any) -> Any:
    return fn(job, _RayProgress(queue) if queue is not None else ignore_progress)


def run_ray(
    fn: Callable, jobs: list, address: str, progress: ProgressFn | None, retries: int
) -> list:
    ray = _import_ray()
    started = connect(address)
    try:
        from ray.exceptions import RayError, RayTaskError
        from ray.util.queue import Queue

        # the queue actor takes no CPU while it runs, so it never holds up a job
        queue = Queue(actor_options={"num_cpus": 0}) if progress is not None else None
        task = ray.remote(max_retries=retries, num_cpus=1)(_ray_call)
        fn_ref = ray.put(fn)
        refs = [task.remote(fn_ref, job, queue) for job in jobs]
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)

        def drain() -> None:
            if queue is None:
                return
            n = queue.qsize()
            if n:
                for event in queue.get_nowait_batch(n):
                    progress(event)  # type: ignore[misc]

        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=0.1)
                drain()
                for ref in done:
                    i = index[ref]
                    try:
                        results[i] = ray.get(ref)
                    except RayTaskError as exc:  # fn raised: re-raise its own exception type
                        cause = exc.cause if exc.cause is not None else exc
                        raise job_error(cause, jobs[i]) from cause
                    except RayError as exc:  # the worker died more often than `retries`
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                        raise WorkerDied(
                            f"Ray could not run job {job_label(jobs[i])} "
                            f"({type(exc).__name__}: {first.rstrip('.')})"
                        ) from exc
            drain()
        except BaseException:  # Ctrl-C, SIGTERM (as KeyboardInterrupt), a failed job
            for ref in pending:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            raise
        finally:
            if queue is not None:
                with contextlib.suppress(Exception):
                    queue.shutdown()
        return [results[i] for i in range(len(jobs))]
    finally:
        if started:
            _shutdown_quietly(ray)
