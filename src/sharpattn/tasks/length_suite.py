"""The synthetic length-generalisation suite of ASEntmax (Vasylenko et al., ICLR 2026, *Long-Context
Generalization with Sparse Attention*; code deep-spin/asentmax: ``scripts/generate_data.py`` for
the tasks, ``synthetic/configs/data/*.yaml`` for how they become decoder sequences).

Each task follows the generator of that script; "size" is its ``seq_len``:

* ``copy`` / ``reverse`` / ``sort``: ``size`` tokens uniform in ``0..values-1`` (``values = 32``
  as in their configs); the answer is the list, reversed, or sorted.
* ``mqar`` (their ``mqmtar``, multi-query multi-token associative recall): ``pairs =
  min(int(size * kv_fraction // (k_len + v_len + 2)), alphabet ** k_len)`` key-value units
  ``key : value _`` with distinct keys and distinct values, each inside its own region of
  ``size // pairs`` tokens padded with space tokens ``_`` (the unit's offset in its region is
  drawn as their random deletion of spaces draws it), then ``num_q = 4`` queries ``? key`` (keys
  drawn with replacement); the answer is ``? value`` for each query. Their runs use 2-token keys
  and values over 256 symbols from a random 10K-word subset; here ``k_len = v_len = 1`` over
  ``alphabet = 64`` symbols by default (single-token values), every word eligible, so at long
  lengths the pairs are capped at ``alphabet ** k_len`` and the rest is spaces, as theirs is at
  10K.
* ``local_count``: blocks of one value repeated 2..``max_reps`` times, no two neighbouring
  blocks alike, values in ``0..values-1``; each token is labelled with its 0-based position in its
  block. Theirs draws ``size // ((max_reps + 2) / 2)`` blocks, so its length varies around
  ``size``; here blocks are drawn until ``size`` tokens are filled and the last one is cut, so
  every row has exactly ``size`` tokens. Neighbouring blocks differ by a uniform non-zero step
  (theirs re-draws equal neighbours until none is left). ``max_reps = 12`` (their script's
  default; their run used 48 at lengths 64-128, with ours at 16-48).
* ``two_back`` (their ``nback`` with ``num_steps = 2``): ``0`` then ``size`` tokens uniform in
  ``1..values-1``; each token is labelled with the token two before it (0 for the first two).
* ``flip_flop``: ``size // 2`` (command, bit) pairs: a write first, then writes with probability
  ``write_prob = 0.1`` or ignores, then a read whose bit is dropped; the answer is the bit of the
  last write.

Layouts: copy, reverse, sort, mqar and flip_flop are source → target (their ``{bos} src {sep}`` +
``trg {eos}``; their flip-flop has no SEP, the read command ends the source: here SEP follows
it, as in every seq2seq task). local_count and two_back are token classification in ASEntmax
(``{bos} src {eos}`` with a label at every source token): ``layout="labelling"``, the default,
keeps that (targets are labels, not next tokens; the trailing EOS, never scored, is dropped);
``layout="seq2seq"`` gives ``BOS, src, SEP, labels, EOS`` instead.

With them, ``passkey`` (not ASEntmax's: Mohtashami & Jaggi's passkey retrieval, Selective
Attention's Table 4): a five-digit key, one token per digit, hidden at a uniform place in
``size`` tokens of a repeated filler pattern, then a question; the answer is the key (see
`Passkey`).

Training sizes default to 16..48 (their 48 ± 16 halved in the middle, for CPU budgets) and
evaluation sizes to 32, 64, …, 4096 (≥ 64× the largest training size).
"""

from __future__ import annotations

import torch

from .sequence import (
    LAYOUTS,
    N_SPECIAL,
    SPECIAL_NAMES,
    SequenceBatch,
    SequenceTask,
    assemble,
    assemble_labelled,
    is_int,
    register,
)

Tensor = torch.Tensor

VALUE0 = N_SPECIAL  # value v is token VALUE0 + v


def _randint(g: torch.Generator, high: int, shape) -> Tensor:
    return torch.randint(high, tuple(shape), generator=g, device=g.device)


def _check_int(task: str, name: str, value, least: int) -> None:
    if not is_int(value) or value < least:
        raise ValueError(f"{task}: {name} must be an integer >= {least}, got {value!r}.")


class _Synthetic(SequenceTask):
    family = "synthetic"
    default_train_sizes = (16, 48)

    def _name(self, t: int) -> str:
        if t >= VALUE0:
            return str(t - VALUE0)
        return SPECIAL_NAMES.get(t, f"?{t}")

    def _line(self, ids: list[int]) -> str:
        return " ".join(self._name(t) for t in ids)

    def _render(self, prompt: list[int], answer: list[int] | None) -> str:
        key = "labels" if self.layout == "labelling" else "trg"
        ans = "" if answer is None else self._label_line(answer)
        return f"{self.name}:\nsrc: {self._line(prompt)}\n{key}: {ans}\n"

    def _label_line(self, ids: list[int]) -> str:
        return self._line(ids)


# --- copy, reverse, sort -----------------------------------------------------------------------------


class _ListTask(_Synthetic):
    def __init__(self, *, values: int = 32, train_sizes=None, eval_sizes=None):
        super().__init__(train_sizes=train_sizes, eval_sizes=eval_sizes)
        _check_int(self.name, "values", values, 1)
        self.values = values
        self.vocab_size = VALUE0 + values
        if values != 32:
            self.options["values"] = values
        self._validate_sizes()

    def _length(self, size: int) -> int:
        return 2 * size + 2

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        src = _randint(g, self.values, (batch, size))
        return assemble(VALUE0 + src, VALUE0 + self._target(src))

    def _target(self, src: Tensor) -> Tensor:
        raise NotImplementedError


@register
class Copy(_ListTask):
    """The list, unchanged."""

    name = "copy"

    def _target(self, src: Tensor) -> Tensor:
        return src


@register
class Reverse(_ListTask):
    """The list, reversed."""

    name = "reverse"

    def _target(self, src: Tensor) -> Tensor:
        return src.flip(1)


@register
class Sort(_ListTask):
    """The list, sorted ascending."""

    name = "sort"

    def _target(self, src: Tensor) -> Tensor:
        return src.sort(dim=1).values


# --- multi-query associative recall ------------------------------------------------------------------

SPACE, KV_SEP, Q_SEP = N_SPECIAL, N_SPECIAL + 1, N_SPECIAL + 2
SYM0 = N_SPECIAL + 3  # symbol a is token SYM0 + a


@register
class Mqar(_Synthetic):
    """Multi-query (multi-token) associative recall, ASEntmax's ``mqmtar``."""

    name = "mqar"

    def __init__(
        self,
        *,
        alphabet: int = 64,
        k_len: int = 1,
        v_len: int = 1,
        num_q: int = 4,
        kv_fraction: float = 0.8,
        train_sizes=None,
        eval_sizes=None,
    ):
        super().__init__(train_sizes=train_sizes, eval_sizes=eval_sizes)
        for name, value in (
            ("alphabet", alphabet),
            ("k_len", k_len),
            ("v_len", v_len),
            ("num_q", num_q),
        ):
            _check_int(self.name, name, value, 1)
        if not isinstance(kv_fraction, (int, float)) or not 0 < kv_fraction <= 1:
            raise ValueError(f"mqar: kv_fraction must be in (0, 1], got {kv_fraction!r}.")
        self.alphabet, self.k_len, self.v_len = alphabet, k_len, v_len
        self.num_q, self.kv_fraction = num_q, float(kv_fraction)
        self.unit = k_len + v_len + 2  # key, ':', value, '_'
        self.max_pairs = min(alphabet**k_len, alphabet**v_len)  # distinct keys and values
        self.vocab_size = SYM0 + alphabet
        n = 1
        while self.pairs(n) < 1:
            n += 1
        self.min_size = n
        for k, v, d in (
            ("alphabet", alphabet, 64),
            ("k_len", k_len, 1),
            ("v_len", v_len, 1),
            ("num_q", num_q, 4),
            ("kv_fraction", self.kv_fraction, 0.8),
        ):
            if v != d:
                self.options[k] = v
        self._validate_sizes()

    def pairs(self, size: int) -> int:
        """Key-value pairs at this size (their ``int(seq_len * num_kv // (k + v + 2))``, capped)."""
        return min(int(size * self.kv_fraction // self.unit), self.max_pairs)

    def _length(self, size: int) -> int:
        pairs = self.pairs(size)
        prompt = pairs * (size // pairs) + self.num_q * (1 + self.k_len)
        return prompt + self.num_q * (1 + self.v_len) + 2

    def _words(self, g: torch.Generator, batch: int, count: int, length: int) -> Tensor:
        """``count`` distinct words of ``length`` symbols per row: symbols [B, count, length]."""
        n_words = self.alphabet**length
        ids = torch.rand((batch, n_words), generator=g, device=g.device).argsort(dim=1)[:, :count]
        powers = self.alphabet ** torch.arange(length - 1, -1, -1, device=g.device)
        return (ids[..., None] // powers) % self.alphabet

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        device = g.device
        pairs, unit = self.pairs(size), self.unit
        region = size // pairs
        keys = self._words(g, batch, pairs, self.k_len)  # [B, pairs, k_len]
        vals = self._words(g, batch, pairs, self.v_len)
        # The unit's offset in its region, drawn as their generator draws it: the unit centred in
        # 2 * (region + 1) slots of spaces, then random spaces (never the unit) deleted until
        # `region` tokens remain; the spaces kept before the unit are its offset.
        slots = 2 * (region + 1)
        centre = slots // 2 - (unit - 1) // 2  # spaces before the centred unit
        kept = region - unit
        order = torch.rand((batch, pairs, slots - unit), generator=g, device=device).argsort(dim=2)
        before = (order[..., :kept] < centre).sum(dim=2)  # spaces kept before the unit
        units = torch.cat(
            (
                SYM0 + keys,
                torch.full((batch, pairs, 1), KV_SEP, device=device),
                SYM0 + vals,
                torch.full((batch, pairs, 1), SPACE, device=device),
            ),
            dim=2,
        )
        context = torch.full((batch, pairs, region), SPACE, dtype=torch.long, device=device)
        context.scatter_(2, before[..., None] + torch.arange(unit, device=device), units)
        q = _randint(g, pairs, (batch, self.num_q))
        q_sep = torch.full((batch, self.num_q, 1), Q_SEP, device=device)
        qk = keys.gather(1, q[..., None].expand(-1, -1, self.k_len))
        qv = vals.gather(1, q[..., None].expand(-1, -1, self.v_len))
        queries = torch.cat((q_sep, SYM0 + qk), dim=2).reshape(batch, -1)
        answer = torch.cat((q_sep, SYM0 + qv), dim=2).reshape(batch, -1)
        return assemble(torch.cat((context.reshape(batch, -1), queries), dim=1), answer)

    def answer_tokens(self) -> tuple[int, ...]:
        """``?`` and the symbols (an answer is ``? value`` per query)."""
        return (Q_SEP, *range(SYM0, self.vocab_size))

    def _name(self, t: int) -> str:
        if t >= SYM0:
            return str(t - SYM0)
        return {SPACE: "_", KV_SEP: ":", Q_SEP: "?"}.get(t, SPECIAL_NAMES.get(t, f"?{t}"))


# --- local count, n-back -----------------------------------------------------------------------------


class _Labelled(_Synthetic):
    layout = "labelling"

    def _set_layout(self, layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(
                f"{self.name}: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}."
            )
        self.layout = layout
        if layout != "labelling":
            self.options["layout"] = layout

    def _emit(self, inputs: Tensor, labels: Tensor) -> SequenceBatch:
        if self.layout == "labelling":
            return assemble_labelled(inputs, labels)
        return assemble(inputs, labels)


@register
class LocalCount(_Labelled):
    """Each token's 0-based position within its block of repeats."""

    name = "local_count"

    def __init__(
        self,
        *,
        values: int = 16,
        max_reps: int = 12,
        layout: str = "labelling",
        train_sizes=None,
        eval_sizes=None,
    ):
        super().__init__(train_sizes=train_sizes, eval_sizes=eval_sizes)
        _check_int(self.name, "values", values, 2)
        _check_int(self.name, "max_reps", max_reps, 2)
        self._set_layout(layout)
        self.values, self.max_reps = values, max_reps
        self.count0 = VALUE0 + values  # count c is token count0 + c
        self.vocab_size = self.count0 + max_reps
        if values != 16:
            self.options["values"] = values
        if max_reps != 12:
            self.options["max_reps"] = max_reps
        self._validate_sizes()

    def _length(self, size: int) -> int:
        return size + 1 if self.layout == "labelling" else 2 * size + 2

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        device = g.device
        blocks = size // 2 + 1  # blocks of >= 2 tokens: enough to fill `size`
        lens = 2 + _randint(g, self.max_reps - 1, (batch, blocks))
        steps = torch.cat(
            (
                _randint(g, self.values, (batch, 1)),
                1 + _randint(g, self.values - 1, (batch, blocks - 1)),
            ),
            dim=1,
        )
        block_value = steps.cumsum(dim=1) % self.values  # neighbours always differ
        ends = lens.cumsum(dim=1)
        pos = torch.arange(size, device=device).expand(batch, size).contiguous()
        block = torch.searchsorted(ends, pos, right=True)
        count = pos - (ends - lens).gather(1, block)
        return self._emit(VALUE0 + block_value.gather(1, block), self.count0 + count)

    def answer_tokens(self) -> tuple[int, ...]:
        """The counts (not the values)."""
        return tuple(range(self.count0, self.vocab_size))

    def _label_line(self, ids: list[int]) -> str:
        return " ".join(
            str(t - self.count0) if t >= self.count0 else ("-" if t < 0 else self._name(t))
            for t in ids
        )


@register
class TwoBack(_Labelled):
    """Each token labelled with the token ``steps`` (2) positions before it (0 for the first ones)."""

    name = "two_back"

    def __init__(
        self,
        *,
        values: int = 16,
        steps: int = 2,
        layout: str = "labelling",
        train_sizes=None,
        eval_sizes=None,
    ):
        _check_int(self.name, "steps", steps, 1)
        self.min_size = steps + 1  # theirs: num_steps < the shortest seq_len
        super().__init__(train_sizes=train_sizes, eval_sizes=eval_sizes)
        _check_int(self.name, "values", values, 2)
        self._set_layout(layout)
        self.values, self.steps = values, steps
        self.vocab_size = VALUE0 + values
        if values != 16:
            self.options["values"] = values
        if steps != 2:
            self.options["steps"] = steps
        self._validate_sizes()

    def _length(self, size: int) -> int:
        return size + 2 if self.layout == "labelling" else 2 * size + 4

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        zero = torch.zeros((batch, 1), dtype=torch.long, device=g.device)
        src = torch.cat((zero, 1 + _randint(g, self.values - 1, (batch, size))), dim=1)
        labels = torch.zeros_like(src)
        labels[:, self.steps :] = src[:, : -self.steps]
        return self._emit(VALUE0 + src, VALUE0 + labels)

    def _label_line(self, ids: list[int]) -> str:
        return " ".join("-" if t < 0 else self._name(t) for t in ids)


# --- flip-flop ---------------------------------------------------------------------------------------

WRITE, IGNORE_CMD, READ, BIT0 = N_SPECIAL, N_SPECIAL + 1, N_SPECIAL + 2, N_SPECIAL + 3


@register
class FlipFlop(_Synthetic):
    """Recall the bit of the last write (Liu et al.'s flip-flop language, ASEntmax's variant)."""

    name = "flip_flop"
    min_size = 4  # a write, at least nothing else, and the read: their minimum length

    def __init__(self, *, write_prob: float = 0.1, train_sizes=None, eval_sizes=None):
        super().__init__(train_sizes=train_sizes, eval_sizes=eval_sizes)
        if not isinstance(write_prob, (int, float)) or not 0 < write_prob < 1:
            raise ValueError(f"flip_flop: write_prob must be in (0, 1), got {write_prob!r}.")
        self.write_prob = float(write_prob)
        self.vocab_size = BIT0 + 2
        if self.write_prob != 0.1:
            self.options["write_prob"] = self.write_prob
        self._validate_sizes()

    def _length(self, size: int) -> int:
        return 2 * (size // 2) + 2

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        device = g.device
        pairs = size // 2
        bits = _randint(g, 2, (batch, pairs))
        middle = torch.rand((batch, pairs - 2), generator=g, device=device) < self.write_prob
        cmd = torch.cat(
            (
                torch.full((batch, 1), WRITE, device=device),
                torch.where(middle, WRITE, IGNORE_CMD),
                torch.full((batch, 1), READ, device=device),
            ),
            dim=1,
        )
        idx = torch.arange(pairs, device=device).expand(batch, pairs)
        last_write = torch.where(cmd == WRITE, idx, -1).amax(dim=1)
        src = torch.stack((cmd, BIT0 + bits), dim=2).reshape(batch, 2 * pairs)[:, :-1]
        return assemble(src, BIT0 + bits.gather(1, last_write[:, None]))

    def answer_tokens(self) -> tuple[int, ...]:
        """The two bits (not the commands)."""
        return (BIT0, BIT0 + 1)

    def _name(self, t: int) -> str:
        names = {WRITE: "w", IGNORE_CMD: "i", READ: "r", BIT0: "0", BIT0 + 1: "1"}
        return names.get(t, SPECIAL_NAMES.get(t, f"?{t}"))


# --- passkey retrieval -------------------------------------------------------------------------------

DIGIT0 = N_SPECIAL  # digit d is token DIGIT0 + d
KEY, QUERY = N_SPECIAL + 10, N_SPECIAL + 11
FILLER0 = N_SPECIAL + 12  # the filler pattern's word w is token FILLER0 + w
FILLER_WORDS = ("grass", "sky", "sun", "here", "there")  # the five sentences of the original


@register
class Passkey(_Synthetic):
    """Passkey retrieval (Mohtashami & Jaggi's landmark-attention test, used by YaRN and by
    Selective Attention's Table 4), reduced to tokens: find a five-digit key hidden in filler.

    The original prompt is a task description, ``The grass is green. The sky is blue. The sun is
    yellow. Here we go. There and back again.`` repeated, ``The pass key is 12345. Remember it.
    12345 is the pass key.`` at a uniformly random place, more filler, and ``What is the pass key?
    The pass key is``. Here each of its five filler sentences is one token (``pattern`` = 5 words
    repeated in a fixed cycle, so the filler carries no information), the key line is ``KEY d1 …
    d5`` with one token per digit, and the question is one token ``?``:

    ``BOS, filler[:p], KEY, d1 … d5, filler[:size - p], ?, SEP, d1 … d5, EOS``

    ``size`` is the number of filler tokens (as ``copy``'s size is its list's length); the filler
    before and after the key both start the pattern afresh, as the original cuts its prefix and
    suffix from the start of the same repeated text. ``p`` (filler tokens before the key) is
    uniform on ``0..size`` (the original's ``randint(0, n_garbage)``); the key is uniform on
    ``10^(digits-1) .. 10^digits - 1`` (five digits, no leading zero; the original draws
    ``randint(1, 50000)``). Only the ``digits`` answer tokens and EOS are scored. A sequence has
    ``size + 2 * digits + 4`` tokens; any size can be made.
    """

    name = "passkey"

    def __init__(self, *, digits: int = 5, pattern: int = 5, train_sizes=None, eval_sizes=None):
        super().__init__(train_sizes=train_sizes, eval_sizes=eval_sizes)
        _check_int(self.name, "digits", digits, 1)
        if digits > 18:
            raise ValueError(f"passkey: digits must be at most 18 (int64 keys), got {digits}.")
        _check_int(self.name, "pattern", pattern, 1)
        self.digits, self.pattern = digits, pattern
        self.vocab_size = FILLER0 + pattern
        if digits != 5:
            self.options["digits"] = digits
        if pattern != 5:
            self.options["pattern"] = pattern
        self._validate_sizes()

    def answer_tokens(self) -> tuple[int, ...]:
        """The ten digits (not the filler, the key marker or the question)."""
        return tuple(range(DIGIT0, DIGIT0 + 10))

    def _length(self, size: int) -> int:
        return size + 2 * self.digits + 4

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        device, d = g.device, self.digits
        key = torch.randint(10 ** (d - 1), 10**d, (batch, 1), generator=g, device=device)
        key_digits = key // 10 ** torch.arange(d - 1, -1, -1, device=device) % 10  # [B, d]
        before = _randint(g, size + 1, (batch, 1))  # filler tokens before the key: 0..size
        j = torch.arange(size + d + 1, device=device).expand(batch, -1)
        offset = j - before  # 0 at KEY, 1..d at the digits
        in_key = (offset >= 0) & (offset <= d)
        word = torch.where(offset < 0, j, offset - (d + 1)) % self.pattern  # each part restarts
        key_part = torch.where(
            offset == 0, KEY, DIGIT0 + key_digits.gather(1, (offset - 1).clamp(0, d - 1))
        )
        context = torch.where(in_key, key_part, FILLER0 + word)
        question = torch.full((batch, 1), QUERY, dtype=torch.long, device=device)
        return assemble(torch.cat((context, question), dim=1), DIGIT0 + key_digits)

    def _name(self, t: int) -> str:
        if t >= FILLER0:
            w = t - FILLER0
            return FILLER_WORDS[w] if self.pattern <= len(FILLER_WORDS) else f"w{w}"
        if t >= DIGIT0 and t < DIGIT0 + 10:
            return str(t - DIGIT0)
        return {KEY: "key", QUERY: "?"}.get(t, SPECIAL_NAMES.get(t, f"?{t}"))
