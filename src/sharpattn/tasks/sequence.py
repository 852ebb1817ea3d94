"""The common interface of the sequence tasks: seeded batched generators of decoder sequences.

A task makes ``batch`` examples of one *size* (its natural size: list items, sequence length,
graph nodes, …) as one tensor pair. Two layouts exist:

* ``"seq2seq"`` (every CLRS task and most synthetic ones): a sequence is
  ``x = BOS, prompt…, SEP, answer…, EOS`` and ``tokens = x[:-1]``, ``targets = x[1:]`` with every
  prompt position (and SEP) `IGNORE` and every answer token and the closing EOS scored.
  Rows whose answer is shorter than the longest possible one are padded on the right with PAD
  (target IGNORE), so every batch of a size has the same, deterministic length ``length(size)``.
  Teacher-forced exact match over the scored targets equals greedy decoding's exact match.
* ``"labelling"`` (``local_count`` and ``two_back`` by default, as ASEntmax defines them: token
  classification): ``tokens = BOS, x_1…x_n`` and ``targets[t]`` is the label of ``tokens[t]``
  (IGNORE under BOS). Both tasks also offer ``layout="seq2seq"``.

Token ids: ``PAD = 0``, ``BOS = 1``, ``SEP = 2``, ``EOS = 3``; each task's own ids follow
(``vocab_size`` counts them all). Tasks import nothing above them (torch only).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "BOS",
    "EOS",
    "FAMILIES",
    "IGNORE",
    "LAYOUTS",
    "N_SPECIAL",
    "PAD",
    "SEP",
    "SPECIAL_NAMES",
    "SequenceBatch",
    "SequenceTask",
    "TASKS",
    "assemble",
    "assemble_labelled",
    "available",
    "default_eval_sizes",
    "get",
    "register",
]

Tensor = torch.Tensor

IGNORE = -100
PAD, BOS, SEP, EOS = 0, 1, 2, 3
N_SPECIAL = 4  # a task's own ids start here
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", SEP: "<sep>", EOS: "<eos>"}

FAMILIES = ("clrs", "synthetic")
LAYOUTS = ("seq2seq", "labelling")


@dataclass(frozen=True)
class SequenceBatch:
    tokens: Tensor  # int64 [B, T]: the decoder's input
    targets: Tensor  # int64 [B, T]: next-token targets (labelling: each token's label), IGNORE where not scored

    @property
    def scored(self) -> Tensor:
        """bool [B, T]: the positions whose target is scored."""
        return self.targets != IGNORE


def default_eval_sizes(train_sizes: tuple[int, int], factor: int = 64) -> tuple[int, ...]:
    """Powers of two from the largest one inside ``train_sizes`` (the next one above if none is
    inside) up to the first one >= ``factor`` × the largest training size."""
    lo, hi = train_sizes
    p = 1
    while p * 2 <= hi:
        p *= 2
    if p < lo:
        p *= 2
    sizes = [p]
    while sizes[-1] < factor * hi:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SequenceTask:
    """Base class of every task. Subclasses set ``name``, ``family`` (and ``layout``,
    ``min_size``, ``default_train_sizes`` if not the defaults), ``vocab_size`` in ``__init__``, and
    implement ``_batch``, ``_length`` and ``_render``."""

    name: str = ""
    family: str = ""
    layout: str = "seq2seq"
    min_size: int = 1
    default_train_sizes: tuple[int, int] = (4, 16)

    vocab_size: int
    train_sizes: tuple[int, int]
    eval_sizes: tuple[int, ...]

    def __init__(
        self,
        *,
        train_sizes: Sequence[int] | None = None,
        eval_sizes: Sequence[int] | None = None,
    ):
        train = tuple(self.default_train_sizes if train_sizes is None else train_sizes)
        if len(train) != 2 or not all(is_int(s) for s in train) or not train[0] <= train[1]:
            raise ValueError(
                f"{self.name}: train_sizes must be two integers (lo, hi) with lo <= hi, got {train_sizes!r}."
            )
        self.train_sizes = (int(train[0]), int(train[1]))
        self.eval_sizes = tuple(
            default_eval_sizes(self.train_sizes) if eval_sizes is None else eval_sizes
        )
        if not self.eval_sizes or not all(is_int(s) for s in self.eval_sizes):
            raise ValueError(
                f"{self.name}: eval_sizes must be a non-empty sequence of integers, got {eval_sizes!r}."
            )
        self.options: dict = {}
        if train_sizes is not None:
            self.options["train_sizes"] = self.train_sizes
        if eval_sizes is not None:
            self.options["eval_sizes"] = self.eval_sizes

    def _validate_sizes(self) -> None:
        """Every training and evaluation size must be one the generator can make (called by
        subclasses once their parameters are set)."""
        for s in (*self.train_sizes, *self.eval_sizes):
            self.check_size(s)

    # --- public interface -----------------------------------------------------------------------

    @property
    def max_size(self) -> int | None:
        """The largest size the generator can make (None: no limit)."""
        return None

    def check_size(self, size: int) -> None:
        """Raise a one-sentence ValueError if the generator cannot make ``size``."""
        if not is_int(size):
            raise ValueError(f"{self.name}: size must be an integer, got {size!r}.")
        if size < self.min_size:
            raise ValueError(f"{self.name} needs size >= {self.min_size}, got {size}.")
        if self.max_size is not None and size > self.max_size:
            raise ValueError(
                f"{self.name} can make sizes up to {self.max_size} with these options, got {size}."
            )

    def batch(self, size: int, batch: int, generator: torch.Generator) -> SequenceBatch:
        """``batch`` examples of size ``size``, drawn from ``generator`` (same state, same batch)."""
        self.check_size(size)
        if not is_int(batch) or batch < 1:
            raise ValueError(f"{self.name}: batch must be an integer >= 1, got {batch!r}.")
        return self._batch(size, batch, generator)

    def answer_tokens(self) -> tuple[int, ...]:
        """The token ids an answer is written in (its alphabet; EOS aside), which failure
        analysis tells from other tokens: by default every id of the task's own (from
        ``N_SPECIAL``); a task whose answers use fewer says which."""
        return tuple(range(N_SPECIAL, self.vocab_size))

    def length(self, size: int) -> int:
        """T of a batch at this size."""
        self.check_size(size)
        return self._length(size)

    def text(self, tokens_row, targets_row=None) -> str:
        """Human-readable rendering of one example from its ``tokens`` row (the answer of a seq2seq
        row is read from the tokens; a labelling row needs its ``targets`` row for the labels)."""
        ids = [
            int(t) for t in (tokens_row.tolist() if isinstance(tokens_row, Tensor) else tokens_row)
        ]
        while ids and ids[-1] == PAD:
            ids.pop()
        if ids and ids[0] == BOS:
            ids = ids[1:]
        if self.layout == "labelling":
            labels = None
            if targets_row is not None:
                tl = targets_row.tolist() if isinstance(targets_row, Tensor) else list(targets_row)
                labels = [int(t) for t in tl[1 : 1 + len(ids)]]
            return self._render(ids, labels)
        if SEP in ids:
            k = ids.index(SEP)
            prompt, answer = ids[:k], ids[k + 1 :]
        else:
            prompt, answer = ids, []
        if EOS in answer:
            answer = answer[: answer.index(EOS)]
        return self._render(prompt, answer)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"

    # --- for subclasses -------------------------------------------------------------------------

    def _batch(self, size: int, batch: int, generator: torch.Generator) -> SequenceBatch:
        raise NotImplementedError

    def _length(self, size: int) -> int:
        raise NotImplementedError

    def _render(self, prompt: list[int], answer: list[int] | None) -> str:
        raise NotImplementedError


def assemble(prompt: Tensor, answer: Tensor, answer_len: Tensor | None = None) -> SequenceBatch:
    """The seq2seq layout: ``x = BOS, prompt, SEP, answer[:answer_len], EOS, PAD…`` per row;
    ``tokens = x[:, :-1]``, ``targets = x[:, 1:]`` with prompt, SEP and PAD targets IGNORE.
    ``answer`` is [B, A] (entries at or beyond a row's ``answer_len`` are ignored; default: all A)."""
    b, p = prompt.shape
    a = answer.shape[1]
    device = prompt.device
    x = torch.full((b, p + a + 3), PAD, dtype=torch.long, device=device)
    x[:, 0] = BOS
    x[:, 1 : p + 1] = prompt
    x[:, p + 1] = SEP
    if answer_len is None:
        x[:, p + 2 : p + 2 + a] = answer
        x[:, p + 2 + a] = EOS
    else:
        keep = torch.arange(a, device=device) < answer_len[:, None]
        x[:, p + 2 : p + 2 + a] = torch.where(keep, answer, PAD)
        x.scatter_(1, (p + 2 + answer_len)[:, None], EOS)
    tokens = x[:, :-1]
    targets = x[:, 1:].clone()
    targets[:, : p + 1] = IGNORE
    targets[targets == PAD] = IGNORE
    return SequenceBatch(tokens=tokens.contiguous(), targets=targets)


def assemble_labelled(inputs: Tensor, labels: Tensor) -> SequenceBatch:
    """The labelling layout: ``tokens = BOS, inputs``; ``targets = IGNORE, labels``."""
    b = inputs.shape[0]
    col = torch.full((b, 1), BOS, dtype=torch.long, device=inputs.device)
    tokens = torch.cat((col, inputs), dim=1)
    targets = torch.cat((torch.full_like(col, IGNORE), labels), dim=1)
    return SequenceBatch(tokens=tokens, targets=targets)


# --- registry --------------------------------------------------------------------------------------

TASKS: dict[str, Callable[..., SequenceTask]] = {}


def register(factory):
    """Class decorator: registers a task under its ``name``."""
    TASKS[factory.name] = factory
    return factory


def _load_builtin() -> None:
    from . import clrs_text, length_suite  # noqa: F401  (registers the built-in tasks)


def available(family: str | None = None) -> list[str]:
    """Names of the registered tasks (of one family if given), sorted."""
    _load_builtin()
    if family is not None and family not in FAMILIES:
        raise ValueError(f"Unknown task family {family!r}; known families: {', '.join(FAMILIES)}.")
    return sorted(n for n, f in TASKS.items() if family is None or f.family == family)


def get(name: str, **kw) -> SequenceTask:
    """The task ``name`` with options ``kw`` (unknown name or option: a one-sentence ValueError)."""
    _load_builtin()
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}.")
    factory = TASKS[name]
    try:
        inspect.signature(factory).bind(**kw)
    except TypeError as e:
        raise ValueError(f"Task {name!r} does not take these options: {e}.") from None
    return factory(**kw)
