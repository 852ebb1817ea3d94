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

from ..runs import read_json, write_json
from .folder import (
    METRICS,
    MetricsLog,
    RunFolder,
    code_version,
    jsonable,
    profile_settings,
    read_config,
    record_code_version,
    require_committed,
    write_metrics,
)
from .progress import (
    Clock,
    Progress,
    Tensor,
    emit,
    event,
    log_steps,
)
from .resources import (
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
    cores,
    free_cores,
    keep_freed_memory,
    threads,
)
from .seeds import (
    generator,
    numpy_generator,
    seed_int,
    seeded,
)
from .trainer import (
    TRAINING_FILES,
    Trainer,
    has_training_files,
    need_files,
    once,
    read_weights,
    to_device,
)

__all__ = [
    "read_json",
    "write_json",
    "Clock",
    "METRICS",
    "MMAP_THRESHOLD",
    "MetricsLog",
    "Progress",
    "RunFolder",
    "TRAINING_FILES",
    "TRIM_THRESHOLD",
    "Tensor",
    "Trainer",
    "code_version",
    "cores",
    "emit",
    "event",
    "free_cores",
    "generator",
    "has_training_files",
    "jsonable",
    "keep_freed_memory",
    "log_steps",
    "need_files",
    "numpy_generator",
    "once",
    "profile_settings",
    "read_config",
    "read_weights",
    "record_code_version",
    "require_committed",
    "seed_int",
    "seeded",
    "threads",
    "to_device",
    "write_metrics",
]
