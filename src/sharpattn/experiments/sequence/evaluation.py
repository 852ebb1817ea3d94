"""Teacher-forced exact match on test sets drawn until the sampling rule says enough, with the
failure kinds at the answer positions."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...lab import runner
from .choices import STREAM_CHECK, STREAM_TEST
from .config import SequenceConfig


def eval_name(cfg: SequenceConfig, size: int) -> str:
    """The cache file of one size's evaluation, named by what decides its test sequences
    (``--eval-sets`` and the sampling rule may change between invocations)."""
    if cfg.eval_se > 0:
        return f"n{size}.se{cfg.eval_se:g}-{cfg.eval_min}-{cfg.eval_sets}-{cfg.eval_batch}.json"
    return f"n{size}.sets{cfg.eval_sets}.json"


#: a size the stopping rule did not evaluate: counted as exact-match 0 (token accuracy unknown)
SKIPPED = {"acc": 0.0, "token_acc": float("nan"), "sets": 0, "skipped": True}


def standard_error(solved: int, seqs: int) -> float:
    """The Agresti-Coull standard error of an accuracy of ``solved`` out of ``seqs``: that of
    (solved + 2) / (seqs + 4), which is not 0 at 0 or 1 as the plain one is."""
    p = (solved + 2) / (seqs + 4)
    return math.sqrt(p * (1 - p) / (seqs + 4))


def enough(solved: int, seqs: int, cfg: SequenceConfig) -> bool:
    """Whether a size's evaluation may stop after ``seqs`` test sequences, ``solved`` of them
    right: always at ``eval_sets``; with adaptive sampling (``eval_se`` > 0) once at least
    ``eval_min`` are in and the standard error is at most ``eval_se``."""
    if seqs >= cfg.eval_sets:
        return True
    if cfg.eval_se <= 0:
        return False
    return seqs >= cfg.eval_min and standard_error(solved, seqs) <= cfg.eval_se


def test_sets(t, size: int, cfg: SequenceConfig):
    """The test sequences of a size, in batches: the same for every method and seed."""
    gen = runner.generator(cfg.seed, STREAM_TEST, task_key(t.name), size)
    left = cfg.eval_sets
    while left > 0:
        n = min(cfg.eval_batch, left)
        left -= n
        yield t.batch(size, n, gen)


def check_sequences(t, size: int, cfg: SequenceConfig, seed: int):
    """The check sequences of a size (``converge``), in batches: ``check_sets`` of them from
    their own stream of the run's ``seed``, never the test sequences, the same at every check."""
    gen = runner.generator(seed, STREAM_CHECK, task_key(t.name), size)
    left = cfg.check_sets
    while left > 0:
        n = min(cfg.eval_batch, left)
        left -= n
        yield t.batch(size, n, gen)


@torch.inference_mode()
def check_accuracy(model, t, sizes: list[int], cfg: SequenceConfig, seed: int) -> dict[int, float]:
    """The exact match of ``model`` (every scored target its most likely token, as `evaluate`
    counts it) on the check sequences (`check_sequences`) of each of ``sizes``: {size: accuracy}.
    The model is left in train mode."""
    model.eval()
    out = {}
    for size in sizes:
        solved = seqs = 0
        for b in check_sequences(t, size, cfg, seed):
            pred = model(b.tokens).argmax(-1)
            ok = (pred == b.targets) | (b.targets == -100)
            solved += int(ok.all(-1).sum())
            seqs += b.tokens.shape[0]
        out[size] = solved / seqs
    model.train()
    return out


def task_key(name: str) -> int:
    """A seed key from the task's name (its first 8 bytes: the current names differ there; two
    names that did not would share test-set streams, not test sets, as their tasks differ)."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") >> 1


#: what `evaluate` returns (its cached files are checked against it; evaluations cached before
#: `FAILURE_KEYS` were recorded lack them, and still load)
EVALUATION = {"acc": float, "token_acc": float, "sets": int, "length": int}
#: the kinds of wrong prediction at a scored position that `evaluate` counts (``failures``):
#: ``wrong_token``, another token of the task's answer alphabet (`answer_tokens`: on
#: flip_flop, the wrong bit); ``non_answer``, a token outside it that is not EOS (a command, a
#: filler, a special token); ``early_end``, EOS where an answer token was due;
#: ``missing_end``, anything but EOS where the answer should end
FAILURES = ("wrong_token", "non_answer", "early_end", "missing_end")
#: the fields of a row that `evaluate` adds beyond `EVALUATION` (rows written before them
#: lack them): ``answer_acc``, the accuracy on the answer tokens alone (EOS aside: on
#: flip_flop, the answer bit), and ``failures``, {kind: count} over the scored positions
FAILURE_KEYS = ("answer_acc", "failures")


@torch.inference_mode()
def evaluate(model, t, size: int, cfg: SequenceConfig) -> dict[str, Any]:
    """Exact-match accuracy (every answer token right), answer-token accuracy (every scored
    position, EOS included), accuracy on the answer tokens alone (``answer_acc``, EOS aside)
    and a tally of what the model predicted where it was wrong (``failures``, `FAILURES`) at
    one size."""
    from ...tasks.sequence import EOS

    model.eval()
    solved = tokens = right = seqs = answers = answers_right = 0
    kinds = dict.fromkeys(FAILURES, 0)
    alphabet = torch.zeros(max(t.vocab_size, EOS + 1), dtype=torch.bool)
    alphabet[list(t.answer_tokens())] = True
    for b in test_sets(t, size, cfg):  # a prefix of the same stream: paired across methods
        pred = model(b.tokens).argmax(-1)
        scored = b.targets != -100
        ok = (pred == b.targets) | ~scored
        solved += int(ok.all(-1).sum())
        seqs += b.tokens.shape[0]
        right += int((ok & scored).sum())
        tokens += int(scored.sum())
        end = b.targets == EOS
        answer, wrong = scored & ~end, ~ok
        answers += int(answer.sum())
        answers_right += int((answer & ok).sum())
        due = wrong & answer  # wrong where an answer token was due
        in_alphabet = alphabet[pred.clamp(0, len(alphabet) - 1)] & (pred < len(alphabet))
        kinds["missing_end"] += int((wrong & end).sum())
        kinds["early_end"] += int((due & (pred == EOS)).sum())
        kinds["wrong_token"] += int((due & (pred != EOS) & in_alphabet).sum())
        kinds["non_answer"] += int((due & (pred != EOS) & ~in_alphabet).sum())
        if enough(solved, seqs, cfg):
            break
    model.train()
    return {
        "acc": solved / seqs,
        "token_acc": right / max(1, tokens),
        "answer_acc": answers_right / max(1, answers),
        "failures": kinds,
        "sets": seqs,
        "length": int(t.length(size)),
    }
