"""Size generalisation on sequence tasks: a tiny decoder per task × method × seed, trained at small
sizes and evaluated at sizes up to 64× larger.

The engine of ``sharpattn reproduce clrs`` (*Softmax is not Enough* §4.2 / Fig. 8 in small:
softmax against adaptive temperature applied in training and at inference, on CLRS-Text-style
algorithm tasks) and of ``sharpattn leaderboard`` (every trainable normalizer of the registry,
and the module options, on the same tasks, seeds and budget).

One **job** is (task, training recipe, seed): it trains one decoder on the runner
(`Trainer`: resume, checkpoints, seeded batches) and
evaluates it with every method that shares the recipe (``adaptive (inference)`` is the softmax
model evaluated with adaptive temperature, so it costs no training). Jobs run here, on a local
process pool or on Ray (`run_jobs`).

Evaluation is teacher-forced exact match: a sequence counts as solved when every answer token is
the model's most likely next token (for a deterministic answer that is what greedy decoding
produces), measured on the same test sequences for every method and seed (paired tests). Long
inputs go through ``attend(impl="auto")``: the fused or chunked paths, never a full score matrix
beyond the chunk size.
"""

from __future__ import annotations

from .answers import (
    FAILURE_HEADER,
    FAILURE_NAMES,
    FAILURES_TEXT,
    failure_cells,
    failure_table,
)
from .choices import (
    LENGTH_PARAMS,
    POSITIONS,
    SLOW,
    STREAM_CHECK,
    STREAM_DATA,
    STREAM_INIT,
    STREAM_TEST,
    UNTRAINABLE,
    Method,
    methods,
    resolve,
)
from .config import (
    CONVERGE_KEYS,
    IDENTITY,
    MISSING_IDENTITY,
    Job,
    SequenceConfig,
    SequenceOptions,
    catalogue,
    changes_work,
    evaluation_params,
    in_distribution,
    method_params,
    most_steps,
    profile_config,
    seeds_of,
    sizes_of,
    slug,
    steps_of,
    task,
    train_length,
)
from .evaluation import (
    EVALUATION,
    FAILURE_KEYS,
    FAILURES,
    SKIPPED,
    check_accuracy,
    check_sequences,
    enough,
    eval_name,
    evaluate,
    standard_error,
    task_key,
    test_sets,
)
from .rows import (
    ROW,
    ROWS_RECORD,
    job_identity,
    read_rows,
    row_problem,
    rows_file,
    rows_record,
)
from .scores import (
    area,
    area_weights,
    auc_of,
    compare,
    curves,
    measures,
    per_seed,
    plot_curves,
    stopping,
    test_sampling,
)
from .training import (
    build_model,
    check_memory,
    check_models,
    failures,
    job_memory,
    jobs,
    loss_fn,
    run_job,
    run_job_or_failure,
    sweep,
    switch,
)

__all__ = [
    "FAILURE_HEADER",
    "FAILURE_NAMES",
    "FAILURES_TEXT",
    "failure_cells",
    "failure_table",
    "SequenceOptions",
    "EVALUATION",
    "FAILURES",
    "FAILURE_KEYS",
    "CONVERGE_KEYS",
    "IDENTITY",
    "MISSING_IDENTITY",
    "Job",
    "LENGTH_PARAMS",
    "Method",
    "POSITIONS",
    "ROW",
    "ROWS_RECORD",
    "SKIPPED",
    "SLOW",
    "STREAM_CHECK",
    "STREAM_DATA",
    "STREAM_INIT",
    "STREAM_TEST",
    "SequenceConfig",
    "UNTRAINABLE",
    "area",
    "area_weights",
    "auc_of",
    "build_model",
    "catalogue",
    "changes_work",
    "check_accuracy",
    "check_memory",
    "check_models",
    "check_sequences",
    "compare",
    "curves",
    "enough",
    "evaluation_params",
    "eval_name",
    "evaluate",
    "failures",
    "in_distribution",
    "job_identity",
    "job_memory",
    "jobs",
    "loss_fn",
    "measures",
    "method_params",
    "most_steps",
    "methods",
    "per_seed",
    "plot_curves",
    "profile_config",
    "read_rows",
    "resolve",
    "row_problem",
    "rows_file",
    "rows_record",
    "run_job",
    "run_job_or_failure",
    "seeds_of",
    "sizes_of",
    "slug",
    "standard_error",
    "steps_of",
    "stopping",
    "sweep",
    "switch",
    "task",
    "task_key",
    "test_sampling",
    "test_sets",
    "train_length",
]
