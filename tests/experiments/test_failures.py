"""Failure analysis of the sequence tasks (experiments/sequence/ `evaluate`, the leaderboard's
report): what a model predicted at the answer positions, on hand-built models whose answers
are known, and rows written before it was recorded."""

from __future__ import annotations

import json

import pytest
import torch

from sharpattn.experiments import leaderboard
from sharpattn.experiments import sequence as seq
from sharpattn.tasks.length_suite import BIT0, WRITE
from sharpattn.tasks.sequence import EOS, IGNORE

CFG = leaderboard.make_config("quick", methods=("softmax",), eval_sets=40, eval_batch=16)
FLIP = seq.task("flip_flop")


class Always(torch.nn.Module):
    """Predicts ``token`` at every position; with ``eos_last``, EOS where the target is EOS."""

    def __init__(self, token: int, eos_last: bool = False):
        super().__init__()
        self.token, self.eos_last = token, eos_last
        self.targets = None

    def forward(self, tokens):
        logits = torch.zeros(*tokens.shape, FLIP.vocab_size)
        logits[..., self.token] = 1.0
        if self.eos_last:  # the end is where a flip_flop row's last token is
            logits[:, -1, :] = 0.0
            logits[:, -1, EOS] = 1.0
        return logits


def _targets(size: int):
    """The scored targets of the test sequences, straight from the stream (independent)."""
    return torch.cat([b.targets for b in seq.test_sets(FLIP, size, CFG)])


@pytest.mark.parametrize("size", [16, 64])
def test_a_constant_bit_is_a_wrong_bit_half_of_the_time(size):
    targets = _targets(size)
    bits = targets[(targets != IGNORE) & (targets != EOS)]
    out = seq.evaluate(Always(BIT0, eos_last=True), FLIP, size, CFG)
    zeros = int((bits == BIT0).sum())
    assert out["answer_acc"] == zeros / len(bits)
    assert out["acc"] == zeros / len(bits)  # the end token is right
    assert out["failures"] == {
        "wrong_token": len(bits) - zeros,
        "non_answer": 0,
        "early_end": 0,
        "missing_end": 0,
    }
    assert out["sets"] == 40 == len(bits)


def test_a_command_at_the_answer_is_a_non_answer_token_and_the_end_is_missing():
    out = seq.evaluate(Always(WRITE), FLIP, 32, CFG)
    assert out["acc"] == 0 and out["answer_acc"] == 0 and out["token_acc"] == 0
    assert out["failures"] == {
        "wrong_token": 0,
        "non_answer": 40,
        "early_end": 0,
        "missing_end": 40,
    }


def test_an_end_token_at_the_answer_is_an_early_end():
    out = seq.evaluate(Always(EOS), FLIP, 32, CFG)
    assert out["failures"] == {"wrong_token": 0, "non_answer": 0, "early_end": 40, "missing_end": 0}
    assert out["token_acc"] == 0.5 and out["answer_acc"] == 0


def test_every_task_names_its_answer_alphabet():
    from sharpattn.tasks import sequence as tasks

    for name in tasks.available():
        t = tasks.get(name)
        ids = t.answer_tokens()
        assert ids and all(4 <= i < t.vocab_size for i in ids), name
        b = t.batch(t.train_sizes[0], 4, torch.Generator().manual_seed(0))
        answers = b.targets[(b.targets != IGNORE) & (b.targets != EOS)]
        assert set(answers.tolist()) <= set(ids), name  # every answer is written in it
    assert FLIP.answer_tokens() == (BIT0, BIT0 + 1)


def _row(method, seed, size, acc, **extra):
    return {
        "task": "flip_flop",
        "method": method,
        "seed": seed,
        "size": size,
        "acc": acc,
        "token_acc": 0.5,
        "sets": 8,
        "length": size + 2,
        "skipped": False,
        **extra,
    }


def test_the_report_explains_the_cells_at_zero(tmp_path):
    kinds = {"wrong_token": 1, "non_answer": 6, "early_end": 0, "missing_end": 1}
    rows = [
        _row("softmax", 0, 32, 1.0, answer_acc=1.0, failures=dict.fromkeys(kinds, 0)),
        _row("softmax", 0, 64, 0.0, answer_acc=0.125, failures=kinds),
        _row("softmax", 1, 32, 1.0, answer_acc=1.0, failures=dict.fromkeys(kinds, 0)),
        _row("softmax", 1, 64, 0.0, answer_acc=0.25, failures=kinds),
        _row("sink", 0, 32, 1.0),  # rows written before the failure analysis
        _row("sink", 0, 64, 0.0),
        _row("sink", 1, 32, 1.0),
        _row("sink", 1, 64, 0.5),  # one seed above 0: not a cell at 0
    ]
    cells = seq.failure_cells(rows)
    assert [(c["method"], c["size"]) for c in cells] == [("softmax", 64)]
    (c,) = cells
    assert c["answer_acc"] == pytest.approx(0.1875) and c["seeds"] == 2
    assert c["failures"] == {k: 2 * v for k, v in kinds.items()}
    assert c["shares"]["non_answer"] == pytest.approx(0.75)
    rows[-1] = _row("sink", 1, 64, 0.0)
    old = [c for c in seq.failure_cells(rows) if c["method"] == "sink"]
    assert len(old) == 1 and not old[0]["recorded"]
    cfg = leaderboard.make_config("quick", methods=("softmax", "sink"), seeds=2)
    table = leaderboard.rank(rows, ["flip_flop"])
    leaderboard.write(tmp_path, rows, table, cfg)
    report = (tmp_path / "report.md").read_text()
    assert "## What the models answered where they failed" in report
    line = next(x for x in report.splitlines() if x.startswith("| flip_flop | softmax | 64"))
    assert "0.188" in line and "75% (12)" in line and "non-answer token |" in line
    assert "not recorded" in (tmp_path / "failures.md").read_text()


def test_rows_without_the_failure_fields_still_load_and_bad_ones_are_named():
    job = seq.jobs("unused", CFG)[0]
    sizes = seq.sizes_of(CFG, job.task)
    rows = [_row("softmax", job.seed, s, 0.5) for s in sizes]
    for r in rows:
        r["sets"] = 4
    assert seq.rows._rows_problem(rows, job, CFG) is None  # the format before the failure analysis
    rows[0] = {**rows[0], "answer_acc": 0.5, "failures": {"wrong_token": 1}}
    assert "not a count of each of" in seq.rows._rows_problem(rows, job, CFG)
    rows[0] = {**rows[0], "answer_acc": 1.5, "failures": dict.fromkeys(seq.FAILURES, 0)}
    assert "answer_acc 1.5" in seq.rows._rows_problem(rows, job, CFG)
    json.dumps(rows)  # the rows stay JSON
