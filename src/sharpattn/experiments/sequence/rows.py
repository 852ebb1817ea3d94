"""A job's result rows on disk: their identity, digest and checks, so a resumed sweep reads only
rows that match its configuration."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...lab import runs
from .config import CONVERGE_KEYS, IDENTITY, Job, SequenceConfig, sizes_of, steps_of
from .evaluation import FAILURES, eval_name


def rows_file(job: Job, cfg: SequenceConfig) -> Path:
    """Where a finished job keeps its rows: named by its methods, sizes and evaluation budget
    (what else decides them, the training, is the run folder's identity)."""
    digest = hashlib.sha256(json.dumps(_rows_key(job, cfg), sort_keys=True).encode()).hexdigest()
    return job.folder / f"rows-{digest[:12]}.json"


def _rows_key(job: Job, cfg: SequenceConfig) -> dict[str, Any]:
    return {
        "methods": [asdict(m) for m in job.methods],
        "sizes": sizes_of(cfg, job.task),
        "eval": eval_name(cfg, 0),
        "stop_zeros": cfg.stop_zeros,
    }


def job_identity(job: Job, cfg: SequenceConfig) -> dict[str, Any]:
    """What decides a job's rows: its task, seed, methods, sizes and evaluation budget, and the
    training settings of its model (as JSON gives them back). The ``converge`` settings are
    left out where it is off, so the identity of a fixed-steps job is what it was before
    them."""
    c = cfg.to_dict()
    leave = ("steps", "task_steps", *(() if cfg.converge else CONVERGE_KEYS))
    training = {k: c[k] for k in IDENTITY if k not in leave}
    training["steps"] = steps_of(cfg, job.task)
    key = {"task": job.task, "seed": job.seed, **_rows_key(job, cfg), "training": training}
    return json.loads(json.dumps(key))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _digest(identity: Any, rows: Any) -> str:
    """sha256 of the canonical JSON of a job's identity and its rows."""
    return hashlib.sha256(_canonical({"job": identity, "rows": rows}).encode()).hexdigest()


def rows_record(job: Job, cfg: SequenceConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A rows file's content: the job's identity (`job_identity`), its rows and the digest
    of both (`read_rows` checks it)."""
    identity = job_identity(job, cfg)
    return {"job": identity, "rows": rows, "digest": _digest(identity, rows)}


#: one row of a job (what `run_job` returns per method and size)
ROW = {
    "task": str,
    "method": str,
    "seed": int,
    "size": int,
    "acc": float,
    "token_acc": float,
    "sets": int,
    "length": int,
    "skipped": bool,
}
#: a rows file (`rows_record`)
ROWS_RECORD = {"job": {str: None}, "rows": [ROW], "digest": str}


def read_rows(path: str | Path, job: Job, cfg: SequenceConfig) -> list[dict[str, Any]]:
    """The rows of ``job`` stored at ``path``, checked: a record of `rows_record` whose
    digest matches its content and whose job is ``job``, or a bare list of rows (the format
    before digests, which published records use); either way every row must be of this job
    (task, seed, each method at each size once, in order) with accuracies in [0, 1] and counts
    of its budget. Anything else raises ``ValueError`` naming the file and what to do."""
    path = Path(path)
    fix = (
        "delete it and run the command again to evaluate that job anew (trained anew where "
        "its model is gone), or restore it from the run's record"
    )
    value = runs.read_json(path, ({str: None}, list), fix)
    if isinstance(value, dict):
        problem = runs.mismatch(value, ROWS_RECORD)
        if problem is None:
            mine = job_identity(job, cfg)
            differ = [
                k
                for k in sorted(mine.keys() | value["job"].keys())
                if _canonical(mine.get(k)) != _canonical(value["job"].get(k))
            ]
            if value["digest"] != _digest(value["job"], value["rows"]):
                problem = "its digest does not match its content: it was edited or cut short"
            elif differ:
                problem = (
                    f"it holds another job's rows (its {', '.join(differ)} differ from this job's)"
                )
        rows = value.get("rows")
    else:
        rows, problem = value, runs.mismatch(value, [ROW])
    problem = problem or _rows_problem(rows, job, cfg)
    if problem is not None:
        raise runs.damaged(path, problem, fix)
    return rows


def _rows_problem(rows: list[dict[str, Any]], job: Job, cfg: SequenceConfig) -> str | None:
    """Why ``rows`` (each of the shape `ROW`) are not ``job``'s, or None."""
    if not rows:
        return "it holds no rows"
    want = [(m.name, s) for m in job.methods for s in sizes_of(cfg, job.task)]
    for i, r in enumerate(rows):
        if (r["task"], r["seed"]) != (job.task, job.seed):
            return (
                f"row {i} is of {r['task']} seed {r['seed']}, not of this job's "
                f"{job.task} seed {job.seed}: another job's rows"
            )
        if i >= len(want) or (r["method"], r["size"]) != want[i]:
            expected = f"{want[i][0]} at size {want[i][1]}" if i < len(want) else "no row"
            return (
                f"row {i} is {r['method']} at size {r['size']} where this job has "
                f"{expected}: another job's rows"
            )
        problem = row_problem(r, cfg)
        if problem is not None:
            return problem.replace("row", f"row {i}", 1)
    if len(rows) < len(want):
        return f"it has no row for {want[len(rows)][0]} at size {want[len(rows)][1]}"
    return None


def row_problem(r: dict[str, Any], cfg: SequenceConfig) -> str | None:
    """Why one row's numbers cannot be a measurement of this budget, or None."""
    if "train_steps" in r:  # rows written before it lack it
        n = r["train_steps"]
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            return f"row has train_steps {n!r}, not a count of training steps"
    if not (math.isfinite(r["acc"]) and 0 <= r["acc"] <= 1):
        return f"row has acc {r['acc']}, not an accuracy in [0, 1]"
    if r["skipped"]:  # the stopping rule's: no sequences, counted as 0
        return None if r["acc"] == 0 and r["sets"] == 0 else "row is skipped but has a measurement"
    if not (math.isfinite(r["token_acc"]) and 0 <= r["token_acc"] <= 1):
        return f"row has token_acc {r['token_acc']}, not an accuracy in [0, 1]"
    if not 1 <= r["sets"] <= cfg.eval_sets:
        return f"row counts {r['sets']} test sequences where this budget draws 1-{cfg.eval_sets}"
    if "answer_acc" in r:  # rows written before the failure analysis have neither field
        a = r["answer_acc"]
        if not (isinstance(a, (int, float)) and math.isfinite(a) and 0 <= a <= 1):
            return f"row has answer_acc {a}, not an accuracy in [0, 1]"
    if "failures" in r:
        f = r["failures"]
        if not (
            isinstance(f, dict)
            and set(f) == set(FAILURES)
            and all(isinstance(v, int) and v >= 0 for v in f.values())
        ):
            return f"row has failures {f!r}, not a count of each of {', '.join(FAILURES)}"
    return None
