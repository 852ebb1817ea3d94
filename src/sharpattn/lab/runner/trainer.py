"""One training loop with checkpoints, resume after ``kill -9``, Ctrl-C held to the end of a step,
and results computed once per run folder."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import damaged as checkpoint_damaged
from ..checkpoint import load_checkpoint, save_checkpoint
from ..runs import mismatch, read_json, write_json
from .folder import MetricsLog, jsonable
from .progress import Clock, Progress, Tensor, emit

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

    ``until(step)``, if given, is asked after every ``check_every``-th step before ``steps``
    (those steps are logged): True ends training there as reaching ``steps`` would (the final
    weights, their state with ``"stopped_early": True``, a key absent from a run that reached
    ``steps``). It must depend only on the model and ``step``, drawing from none of
    ``generators``: it runs with the global random state forked and the model put back in train
    mode after, and a run resumed from a checkpoint at such a step asks it again (Ctrl-C may
    have landed before its answer), so a resumed run stops where an uninterrupted one does.
    Its time counts in the training seconds.

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
        until: Callable[[int], bool] | None = None,
        check_every: int = 250,
    ):
        if steps < 0 or checkpoint_every < 1 or log_every < 1 or check_every < 1:
            raise ValueError(
                f"need steps >= 0, checkpoint_every >= 1, log_every >= 1 and check_every >= 1, "
                f"got {steps}, {checkpoint_every}, {log_every} and {check_every}."
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
        self.until, self.check_every = until, check_every
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])

    @property
    def final(self) -> Path:
        return self.folder / TRAINING_FILES[0]

    @property
    def checkpoint(self) -> Path:
        return self.folder / TRAINING_FILES[1]

    def run(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train to ``steps``, or until ``until`` says so (or load the finished weights); return
        the run's state (``step``, ``seconds``, ``steps_per_s``, and ``stopped_early`` where
        ``until`` ended it)."""
        need_files(self.final, self.checkpoint, self.metrics.path)  # before any training
        if self.final.is_file():
            state = self._state(self.final, load_checkpoint(self.final, model=self.model))
            self._logged(self.metrics.read())
            return state
        self.folder.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"step": 0, "seconds": 0.0}
        resumed = self.checkpoint.is_file()
        if resumed:
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
        stopped = False
        try:
            if resumed and self._checks(step):  # its check may not have answered before the stop
                stopped, spent = self._converged(step)
                seconds += spent
            while not stopped and step < self.steps:
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
                if self._checks(step):  # before the checkpoint: a checkpoint's step was checked
                    stopped, spent = self._converged(step)
                    seconds += spent
                    if stopped:
                        break
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
        if stopped:
            done["stopped_early"] = True
            records = self.metrics.read()
            if not records or records[-1]["step"] != step:  # a resumed run stopped at once
                self._log(step, None if losses is None else losses.detach().tolist())
        save_checkpoint(self.final, model=self.model, state=done)
        self.checkpoint.unlink(missing_ok=True)
        emit(self.progress, self.task, "train", step, step if stopped else self.steps)
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
        if step == self.steps or self._checks(step):
            return True
        return step % self.log_every == 0 if self.log_at is None else step in self.log_at

    def _checks(self, step: int) -> bool:
        """Whether ``until`` is asked after ``step``: a multiple of ``check_every`` before
        ``steps``."""
        return self.until is not None and step % self.check_every == 0 and 0 < step < self.steps

    def _converged(self, step: int) -> tuple[bool, float]:
        """``until(step)`` and its seconds, asked with the global random state forked (a check
        that draws from it leaves training's draws as they were) and the model put back in
        train mode after."""
        clock = Clock()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            try:
                answer = bool(self.until(step))
            finally:
                self.model.train()
        return answer, clock.wall

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
    value = jsonable(compute())
    write_json(path, value)
    return value


def read_weights(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load final weights written by `Trainer` into ``model``; return their state."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: that run is not trained yet.")
    return load_checkpoint(path, model=model)
