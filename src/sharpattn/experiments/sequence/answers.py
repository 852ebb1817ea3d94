"""What the models answered where they failed: every cell beyond the training sizes at exact
match 0, with the predicted tokens at the scored positions sorted into failure kinds."""

from __future__ import annotations

from typing import Any

import numpy as np

from .config import task as task_of
from .evaluation import FAILURE_KEYS, FAILURES

FAILURE_HEADER = [
    "task",
    "method",
    "size",
    "seeds",
    "token accuracy",
    "answer-token accuracy",
    "wrong answer token",
    "non-answer token",
    "early end",
    "missing end",
    "mostly",
]
#: how the failure kinds read in the report
FAILURE_NAMES = {
    "wrong_token": "wrong answer token",
    "non_answer": "non-answer token",
    "early_end": "early end",
    "missing_end": "missing end",
}


def failure_cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every cell (task, method, size) beyond the training sizes at exact match 0 on each seed
    evaluated there (sizes the stopping rule skipped have no predictions to show), with what
    the model predicted: the mean token and answer-token accuracy over seeds and the failure
    kinds (`sequence.FAILURES`) summed over seeds, as counts and as ``shares`` of the wrong
    positions. ``recorded``: False where the rows predate the failure analysis."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("skipped") or r["size"] <= task_of(r["task"]).train_sizes[1]:
            continue
        groups.setdefault((r["task"], r["method"], r["size"]), []).append(r)
    out = []
    for (task, method, size), rs in groups.items():
        if any(r["acc"] > 0 for r in rs):
            continue
        recorded = all(k in r for r in rs for k in FAILURE_KEYS)
        counts = {k: sum(r["failures"][k] for r in rs) if recorded else 0 for k in FAILURES}
        wrong = sum(counts.values())
        out.append(
            {
                "task": task,
                "method": method,
                "size": size,
                "seeds": len(rs),
                "recorded": recorded,
                "token_acc": float(np.mean([r["token_acc"] for r in rs])),
                "answer_acc": float(np.mean([r["answer_acc"] for r in rs])) if recorded else None,
                "failures": counts,
                "shares": {k: v / wrong for k, v in counts.items()} if wrong else None,
            }
        )
    return sorted(out, key=lambda c: (c["task"], c["method"], c["size"]))


def failure_table(cells: list[dict[str, Any]]) -> tuple[list[list], list[list]]:
    shown, raw = [], []
    for c in cells:
        head = [c["task"], c["method"], str(c["size"]), str(c["seeds"]), f"{c['token_acc']:.3f}"]
        if not c["recorded"]:
            shown.append([*head, "not recorded", *["–"] * 5])
            raw.append([*head[:3], c["seeds"], c["token_acc"], None, *[None] * 4, None])
            continue
        shares = c["shares"] or dict.fromkeys(FAILURES, 0.0)
        mostly = FAILURE_NAMES[max(FAILURES, key=lambda k: c["failures"][k])]
        shown.append(
            [
                *head,
                f"{c['answer_acc']:.3f}",
                *(f"{shares[k]:.0%} ({c['failures'][k]})" for k in FAILURES),
                mostly,
            ]
        )
        raw.append(
            [
                c["task"],
                c["method"],
                c["size"],
                c["seeds"],
                c["token_acc"],
                c["answer_acc"],
                *(c["failures"][k] for k in FAILURES),
                mostly,
            ]
        )
    return shown, raw


#: how the report reads the failures table (docs/leaderboard.md says the same)
FAILURES_TEXT = (
    "Every cell beyond the training sizes at exact match 0 on each of its evaluated seeds: what "
    "the model predicted at the scored positions (teacher-forced, so each position is judged "
    "on its own). **Answer-token accuracy**: accuracy on the answer tokens alone, the end token "
    "aside (on flip_flop, the answer bit: 0.5 is chance). The next four columns split the wrong "
    "predictions, summed over seeds (share of the wrong positions, and their count): **wrong "
    "answer token**, another token of the task's answer alphabet (on flip_flop, the wrong bit); "
    "**non-answer token**, a token outside it (a command, a filler, a separator); **early "
    "end**, the end token where an answer token was due; **missing end**, anything but the end "
    "token where the answer ends. **Mostly**: the most frequent kind. Cells evaluated before "
    "these were recorded say so."
)
