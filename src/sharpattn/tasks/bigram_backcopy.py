"""The Bigram-Backcopy task (Guo et al., *Active-Dormant Attention Heads*, Section 2).

Each sequence is ``BOS, x_1, ..., x_{N-1}`` (N tokens in all):

* ``x_1`` is drawn from the non-trigger tokens (their unigram frequencies, renormalised);
* after a trigger token the next token copies the token before the trigger
  (``x_t ∈ T  ⇒  x_{t+1} = x_{t-1}``, the *backcopy* sub-task);
* otherwise the next token follows the bigram transition row ``P[x_t]`` (the *bigram* sub-task).

The vocabulary is the V = 64 most frequent characters of a text corpus (tiny Shakespeare has 65;
the rarest is dropped), ids 0..V-1 in order of frequency, and ``BOS = V``; the triggers are the
3 most frequent characters (space, 'e', 't' for tiny Shakespeare), i.e. ids 0, 1, 2. The bigram
counts derived from tiny Shakespeare ship with the package (``data/tinyshakespeare_bigram.json``),
so `BigramBackcopy.tiny_shakespeare` works offline; `BigramBackcopy.from_text` derives
the same from any text file.

The Bayes risk is exact per position: 0 after a trigger, the entropy of the bigram row after a
non-trigger, the entropy of the first-token distribution after BOS.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "BigramBackcopy",
    "KIND_BACKCOPY",
    "KIND_BIGRAM",
    "KIND_BOS",
    "PACKAGED",
    "count_text",
    "packaged_counts",
    "write_counts",
]

Tensor = torch.Tensor

# Kinds of query positions (what the next token depends on).
KIND_BOS, KIND_BIGRAM, KIND_BACKCOPY = 0, 1, 2

PACKAGED = "tinyshakespeare_bigram.json"


def count_text(text: str, vocab_size: int = 64) -> dict:
    """Character counts of ``text``: the ``vocab_size`` most frequent characters (most frequent
    first, ties by code point), their unigram counts and the bigram counts between them.

    Pairs with a dropped character are not counted (nothing is bridged across a dropped one).
    """
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be at least 4, got {vocab_size}.")
    unigram = Counter(text)
    if len(unigram) < vocab_size:
        raise ValueError(
            f"the text has {len(unigram)} distinct characters, fewer than vocab_size={vocab_size}."
        )
    chars = [c for c, _ in sorted(unigram.items(), key=lambda kv: (-kv[1], kv[0]))][:vocab_size]
    index = {c: i for i, c in enumerate(chars)}
    bigram = [[0] * vocab_size for _ in range(vocab_size)]
    for (a, b), n in Counter(zip(text, text[1:], strict=False)).items():
        if a in index and b in index:
            bigram[index[a]][index[b]] += n
    return {
        "chars": chars,
        "unigram_counts": [unigram[c] for c in chars],
        "bigram_counts": bigram,
    }


@dataclass(frozen=True, eq=False)
class BigramBackcopy:
    """A Bigram-Backcopy task: vocabulary, triggers, bigram matrix, sampler and Bayes risk.

    Attributes:
        chars: the V characters, most frequent first (token id = index).
        unigram_counts: ``[V]`` corpus counts of the characters.
        bigram_counts: ``[V, V]`` corpus counts of (current, next) pairs.
        n_triggers: the triggers are the ``n_triggers`` most frequent characters (ids 0..n-1).
    """

    chars: tuple[str, ...]
    unigram_counts: tuple[int, ...]
    bigram_counts: tuple[tuple[int, ...], ...]
    n_triggers: int = 3

    def __post_init__(self):
        v = len(self.chars)
        if len(set(self.chars)) != v:
            raise ValueError("chars must be distinct.")
        if len(self.unigram_counts) != v or any(len(r) != v for r in self.bigram_counts):
            raise ValueError(f"counts must be [V] and [V, V] with V = {v}.")
        if not 1 <= self.n_triggers < v:
            raise ValueError(f"n_triggers must be in [1, {v - 1}], got {self.n_triggers}.")
        counts = torch.tensor(self.bigram_counts, dtype=torch.float64)
        rows = counts.sum(-1, keepdim=True)
        # A character never followed by a kept one (impossible for tiny Shakespeare) gets a uniform row.
        transition = torch.where(
            rows > 0, counts / rows.clamp_min(1), torch.full_like(counts, 1 / v)
        )
        first = torch.tensor(self.unigram_counts, dtype=torch.float64)
        first[: self.n_triggers] = 0.0
        object.__setattr__(self, "_transition", transition)
        object.__setattr__(self, "_first", first / first.sum())

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_counts(cls, counts: dict, n_triggers: int = 3) -> BigramBackcopy:
        """From a `count_text` dictionary (or the packaged JSON)."""
        return cls(
            chars=tuple(counts["chars"]),
            unigram_counts=tuple(int(n) for n in counts["unigram_counts"]),
            bigram_counts=tuple(tuple(int(n) for n in row) for row in counts["bigram_counts"]),
            n_triggers=n_triggers,
        )

    @classmethod
    def from_text(
        cls, path: str | Path, vocab_size: int = 64, n_triggers: int = 3
    ) -> BigramBackcopy:
        """Derive the task from the text file at ``path`` (read as UTF-8)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no text file at {path}.")
        return cls.from_counts(count_text(path.read_text(encoding="utf-8"), vocab_size), n_triggers)

    @classmethod
    def tiny_shakespeare(cls, n_triggers: int = 3) -> BigramBackcopy:
        """The paper's task, from the bigram counts of tiny Shakespeare shipped with sharpattn."""
        return cls.from_counts(packaged_counts(), n_triggers)

    # ----- facts --------------------------------------------------------------------------
    @property
    def V(self) -> int:  # noqa: N802 (the paper's name)
        """Number of characters (BOS excluded)."""
        return len(self.chars)

    @property
    def bos(self) -> int:
        """Token id of BOS (= V)."""
        return self.V

    @property
    def vocab_size(self) -> int:
        """Input vocabulary size, BOS included (= V + 1)."""
        return self.V + 1

    @property
    def triggers(self) -> tuple[int, ...]:
        return tuple(range(self.n_triggers))

    @property
    def transition(self) -> Tensor:
        """``[V, V]`` float64 bigram matrix P, rows P(next | current) summing to 1."""
        return self._transition.clone()

    @property
    def first_distribution(self) -> Tensor:
        """``[V]`` float64 distribution of the first token (0 on the triggers)."""
        return self._first.clone()

    def is_trigger(self, tokens: Tensor) -> Tensor:
        """Boolean tensor: which tokens are triggers (BOS is not)."""
        return tokens < self.n_triggers

    def encode(self, text: str) -> Tensor:
        """BOS followed by the ids of ``text``'s characters (all must be in the vocabulary)."""
        index = {c: i for i, c in enumerate(self.chars)}
        missing = sorted({c for c in text if c not in index})
        if missing:
            raise ValueError(f"characters not in the vocabulary: {missing!r}.")
        return torch.tensor([self.bos] + [index[c] for c in text], dtype=torch.long)

    def decode(self, tokens) -> str:
        """Characters of ``tokens``; BOS is shown as ``⟨s⟩``."""
        return "".join("⟨s⟩" if int(t) == self.bos else self.chars[int(t)] for t in tokens)

    # ----- sampling -----------------------------------------------------------------------
    def sample(
        self,
        batch: int,
        seq_len: int = 256,
        *,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> Tensor:
        """``[batch, seq_len]`` long tensor of sequences, BOS first. Seeded by ``seed`` or
        ``generator`` (same seed, same sequences)."""
        if batch < 1 or seq_len < 2:
            raise ValueError(f"need batch >= 1 and seq_len >= 2, got {batch} and {seq_len}.")
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(0 if seed is None else int(seed))
        u = torch.rand(seq_len, batch, generator=generator, dtype=torch.float64).numpy()
        # Inverse-CDF sampling of every row at once: row r's cumulative sums shifted by r form
        # one sorted array, so the token after v is searchsorted(flat, v + u) − v·V. The loop
        # over positions runs in NumPy: hundreds of tiny torch ops are slow on a busy CPU.
        v = self.V
        cum = self._transition.cumsum(-1).numpy()
        cum[:, -1] = 1.0  # guard against rounding: the last bucket must reach the row's end
        flat = (np.arange(v, dtype=np.float64)[:, None] + cum).reshape(-1)
        first_cum = self._first.cumsum(-1).numpy()
        first_cum[-1] = 1.0
        x = np.empty((batch, seq_len), dtype=np.int64)
        x[:, 0] = self.bos
        x[:, 1] = np.searchsorted(first_cum, u[1], side="right")
        for t in range(1, seq_len - 1):
            cur = x[:, t]
            step = np.searchsorted(flat, cur + u[t + 1], side="right") - cur * v
            x[:, t + 1] = np.where(cur < self.n_triggers, x[:, t - 1], step)
        x = torch.from_numpy(x)
        return x

    # ----- exact targets ------------------------------------------------------------------
    def position_kind(self, tokens: Tensor) -> Tensor:
        """``[..., L]`` kind of each query position: ``KIND_BOS``, ``KIND_BIGRAM`` (a
        non-trigger token: the next one follows P) or ``KIND_BACKCOPY`` (a trigger)."""
        kind = torch.full_like(tokens, KIND_BIGRAM)
        kind[self.is_trigger(tokens)] = KIND_BACKCOPY
        kind[tokens == self.bos] = KIND_BOS
        return kind

    def _checked_kind(self, tokens: Tensor) -> Tensor:
        if tokens.dim() < 1 or tokens.shape[-1] < 2 or bool((tokens[..., 0] != self.bos).any()):
            raise ValueError("sequences must start with BOS and have at least 2 tokens.")
        if bool((tokens < 0).any()) or bool((tokens > self.bos).any()):
            raise ValueError(f"token ids must be in [0, {self.bos}].")
        kind = self.position_kind(tokens)
        if bool((kind[..., 1] == KIND_BACKCOPY).any()) or bool((kind[..., 1:] == KIND_BOS).any()):
            raise ValueError("BOS must come only first and the first token must not be a trigger.")
        return kind

    def next_token_distribution(self, tokens: Tensor) -> Tensor:
        """``[..., L, V]`` float64: the true distribution of the token after each position.

        After BOS: the first-token distribution; after a non-trigger v: ``P[v]``; after a
        trigger at position t: a point mass on ``tokens[t-1]``. A trigger at position 1 (not
        produced by `sample`) has no token to copy and raises ``ValueError``.
        """
        kind = self._checked_kind(tokens)
        rows = torch.where(tokens == self.bos, 0, tokens)
        dist = self._transition[rows]  # (..., L, V)
        dist[kind == KIND_BOS] = self._first
        prev = torch.roll(tokens, 1, dims=-1).clamp_max(self.V - 1)
        copy = torch.nn.functional.one_hot(prev, self.V).to(torch.float64)
        return torch.where((kind == KIND_BACKCOPY).unsqueeze(-1), copy, dist)

    def bayes_risk(self, tokens: Tensor) -> Tensor:
        """``[..., L]`` float64 exact Bayes risk (nats) of predicting the token after each
        position: 0 after a trigger, the entropy of the bigram row otherwise."""
        kind = self._checked_kind(tokens)
        risk = _entropy(self._transition)[tokens.clamp_max(self.V - 1)]
        risk[kind == KIND_BOS] = float(_entropy(self._first))
        return risk.masked_fill(kind == KIND_BACKCOPY, 0.0)

    def risks(self, logits: Tensor, tokens: Tensor, drop: int = 0) -> dict[str, float]:
        """Bigram and backcopy risk of a model's ``logits`` (its expected cross-entropy under the
        true next-token distribution) and excess risk (that minus the exact Bayes risk: the mean
        KL) over the positions of each kind. ``drop``: the model read ``tokens[:, drop:]`` (1:
        sequences without their BOS)."""
        p = self.next_token_distribution(tokens)[:, drop:]  # (B, T, V) float64
        ce = -(p * torch.log_softmax(logits.double(), dim=-1)).sum(-1)
        bayes = self.bayes_risk(tokens)[:, drop:]
        kind = self.position_kind(tokens)[:, drop:]
        out = {}
        for name, k in (("bigram", KIND_BIGRAM), ("backcopy", KIND_BACKCOPY)):
            sel = kind == k
            out[f"{name}_risk"] = float(ce[sel].mean())
            out[f"{name}_excess"] = float((ce - bayes)[sel].mean())
        return out

    def stationary_distribution(self) -> Tensor:
        """``[V]`` stationary distribution π of the bigram chain P (π = πP)."""
        evals, evecs = torch.linalg.eig(self._transition.T)
        pi = evecs[:, torch.argmin((evals - 1).abs())].real
        pi = (pi / pi.sum()).clamp_min(0.0)  # removes round-off of the order 1e-17
        return pi / pi.sum()


def _entropy(p: Tensor) -> Tensor:
    """Entropy (nats) over the last axis, with 0·log 0 = 0 (and +0, not −0, for point masses)."""
    return -torch.xlogy(p, p).sum(-1) + 0.0


def packaged_counts() -> dict:
    """The tiny-Shakespeare counts shipped with sharpattn (see ``data/``)."""
    text = resources.files("sharpattn.tasks").joinpath("data", PACKAGED).read_text("utf-8")
    return json.loads(text)


def write_counts(text_path: str | Path, out: str | Path, vocab_size: int = 64) -> dict:
    """Derive the counts of ``text_path`` and write them as JSON (how the packaged file was made)."""
    raw = Path(text_path).read_bytes()
    counts = count_text(raw.decode("utf-8"), vocab_size)
    payload = {
        "source": Path(text_path).name,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "vocab_size": vocab_size,
        **counts,
    }
    Path(out).write_text(json.dumps(payload, ensure_ascii=False) + "\n", encoding="utf-8")
    return payload
