"""CLRS-Text prompts and batches for a pretrained decoder: a task's prompt and answer, their
tokens (the loss on the answer and its closing token), batches, test prompts and their scores
(exact match, answer tokens)."""

from __future__ import annotations

from typing import Any

import torch

from ...lab.runner import generator
from .. import sequence as seq
from .config import IGNORE, STREAM_TEST, Config


def prompt_and_answer(t, tokens_row: torch.Tensor) -> tuple[str, str]:
    """CLRS-Text's question (through the line naming the outputs) and answer of one example."""
    text = t.text(tokens_row)  # f"{algo}:\n{inputs}\n{outputs}:\n{answer}\n\n"
    question, answer = text.removesuffix("\n\n").rsplit(":\n", 1)
    return question + ":\n", answer


def encode(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the question and of the answer closed by the end-of-text token."""

    def ids(text: str) -> list[int]:
        return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()

    return ids(question), ids(answer) + [int(tok.eos_token_id)]


def collate(pairs: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """``input_ids`` (question then answer, right-padded: causal attention keeps the padding out
    of every scored position) and ``labels`` (the answer's ids where they stand, else -100)."""
    width = max(len(q) + len(a) for q, a in pairs)
    ids = torch.full((len(pairs), width), pad, dtype=torch.long)
    labels = torch.full((len(pairs), width), IGNORE, dtype=torch.long)
    for i, (q, a) in enumerate(pairs):
        ids[i, : len(q) + len(a)] = torch.tensor(q + a)
        labels[i, len(q) : len(q) + len(a)] = torch.tensor(a)
    return {"input_ids": ids, "labels": labels}


def draw(ts: list, cfg: Config, g: torch.Generator) -> list[tuple[Any, torch.Tensor]]:
    """``cfg.batch`` training examples: (task, token row), an algorithm and a training size
    drawn uniformly for each, everything from ``g``."""
    lo, hi = cfg.train_sizes
    out = []
    for _ in range(cfg.batch):
        t = ts[int(torch.randint(len(ts), (1,), generator=g))]
        size = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append((t, t.batch(size, 1, g).tokens[0]))
    return out


def test_prompts(t, size: int, cfg: Config, tok) -> list[tuple[list[int], list[int]]]:
    """The encoded test prompts of one algorithm and size: the same for every method and seed."""
    g = generator(cfg.seed, STREAM_TEST, seq.task_key(t.name), size)
    rows = t.batch(size, cfg.prompts, g).tokens
    return [encode(tok, *prompt_and_answer(t, row)) for row in rows]


def answer_logits(net, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits at the positions that predict answer tokens ``[S, V]`` and those tokens
    ``[S]``, row by row (the output layer runs on those positions only)."""
    h = net.get_decoder()(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    targets = batch["labels"][:, 1:]
    scored = targets != IGNORE  # position i - 1 predicts token i
    return net.get_output_embeddings()(h[:, :-1][scored]), targets[scored]


@torch.no_grad()
def score(net, pairs: list[tuple[list[int], list[int]]], pad: int, eval_batch: int) -> dict:
    """Per prompt: exact match (every answer token the most likely one) and answer tokens right
    out of scored."""
    exact, right, tokens = [], [], []
    for i in range(0, len(pairs), eval_batch):
        chunk = pairs[i : i + eval_batch]
        logits, targets = answer_logits(net, collate(chunk, pad))
        ok = (logits.argmax(-1) == targets).split([len(a) for _, a in chunk])
        for row in ok:
            exact.append(int(row.all()))
            right.append(int(row.sum()))
            tokens.append(len(row))
    return {"exact": exact, "right": right, "tokens": tokens}
