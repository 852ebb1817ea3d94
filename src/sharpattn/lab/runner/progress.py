"""One progress-event protocol (plain dicts that one CLI renderer draws and worker processes can
pickle), one clock and the steps at which a run logs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Tensor = torch.Tensor
Progress = Callable[[dict[str, Any]], None]


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
    it then reads the block's seconds for good. `stop` does the same without a block.

    ``children``: ``cpu`` also counts the child processes that ended and were waited for in
    the meantime (a sweep's worker processes, once its pool is shut down)."""

    def __init__(self, children: bool = False) -> None:
        self._children = children
        self._start = (time.perf_counter(), self._process())
        self._end: tuple[float, float] | None = None

    def _process(self) -> float:
        if not self._children:
            return time.process_time()
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self) -> Clock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> Clock:
        """Freeze the clock (a second stop keeps the first time)."""
        if self._end is None:
            self._end = (time.perf_counter(), self._process())
        return self

    @property
    def wall(self) -> float:
        """Wall-clock seconds since the start (until `stop`)."""
        return (time.perf_counter() if self._end is None else self._end[0]) - self._start[0]

    @property
    def cpu(self) -> float:
        """CPU seconds of this process since the start (until `stop`)."""
        return (self._process() if self._end is None else self._end[1]) - self._start[1]


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
