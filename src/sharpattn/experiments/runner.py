"""The one runner every experiment uses: run folders, seeds, threads, progress events, training.

An experiment is a configuration, a model, batches and its measures; everything around them lives
here (minGPT's ``Trainer`` for the loop and its callbacks, nanoGPT's resume):

* `RunFolder` — one folder per run. ``config.json`` is written once; a folder holding a
  run of another configuration is refused in one sentence; ``metrics.jsonl`` is appended.
* `seed_int` / `generator` — one seeding scheme: a ``numpy.random.SeedSequence`` per
  (seed, purpose, ...), so streams for initialisation, data, probes and test sets never overlap
  and never depend on the global RNG.
* `threads` — one thread policy (torch intra-op threads for a block, restored after), which
  also applies the process's allocator policy (`keep_freed_memory`).
* `emit` — one progress-event protocol: plain dicts ``{"task", "phase", "step", "total"}``
  plus optional ``"loss"`` / ``"note"``, which one CLI renderer draws and worker processes can
  pickle.
* `Trainer` — one training loop: batches from generators it checkpoints, the loss of one
  model or of an ensemble (a vector, one loss per member, summed for the backward pass), an
  optional learning-rate schedule (a function of the step, so nothing to checkpoint) and gradient
  clipping, logging callbacks into ``metrics.jsonl``, atomic safetensors checkpoints every
  ``checkpoint_every`` steps and on Ctrl-C, and resume: re-running after ``kill -9`` continues
  from the last checkpoint and ends with the same numbers as an uninterrupted run.
* `Clock` — one timing tool: wall and process CPU seconds since it started, read at any
  point of a run (a phase's end) or frozen at the end of a ``with`` block.
* `write_metrics` — one way to write a run's ``metrics.json`` (or the result file of
  another name a run keeps), atomically.
* `once` — a JSON result computed once per run folder (an evaluation of trained weights).
* `profile_settings` — one profile mechanism: a command's named profiles (``--quick``,
  ``--paper``, ...) are a dict of settings, resolved with the command's overrides.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import json
import math
import os
import platform
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import damaged as checkpoint_damaged
from .checkpoint import load_checkpoint, save_checkpoint
from .runs import CODE_VERSIONS, damaged, make_dir, mismatch, read_json, write_atomic, write_json

Tensor = torch.Tensor
Progress = Callable[[dict[str, Any]], None]

# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------


def seed_int(*key: int) -> int:
    """A 63-bit seed for one purpose of one run seed: ``SeedSequence(key)``'s first 64 bits,
    halved (torch takes seeds below 2⁶³). Distinct keys give independent streams."""
    if not key:
        raise ValueError("seed_int needs at least one integer.")
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint32)
    return int(state.view(np.uint64)[0] >> 1)


def generator(*key: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with `seed_int` of ``key``."""
    return torch.Generator().manual_seed(seed_int(*key))


def numpy_generator(*key: int) -> np.random.Generator:
    """A NumPy ``Generator`` seeded with `seed_int` of ``key``."""
    return np.random.default_rng(seed_int(*key))


@contextlib.contextmanager
def seeded(*key: int) -> Iterator[None]:
    """Run the block with the global torch RNG seeded from ``key`` (for code that draws from it,
    such as ``nn.Module`` initialisation), then restore the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_int(*key))
        yield


# ---------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def free_cores() -> tuple[int, float | None]:
    """``(n, load)``: the cores this process may run on that nothing else is using now, and the
    1-minute load average it was judged by: `cores` minus the load, rounded, at least 1 and at
    most `cores` (all of them where the system reports no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not Unix
        return cores(), None
    return min(cores(), max(1, round(cores() - load))), load


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap (glibc's maximum dynamic value)
TRIM_THRESHOLD = 256 << 20  # freed heap kept before it is returned to the system


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's allocator keep freed memory for the next allocation (once per process).

    A training step allocates and frees the same few-MiB activations and gradients every step.
    With glibc's defaults each of them is a fresh ``mmap`` (or heap growth after a trim) whose
    pages the kernel faults in and zeroes again: ~1,400 page faults per max-retrieval step, 7-9 %
    of its CPU time in the kernel. Serving blocks below `MMAP_THRESHOLD` from the heap and
    keeping up to `TRIM_THRESHOLD` of it freed removes them (``benchmarks/batched_seeds.py``
    reports the system time). Larger blocks (a long evaluation's score chunks) are still
    ``mmap``-ed and returned when freed. The setting is process-wide, so only the experiment
    runner applies it (through `threads`), never the library's functions. Returns whether
    it applied (False off glibc, where it does nothing)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


@contextlib.contextmanager
def threads(n: int | None = None) -> Iterator[int]:
    """Run the block with ``n`` torch intra-op threads (default: every core), then restore; the
    process keeps freed memory for reuse from then on (`keep_freed_memory`)."""
    keep_freed_memory()
    old = torch.get_num_threads()
    n = cores() if n is None else max(1, int(n))
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------------------------------------
# Progress events
# ---------------------------------------------------------------------------------------------


def event(task: str, phase: str, step: int, total: int, **fields: Any) -> dict[str, Any]:
    """One progress event: ``task`` (a bar's name, e.g. "seeds 0-9"), ``phase`` ("train",
    "eval n=16", "done", ...), ``step`` of ``total``, and optional ``loss`` / ``note``."""
    return {
        "task": str(task),
        "phase": str(phase),
        "step": int(step),
        "total": int(total),
        **fields,
    }


def emit(progress: Progress | None, task: str, phase: str, step: int, total: int, **fields) -> None:
    """Send `event` to ``progress`` if there is one."""
    if progress is not None:
        progress(event(task, phase, step, total, **fields))


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Clock:
    """Seconds since it started: ``wall`` (``time.perf_counter``) and ``cpu`` (this process's CPU
    time, every thread, user and system: ``time.process_time``).

    ``clock = Clock()`` starts now; reading ``clock.wall`` / ``clock.cpu`` gives the seconds so
    far, so reading them where a phase ends marks it (a later phase is the difference of two
    reads). ``with Clock() as clock:`` stops it when the block ends (also on an exception);
    it then reads the block's seconds for good. `stop` does the same without a block."""

    def __init__(self) -> None:
        self._start = (time.perf_counter(), time.process_time())
        self._end: tuple[float, float] | None = None

    def __enter__(self) -> Clock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> Clock:
        """Freeze the clock (a second stop keeps the first time)."""
        if self._end is None:
            self._end = (time.perf_counter(), time.process_time())
        return self

    @property
    def wall(self) -> float:
        """Wall-clock seconds since the start (until `stop`)."""
        return (time.perf_counter() if self._end is None else self._end[0]) - self._start[0]

    @property
    def cpu(self) -> float:
        """CPU seconds of this process since the start (until `stop`)."""
        return (time.process_time() if self._end is None else self._end[1]) - self._start[1]


# ---------------------------------------------------------------------------------------------
# When to measure
# ---------------------------------------------------------------------------------------------


def log_steps(total: int, n: int, linear_until: int = 0, linear_every: int = 1) -> list[int]:
    """Steps to measure at (``Trainer(log_at=...)``): 0, every ``linear_every`` steps up to
    ``linear_until``, then about ``n`` log-spaced steps from ``max(linear_until, 1)`` to
    ``total``; always ``total``. ``linear_until=0``: log-spaced from step 1 (Fig. 4b's axis);
    ``linear_until=400``: a linear axis to 400 and a log one after it (Fig. 18's)."""
    if total < 0 or n < 1 or linear_until < 0 or linear_every < 1:
        raise ValueError(
            f"need total >= 0, n >= 1, linear_until >= 0 and linear_every >= 1, got {total}, "
            f"{n}, {linear_until} and {linear_every}."
        )
    start = min(max(linear_until, 1), max(total, 1))
    grid = np.unique(np.round(np.geomspace(start, max(total, 1), max(n, 2))).astype(int))
    linear = range(0, min(linear_until, total) + 1, linear_every)
    return sorted({0, *linear, *(int(s) for s in grid if s <= total), total})


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------


def profile_settings(
    profiles: Mapping[str, Mapping[str, Any]],
    name: str,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings of profile ``name`` (a key of ``profiles``), then ``overrides`` (None
    values ignored: an option not given keeps the profile's value). A new dict whose profile
    values are copies, so what the caller does with it never changes ``profiles``; an unknown
    name is refused in one sentence that lists the profiles."""
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; profiles: {', '.join(profiles)}.")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    return {**copy.deepcopy(dict(profiles[name])), **given}


# ---------------------------------------------------------------------------------------------
# Run folders
# ---------------------------------------------------------------------------------------------


@functools.cache
def code_version() -> dict[str, Any]:
    """The code this process runs: sharpattn's version, and where the package is a git checkout,
    its commit and whether tracked files differ from it (``modified``); ``commit`` is None where
    git or the checkout is not there (an installed package)."""
    from .. import __version__

    here = Path(__file__).resolve()
    out: dict[str, Any] = {"version": __version__, "commit": None, "modified": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(here.parent), *args], capture_output=True,
                                  text=True, timeout=10, check=False)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # only a checkout that tracks this very file is the code running (not a venv inside one)
    if git("ls-files", "--error-unmatch", here.name) is not None:
        out["commit"] = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
        out["modified"] = None if status is None else bool(status)
    return out


def record_code_version(folder: str | Path) -> list[dict[str, Any]]:
    """Append this process's `code_version` to ``folder/code_versions.json`` where it differs
    from the last one listed (a run resumed by other code lists both); returns the list."""
    path = Path(folder) / CODE_VERSIONS
    versions = read_json(path, list) if path.is_file() else []
    if not versions or {k: versions[-1].get(k) for k in code_version()} != code_version():
        versions.append({**code_version(), "first_run": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
        write_json(path, versions)
    return versions


class RunFolder:
    """A run folder: ``config.json`` (experiment name + configuration), ``code_versions.json``
    (the code that ran it: `record_code_version`), ``metrics.jsonl``, checkpoints, tables,
    figures and ``report.md``.

    ``identity`` names the configuration keys that define what the run computes (its training
    settings); a folder whose config.json differs in any of them, or holds another experiment,
    is refused. Other keys (evaluation sizes, threads, ...) may change between invocations;
    config.json then records the latest. ``identity=None`` means every key; a dotted key
    ("lm.steps") names a key of a nested configuration. ``missing`` gives, for a key added to
    the configuration after a folder was written, the value such a folder was run with.
    """

    def __init__(
        self,
        out: str | Path,
        experiment: str,
        config: dict[str, Any],
        identity: Iterable[str] | None = None,
        missing: dict[str, Any] | None = None,
    ):
        self.path = Path(out)
        self.experiment = experiment
        record = {"experiment": experiment, **_jsonable(config)}
        path = self.path / "config.json"
        if path.is_file():
            old = read_json(path, dict, fix="restore it from a backup, or use another --out")
            old = {**(missing or {}), **old}
            if old.get("experiment") != experiment:
                found = old.get("experiment")
                raise ValueError(
                    f"{self.path} holds a {found or 'different'} run, not a {experiment} run; "
                    "use another --out."
                )
            keys = record.keys() | old.keys() if identity is None else set(identity)
            diff = sorted(k for k in keys if k != "experiment" and _get(old, k) != _get(record, k))
            if diff:
                what = ", ".join(
                    f"{k} ({_get(old, k)!r} there, {_get(record, k)!r} now)" for k in diff
                )
                raise ValueError(
                    f"{self.path} holds a {experiment} run with a different {what}; use another "
                    "--out or the same settings to resume it."
                )
            if old != record:
                write_json(path, record)
        else:
            make_dir(self.path)
            write_json(path, record)
        record_code_version(self.path)
        self.config = record

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def sub(self, *parts: str) -> Path:
        """A sub-folder, created."""
        p = self.path.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p


METRICS = "metrics.json"


def write_metrics(folder: RunFolder | str | Path, metrics: Any, name: str = METRICS) -> Path:
    """Write a run's measurements ``metrics`` into ``folder`` (a `RunFolder` or its path)
    as indented JSON, atomically (a crash leaves the previous file or none, never half of one);
    ``name``: the file, ``metrics.json`` unless the run keeps its results under another name.
    Returns the file's path."""
    path = (folder.path if isinstance(folder, RunFolder) else Path(folder)) / name
    write_json(path, metrics)
    return path


def _get(config: dict[str, Any], key: str) -> Any:
    """``config[key]``, following dots into nested dicts (None where a level is missing)."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def read_config(out: str | Path, experiment: str) -> dict[str, Any]:
    """The configuration stored in ``out``/config.json by a run of ``experiment``."""
    path = Path(out) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out} is not a {experiment} run folder (no config.json).")
    data = read_json(path, dict, fix="restore it from a backup, or name another run folder")
    if data.pop("experiment", None) != experiment:
        raise ValueError(f"{out} is not a {experiment} run folder (its config.json is another's).")
    return data


def _jsonable(obj: Any) -> Any:
    """Tuples become lists (what JSON gives back), so a stored config compares equal."""
    return json.loads(json.dumps(obj))


class MetricsLog:
    """``metrics.jsonl``: one JSON record per line, appended; records carry a ``step``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self) -> list[dict[str, Any]]:
        """The records; a damaged file raises ``ValueError`` naming it (a line cut by a crash
        mid-append can only be the last one, and is dropped)."""
        if not self.path.is_file():
            return []
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise self.damaged("not UTF-8 text") from None
        out = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines):
                    break
                raise self.damaged(f"line {i} is not valid JSON") from None
            problem = mismatch(record, {"step": int})
            if problem is not None:
                raise self.damaged(f"line {i}: {problem.replace('it ', 'the record ', 1)}")
            out.append(record)
        return out

    def damaged(self, why: str) -> ValueError:
        """The error for a damaged log: its run's measurements are lost, so the run is redone."""
        return damaged(
            self.path, why, f"delete the folder {self.path.parent} to train this run again"
        )

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_finite(record)) + "\n")

    def keep_until(self, step: int) -> list[dict[str, Any]]:
        """Drop records after ``step`` (written after the checkpoint a resume starts from)."""
        records = self.read()
        kept = [r for r in records if r.get("step", 0) <= step]
        if len(kept) != len(records) or self.path.is_file():
            write_atomic(self.path, "".join(json.dumps(_finite(r)) + "\n" for r in kept))
        return kept


def _finite(obj: Any) -> Any:
    """NaN/inf as null: metrics.jsonl stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------


#: the files a `Trainer` keeps in its folder: final weights, checkpoint, training log
TRAINING_FILES = ("model.safetensors", "checkpoint.safetensors", "metrics.jsonl")


def has_training_files(folder: str | Path) -> bool:
    """Whether ``folder`` holds any of a `Trainer`'s files (`TRAINING_FILES`)."""
    return any((Path(folder) / name).exists() for name in TRAINING_FILES)


class Trainer:
    """Train ``model`` with ``optimizer`` for ``steps`` steps in ``folder``, resuming.

    ``batch(step)`` returns the batch of a step, drawing only from ``generators`` (saved in every
    checkpoint, so a resumed run sees the batches an uninterrupted one would). ``loss(model,
    batch)`` returns a scalar, or one loss per ensemble member (their sum is differentiated: each
    member's parameters get their own loss's gradient). Every ``log_every`` steps, or at the
    steps in ``log_at`` if given (e.g. log-spaced ones), and at steps 0 and ``steps``,
    ``on_log(step, losses)`` returns the record appended to metrics.jsonl (losses: a list of
    floats, None at step 0). The final parameters go to ``model.safetensors``; a folder
    that has them is not retrained (`run` loads them).

    ``lr_schedule(step)`` multiplies each parameter group's initial learning rate at that step
    (0-based, as ``LambdaLR``); ``clip_grad_norm`` clips the gradients' global norm before each
    optimizer step.

    ``device`` (CPU by default) is where it trains: the model is moved there, and so is each
    batch (`to_device`); the generators, checkpoints and weights files stay on the CPU.

    ``stop_at`` stops after that many steps in total without writing the final weights, as a
    crash would (tests); Ctrl-C writes a checkpoint first.
    """

    def __init__(
        self,
        folder: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        steps: int,
        batch: Callable[[int], Any],
        loss: Callable[[torch.nn.Module, Any], Tensor],
        generators: dict[str, torch.Generator] | None = None,
        checkpoint_every: int = 1000,
        log_every: int = 100,
        on_log: Callable[[int, list[float] | None], dict[str, Any]] | None = None,
        log_at: Iterable[int] | None = None,
        task: str = "train",
        progress: Progress | None = None,
        report_every: int = 25,
        lr_schedule: Callable[[int], float] | None = None,
        clip_grad_norm: float | None = None,
        device: str | torch.device = "cpu",
    ):
        if steps < 0 or checkpoint_every < 1 or log_every < 1:
            raise ValueError(
                f"need steps >= 0, checkpoint_every >= 1 and log_every >= 1, got {steps}, "
                f"{checkpoint_every}, {log_every}."
            )
        self.folder = Path(folder)
        self.device = torch.device(device)
        self.model, self.optimizer = model.to(self.device), optimizer
        self.steps, self.batch, self.loss = steps, batch, loss
        self.generators = generators or {}
        self.checkpoint_every, self.log_every = checkpoint_every, log_every
        self.on_log = on_log
        self.log_at = None if log_at is None else frozenset(int(s) for s in log_at)
        self.task, self.progress, self.report_every = task, progress, max(1, report_every)
        self.metrics = MetricsLog(self.folder / TRAINING_FILES[2])
        self.lr_schedule, self.clip_grad_norm = lr_schedule, clip_grad_norm
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])

    @property
    def final(self) -> Path:
        return self.folder / TRAINING_FILES[0]

    @property
    def checkpoint(self) -> Path:
        return self.folder / TRAINING_FILES[1]

    def run(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train to ``steps`` (or load the finished weights); return the run's state
        (``step``, ``seconds``, ``steps_per_s``)."""
        need_files(self.final, self.checkpoint, self.metrics.path)  # before any training
        if self.final.is_file():
            state = self._state(self.final, load_checkpoint(self.final, model=self.model))
            self._logged(self.metrics.read())
            return state
        self.folder.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"step": 0, "seconds": 0.0}
        if self.checkpoint.is_file():
            state = load_checkpoint(
                self.checkpoint,
                model=self.model,
                optimizer=self.optimizer,
                generators=self.generators,
            )
            state = self._state(self.checkpoint, state)
            self._logged(self.metrics.read())
            self.metrics.keep_until(state["step"])
        else:
            self.metrics.keep_until(-1)
            self._log(0, None)
        step, seconds = int(state["step"]), float(state["seconds"])
        self.model.train()
        losses: Tensor | None = None
        try:
            while step < self.steps:
                if stop_at is not None and step >= stop_at:
                    return {"step": step, "seconds": seconds, "stopped": True}
                clock = Clock()
                with _whole_step():  # Ctrl-C lands between steps, never inside one
                    batch = to_device(self.batch(step), self.device)
                    losses = self.loss(self.model, batch).reshape(-1)
                    self.optimizer.zero_grad(set_to_none=True)
                    losses.sum().backward()
                    if self.clip_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
                    if self.lr_schedule is not None:
                        for group in self.optimizer.param_groups:
                            group["lr"] = group["initial_lr"] * self.lr_schedule(step)
                    self.optimizer.step()
                    step += 1
                seconds += clock.wall
                if self._logs(step):
                    values = losses.detach().tolist()
                    bad = [v for v in values if not math.isfinite(v)]
                    if bad:
                        raise FloatingPointError(
                            f"{self.task}: the loss became {bad[0]} at step {step}."
                        )
                    self._log(step, values)
                if step % self.checkpoint_every == 0 and step < self.steps:
                    self._save(step, seconds)
                if step % self.report_every == 0 or step == self.steps:
                    loss = (
                        float(losses.detach().mean())
                        if step % (8 * self.report_every) == 0
                        else None
                    )
                    emit(self.progress, self.task, "train", step, self.steps, loss=loss)
        except KeyboardInterrupt:
            self._save(step, seconds)  # the state after the last whole step: re-running resumes
            raise
        done = {
            "step": step,
            "seconds": seconds,
            "steps_per_s": step / seconds if seconds else None,
        }
        save_checkpoint(self.final, model=self.model, state=done)
        self.checkpoint.unlink(missing_ok=True)
        emit(self.progress, self.task, "train", step, self.steps)
        return done

    def _state(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's state, checked: a step (of this run, where it resumes) and its training
        seconds."""
        problem = mismatch(state, {"step": int, "seconds": float})
        last = self.steps if path == self.checkpoint else math.inf
        if problem is None and not 0 <= state["step"] <= last:
            problem = f"step {state['step']} of a run of {self.steps} steps"
        if problem is not None:
            raise checkpoint_damaged(path, f"{problem}: another run's file or a damaged one")
        return state

    def _logged(self, records: list[dict[str, Any]]) -> None:
        """A trained or resumed run's log must start at step 0: without it, its measurements
        are lost (a deleted or emptied metrics.jsonl)."""
        if not records or records[0]["step"] != 0:
            why = "missing" if not self.metrics.path.is_file() else "without its first records"
            raise self.metrics.damaged(f"{why}: the measurements of this run's training are lost")

    def _logs(self, step: int) -> bool:
        if step == self.steps:
            return True
        return step % self.log_every == 0 if self.log_at is None else step in self.log_at

    def _log(self, step: int, losses: list[float] | None) -> None:
        record = {"step": step, "loss": losses}
        if self.on_log is not None:
            record.update(self.on_log(step, losses))
        self.metrics.append(record)

    def _save(self, step: int, seconds: float) -> None:
        save_checkpoint(
            self.checkpoint,
            model=self.model,
            optimizer=self.optimizer,
            generators=self.generators,
            state={"step": step, "seconds": seconds},
        )


def to_device(batch: Any, device: str | torch.device) -> Any:
    """``batch`` with its tensors on ``device``: a tensor or any object with a ``to(device)``
    (moved by it), a tuple (named or not), list or dict of batches (moved item by item), or
    anything else (as it is). A tensor already there is returned as it is, not copied."""
    if hasattr(batch, "to"):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@contextlib.contextmanager
def _whole_step() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then act on them as their handlers would. A
    training step draws from the generators and updates weights, optimizer state and the step
    count: a Ctrl-C inside it would checkpoint a state no uninterrupted run passes through (a
    batch drawn but not learned, weights updated but the step not counted). The handlers are
    swapped rather than the signals blocked, so a signal Python has noted but not yet acted on
    is held too. Only the main thread receives signals: elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    old = {s: signal.signal(s, lambda n, f: held.append((n, f))) for s in _HELD}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for signum, frame in held[:1]:
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)  # Python's SIGINT handler raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)  # the default action, now


_HELD = (signal.SIGINT, signal.SIGTERM)


def need_files(*paths: str | Path) -> None:
    """Refuse, before any work, a run file's path held by something that is not a file (a
    directory, a socket): the write at the end of the work would fail there."""
    for path in map(Path, paths):
        if path.exists() and not path.is_file():
            what = "a directory" if path.is_dir() else "not a regular file"
            raise ValueError(
                f"{path} is {what}, where the run keeps a file; move it away and run the command "
                "again."
            )


def once(path: str | Path, compute: Callable[[], Any], shape: Any = None) -> Any:
    """The JSON value at ``path``; if it is missing, ``compute()`` written there atomically first
    (evaluations of finished weights: a re-run reuses them, a crash before the write redoes it).
    A stored value not of ``shape`` (`runs.conforms`) raises ``ValueError`` naming the
    file (deleting it computes it again)."""
    path = Path(path)
    need_files(path)
    if path.is_file():
        return read_json(path, shape)
    value = _jsonable(compute())
    write_json(path, value)
    return value


def read_weights(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load final weights written by `Trainer` into ``model``; return their state."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: that run is not trained yet.")
    return load_checkpoint(path, model=model)


__all__ = [
    "METRICS",
    "TRAINING_FILES",
    "has_training_files",
    "Clock",
    "MetricsLog",
    "Progress",
    "RunFolder",
    "Trainer",
    "cores",
    "emit",
    "event",
    "generator",
    "log_steps",
    "need_files",
    "once",
    "profile_settings",
    "read_config",
    "read_json",
    "read_weights",
    "seed_int",
    "seeded",
    "threads",
    "write_json",
    "write_metrics",
]
