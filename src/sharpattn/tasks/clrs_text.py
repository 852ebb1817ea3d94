"""CLRS-Text-style algorithmic tasks (Markeeva et al. 2024, *The CLRS-Text Algorithmic Reasoning
Language Benchmark*, google-deepmind/clrs ``clrs/_src/clrs_text``), as token sequences.

CLRS-Text writes one CLRS sample as a question and an answer::

    insertion_sort:
    key: [0.549 0.715 0.603 0.545 0.424]
    pred:
    [0.424 0.545 0.549 0.603 0.715]

(``f"{algo}:\\n{inputs}\\n{output names}:\\n"`` then ``f"{output}\\n\\n"``; with hints the input gains
``, initial_trace: …``, the output names become ``trace | …`` and the answer
``trace, trace, … | output``.) `ClrsTask.text` renders a row in exactly that format. The
tokens carry the same content with one token per value, so lengths stay linear in the size:

* keys are integers ``0..values-1`` (CLRS samples U[0, 1] floats, printed with 3 significant
  digits; Kadane's keys are signed, ``-h..h`` with ``h = (values - 1) // 2``, for CLRS' U[-1, 1]);
* input fields are separated by a ``,`` token, trace snapshots by ``,`` and the trace from the
  answer by ``|``; the answer ends with EOS (CLRS-Text's closing blank line);
* outputs that CLRS-Text prints as a node index (CLRS ``mask_one``: minimum's ``min``, binary
  search's ``return``, string matching's ``match``, Kadane's ``start, end``) are answered as the
  0/1 mask over the list (Kadane: the mask of the interval ``start..end``), so the answer
  vocabulary does not grow with the size (an index token never seen in training could not be
  produced at 64× the training size). ``text()`` prints the index, as CLRS-Text does;
* BFS's graph is an edge list of a random 2-out graph (each node joined to ``degree`` random
  other nodes, O(n) edges; CLRS samples Erdős–Rényi G(n, 0.5), O(n²)), with nodes named by
  random distinct labels from a pool of ``pool`` tokens listed in increasing order (so every
  label is trained at small sizes and the order, hence CLRS' tie-breaking by node index, is
  kept). The answer is CLRS' ``pi``: each node's BFS parent (the source and unreachable nodes
  point to themselves; ties go to the smallest node, as CLRS' ``bfs`` loop does).

Answers follow CLRS' algorithms exactly, including their tie-breaking (first minimum; binary
search returns the first index whose key is >= the target, clamped to the last index; Kadane
extends while the running sum is >= 0 and keeps the first best; activity selection scans by
finish time, ties by index, taking an activity whose start is >= the last finish; string
matching reports the first shift; CLRS' needle is planted at ``choice(n - m)``, ``m = n // 4``).

``trace=True`` (insertion_sort, bubble_sort, binary_search) answers with the CLRS hint trace
before the output: the sorts give the list after every insertion / after every bubble pass,
O(n²) tokens (CLRS' bubble-sort hints are per comparison, O(n³); per pass keeps it O(n²));
binary search gives the interval ``(low, high)`` after every halving as a 0/1 mask, O(n log n)
tokens (rows whose search takes fewer halvings are padded). Other algorithms have no trace here:
their hints as masks are O(n²) or longer without adding a new skill.
"""

from __future__ import annotations

import torch

from .sequence import (
    N_SPECIAL,
    PAD,
    SPECIAL_NAMES,
    SequenceBatch,
    SequenceTask,
    assemble,
    is_int,
    register,
)

Tensor = torch.Tensor

COMMA, BAR, OFF, ON = N_SPECIAL, N_SPECIAL + 1, N_SPECIAL + 2, N_SPECIAL + 3
VALUE0 = N_SPECIAL + 4  # value (or node label) v is token VALUE0 + v


def _randint(g: torch.Generator, high: int, shape) -> Tensor:
    return torch.randint(high, tuple(shape), generator=g, device=g.device)


def _first_true(mask: Tensor) -> Tensor:
    """Index of the first True along the last dim (its length if none)."""
    n = mask.shape[-1]
    idx = torch.arange(n, device=mask.device).expand_as(mask)
    return torch.where(mask, idx, n).amin(dim=-1)


def _interval_mask(lo: Tensor, hi: Tensor, n: int) -> Tensor:
    """Tokens [B, n]: ON on lo..hi (inclusive), OFF elsewhere."""
    pos = torch.arange(n, device=lo.device)
    inside = (pos >= lo[..., None]) & (pos <= hi[..., None])
    return torch.where(inside, ON, OFF)


def trace_width(k: int, n: int) -> int:
    """Answer tokens of ``k`` snapshots of ``n`` tokens, ``|`` and an ``n``-token output."""
    return k * (n + 1) + n if k > 0 else n + 1


def _trace_answer(snapshots: Tensor, k_row: Tensor, final: Tensor) -> tuple[Tensor, Tensor]:
    """``snap_0, snap_1, …, snap_{k-1} | final`` per row (k = k_row, at most K = snapshots.shape[1]),
    as tokens [B, trace_width(K, n)] padded with PAD, and each row's length."""
    b, k, n = snapshots.shape
    device = final.device
    width = k * (n + 1) + n + 1
    ans = torch.full((b, width), PAD, dtype=torch.long, device=device)
    if k:
        blocks = torch.cat(
            (snapshots, torch.full((b, k, 1), COMMA, dtype=torch.long, device=device)), dim=2
        ).reshape(b, k * (n + 1))
        block_of = torch.arange(k * (n + 1), device=device) // (n + 1)
        ans[:, : k * (n + 1)] = torch.where(block_of < k_row[:, None], blocks, PAD)
    bar = torch.where(k_row > 0, k_row * (n + 1) - 1, 0)
    ans.scatter_(1, bar[:, None], BAR)
    ans.scatter_(1, bar[:, None] + 1 + torch.arange(n, device=device), final)
    return ans[:, : trace_width(k, n)], bar + 1 + n


def _split(ids: list[int], sep: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for t in ids:
        if t == sep:
            out.append([])
        else:
            out[-1].append(t)
    return out


class ClrsTask(SequenceTask):
    """A CLRS-Text algorithm. Options: ``values`` (keys are 0..values-1), ``trace`` (where offered),
    ``train_sizes``, ``eval_sizes``."""

    family = "clrs"
    default_train_sizes = (4, 16)
    trace_cost: str | None = None  # token count of the trace answer; None: no trace offered
    output_name = ""

    def __init__(self, *, values: int = 64, trace: bool = False, train_sizes=None, eval_sizes=None):
        super().__init__(train_sizes=train_sizes, eval_sizes=eval_sizes)
        if not is_int(values) or values < 2:
            raise ValueError(f"{self.name}: values must be an integer >= 2, got {values!r}.")
        if trace and self.trace_cost is None:
            offered = ", ".join(_TRACED)
            raise ValueError(f"{self.name} has no trace; trace=True is offered for {offered}.")
        self.values = values
        self.trace = bool(trace)
        self.vocab_size = VALUE0 + values
        if values != 64:
            self.options["values"] = values
        if trace:
            self.options["trace"] = True
        self._validate_sizes()

    # token rendering
    def _value_str(self, t: int) -> str:
        if t >= VALUE0:
            return str(t - VALUE0)
        return {COMMA: ",", BAR: "|", OFF: "0", ON: "1"}.get(t, SPECIAL_NAMES.get(t, f"?{t}"))

    def _list(self, ids: list[int]) -> str:
        return "[" + " ".join(self._value_str(t) for t in ids) + "]"

    def _index_or_mask(self, ids: list[int]) -> str:
        """A one-hot answer as CLRS-Text's index; anything else as the raw mask."""
        if ids and all(t in (OFF, ON) for t in ids) and ids.count(ON) == 1:
            return str(ids.index(ON))
        return self._list(ids)

    def _render(self, prompt: list[int], answer: list[int] | None) -> str:
        inputs = self._inputs_str(prompt)
        out_name = self.output_name
        if self.trace:
            inputs += f", initial_trace: {self._initial_trace(prompt)}"
            out_name = f"trace | {self._trace_name()}"
            if BAR in answer:
                k = answer.index(BAR)
                snaps = [s for s in _split(answer[:k], COMMA) if s] if k else []
                trace = ", ".join(self._trace_str(s) for s in snaps)
                ans = " | ".join((trace, self._trace_str(answer[k + 1 :])))  # as CLRS-Text
            else:
                ans = ", ".join(self._trace_str(s) for s in _split(answer, COMMA))
        else:
            ans = self._answer_str(answer)
        return f"{self.name}:\n{inputs}\n{out_name}:\n{ans}\n\n"

    def _inputs_str(self, prompt: list[int]) -> str:
        return f"key: {self._list(prompt)}"

    def _answer_str(self, answer: list[int]) -> str:
        return self._list(answer)

    def _trace_name(self) -> str:
        return self.output_name

    def _initial_trace(self, prompt: list[int]) -> str:
        return self._list(prompt)

    def _trace_str(self, ids: list[int]) -> str:
        return self._list(ids)

    # sizes
    def _length(self, size: int) -> int:
        return self._prompt_len(size) + self._answer_width(size) + 2

    def _prompt_len(self, n: int) -> int:
        return n

    def _answer_width(self, n: int) -> int:
        return n


# --- sorting ---------------------------------------------------------------------------------------


class _Sort(ClrsTask):
    output_name = "pred"
    trace_cost = "O(n^2)"

    def _answer_width(self, n: int) -> int:
        return trace_width(max(n - 2, 0), n) if self.trace else n

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        keys = _randint(g, self.values, (batch, size))
        final = keys.sort(dim=1, stable=True).values
        if not self.trace:
            return assemble(VALUE0 + keys, VALUE0 + final)
        snaps = self._snapshots(keys)[:, : max(size - 2, 0)]  # the last one equals the output
        k = torch.full((batch,), snaps.shape[1], dtype=torch.long, device=keys.device)
        ans, alen = _trace_answer(VALUE0 + snaps, k, VALUE0 + final)
        return assemble(VALUE0 + keys, ans, alen)

    def _snapshots(self, keys: Tensor) -> Tensor:
        raise NotImplementedError


@register
class InsertionSort(_Sort):
    """Sort the keys; trace: the list after each insertion (CLRS' ``pred_h`` hints)."""

    name = "insertion_sort"

    def _snapshots(self, keys: Tensor) -> Tensor:
        n = keys.shape[1]
        snaps = [
            torch.cat((keys[:, : j + 1].sort(dim=1).values, keys[:, j + 1 :]), dim=1)
            for j in range(1, n)
        ]
        return torch.stack(snaps, dim=1) if snaps else keys.new_empty((keys.shape[0], 0, n))


@register
class BubbleSort(_Sort):
    """Sort the keys; trace: the list after each bubble pass (CLRS bubbles from the right)."""

    name = "bubble_sort"

    def _snapshots(self, keys: Tensor) -> Tensor:
        # One pass i carries the suffix minimum leftwards: new[i] = min(a[i:]) and, for j > i,
        # new[j] = max(min(a[j:]), a[j-1]) (the carried value and the one it was compared with).
        b, n = keys.shape
        a = keys.clone()
        snaps = []
        for i in range(n - 1):
            suffix_min = a.flip(1).cummin(dim=1).values.flip(1)
            new = a.clone()
            new[:, i] = suffix_min[:, i]
            if i + 1 < n:
                new[:, i + 1 :] = torch.maximum(suffix_min[:, i + 1 :], a[:, i:-1])
            a = new
            snaps.append(a)
        return torch.stack(snaps, dim=1) if snaps else keys.new_empty((keys.shape[0], 0, n))


# --- searching -------------------------------------------------------------------------------------


@register
class Minimum(ClrsTask):
    """The position of the (first) smallest key, as a one-hot mask."""

    name = "minimum"
    output_name = "min"

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        keys = _randint(g, self.values, (batch, size))
        first = _first_true(keys == keys.amin(dim=1, keepdim=True))
        return assemble(VALUE0 + keys, _interval_mask(first, first, size))

    def _answer_str(self, answer: list[int]) -> str:
        return self._index_or_mask(answer)


@register
class BinarySearch(ClrsTask):
    """Sorted keys and a target; the first position whose key is >= the target (the last one if
    none), as a one-hot mask. Trace: ``(low, high)`` after each halving, as interval masks."""

    name = "binary_search"
    output_name = "return"
    trace_cost = "O(n log n)"

    def _prompt_len(self, n: int) -> int:
        return n + 2

    def _answer_width(self, n: int) -> int:
        return trace_width(max((n - 1).bit_length() - 1, 0), n) if self.trace else n

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        keys = _randint(g, self.values, (batch, size)).sort(dim=1).values
        x = _randint(g, self.values, (batch,))
        prompt = torch.cat(
            (VALUE0 + keys, torch.full_like(x, COMMA)[:, None], (VALUE0 + x)[:, None]), dim=1
        )
        device = keys.device
        low = torch.zeros(batch, dtype=torch.long, device=device)
        high = torch.full_like(low, size - 1)
        steps = torch.zeros_like(low)
        snaps = []
        for _ in range((size - 1).bit_length()):  # ceil(log2 n) halvings at most
            active = low < high
            mid = (low + high) // 2
            left = x <= keys.gather(1, mid[:, None]).squeeze(1)
            high = torch.where(active & left, mid, high)
            low = torch.where(active & ~left, mid + 1, low)
            steps += active.long()
            snaps.append(_interval_mask(low, high, size))
        final = _interval_mask(low, high, size)  # low == high == the returned position
        if not self.trace:
            return assemble(prompt, final)
        k_max = max(len(snaps) - 1, 0)
        stacked = (
            torch.stack(snaps[:k_max], dim=1)
            if k_max
            else torch.empty((batch, 0, size), dtype=torch.long, device=device)
        )
        ans, alen = _trace_answer(stacked, (steps - 1).clamp(min=0), final)
        return assemble(prompt, ans, alen)

    def _inputs_str(self, prompt: list[int]) -> str:
        parts = _split(prompt, COMMA)
        target = " ".join(self._value_str(t) for t in parts[1]) if len(parts) > 1 else ""
        return f"key: {self._list(parts[0])}, target: {target}"

    def _answer_str(self, answer: list[int]) -> str:
        return self._index_or_mask(answer)

    def _trace_name(self) -> str:
        return "(low, high)"

    def _initial_trace(self, prompt: list[int]) -> str:
        return f"(0, {len(_split(prompt, COMMA)[0]) - 1})"

    def _trace_str(self, ids: list[int]) -> str:
        if ids and all(t in (OFF, ON) for t in ids) and ON in ids:
            on = [i for i, t in enumerate(ids) if t == ON]
            if on == list(range(on[0], on[-1] + 1)):
                return f"({on[0]}, {on[-1]})"
        return self._list(ids)


# --- divide and conquer ----------------------------------------------------------------------------


@register
class FindMaximumSubarrayKadane(ClrsTask):
    """Signed keys; the maximum-sum subarray ``start..end`` (CLRS' Kadane, first best), as the
    0/1 mask of the interval."""

    name = "find_maximum_subarray_kadane"
    output_name = "start, end"

    @property
    def half(self) -> int:
        return (self.values - 1) // 2

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        h = self.half
        vals = _randint(g, 2 * h + 1, (batch, size)) - h
        zero = torch.zeros((batch, 1), dtype=torch.long, device=vals.device)
        prefix = torch.cat((zero, vals.cumsum(dim=1)), dim=1)  # P[i] = sum of vals[:i]
        run_min = prefix[:, :size].cummin(dim=1).values  # min P[0..j]
        best_here = prefix[:, 1:] - run_min  # best sum of a subarray ending at j
        end = _first_true(best_here == best_here.amax(dim=1, keepdim=True))
        start = _first_true(prefix[:, :size] == run_min.gather(1, end[:, None]))
        return assemble(VALUE0 + vals + h, _interval_mask(start, end, size))

    def _value_str(self, t: int) -> str:
        return str(t - VALUE0 - self.half) if t >= VALUE0 else super()._value_str(t)

    def _answer_str(self, answer: list[int]) -> str:
        if answer and all(t in (OFF, ON) for t in answer) and ON in answer:
            on = [i for i, t in enumerate(answer) if t == ON]
            if on == list(range(on[0], on[-1] + 1)):
                return f"{on[0]}, {on[-1]}"
        return "[" + " ".join({OFF: "0", ON: "1"}.get(t, "?") for t in answer) + "]"


# --- strings ---------------------------------------------------------------------------------------


@register
class NaiveStringMatcher(ClrsTask):
    """A haystack of ``size`` characters and a needle of ``size // 4`` (1 below 4) planted in it;
    the first shift where the needle matches, as a one-hot mask over the haystack."""

    name = "naive_string_matcher"
    output_name = "match"

    def __init__(self, *, alphabet: int = 4, train_sizes=None, eval_sizes=None):
        if not is_int(alphabet) or alphabet < 2:
            raise ValueError(f"{self.name}: alphabet must be an integer >= 2, got {alphabet!r}.")
        super().__init__(values=alphabet, train_sizes=train_sizes, eval_sizes=eval_sizes)
        self.options.pop("values", None)
        if alphabet != 4:
            self.options["alphabet"] = alphabet
        self.alphabet = alphabet

    @staticmethod
    def needle_len(n: int) -> int:
        return n // 4 if n >= 4 else 1

    def _prompt_len(self, n: int) -> int:
        return n + 1 + self.needle_len(n)

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        m = self.needle_len(size)
        hay = _randint(g, self.alphabet, (batch, size))
        needle = _randint(g, self.alphabet, (batch, m))
        at = _randint(g, max(size - m, 1), (batch,))  # CLRS: rng.choice(n - m)
        hay.scatter_(1, at[:, None] + torch.arange(m, device=hay.device), needle)
        first = self._first_match(hay, needle)
        prompt = torch.cat(
            (VALUE0 + hay, torch.full((batch, 1), COMMA, device=hay.device), VALUE0 + needle), dim=1
        )
        return assemble(prompt, _interval_mask(first, first, size))

    @staticmethod
    def _first_match(hay: Tensor, needle: Tensor, screen: int = 16) -> Tensor:
        """The first shift where ``needle`` occurs in ``hay``, per row (needle planted: one exists).
        The first ``screen`` characters are compared at every shift; the few shifts that survive
        are then checked in full."""
        b, n = hay.shape
        m = needle.shape[1]
        shifts = n - m + 1
        alive = torch.ones((b, shifts), dtype=torch.bool, device=hay.device)
        for j in range(min(m, screen)):
            alive &= hay[:, j : j + shifts] == needle[:, j : j + 1]
        if m > screen:
            row, shift = alive.nonzero(as_tuple=True)
            window = hay[row[:, None], shift[:, None] + torch.arange(m, device=hay.device)]
            alive[row, shift] = (window == needle[row]).all(dim=1)
        return _first_true(alive)

    def _inputs_str(self, prompt: list[int]) -> str:
        parts = _split(prompt, COMMA)
        hay, needle = parts[0], (parts[1] if len(parts) > 1 else [])
        string = "[" + " ".join(["0"] * len(hay) + ["1"] * len(needle)) + "]"
        return f"string: {string}, key: {self._list(hay + needle)}"

    def _answer_str(self, answer: list[int]) -> str:
        return self._index_or_mask(answer)


# --- greedy ----------------------------------------------------------------------------------------


@register
class ActivitySelector(ClrsTask):
    """Activities with start ``s`` <= finish ``f``; CLRS' greedy selection (by finish time, ties
    by index; take an activity whose start is >= the last selected finish), as a 0/1 mask."""

    name = "activity_selector"
    output_name = "selected"

    def _prompt_len(self, n: int) -> int:
        return 2 * n + 1

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        a = _randint(g, self.values, (batch, size))
        b = _randint(g, self.values, (batch, size))
        s, f = torch.minimum(a, b), torch.maximum(a, b)
        order = f.sort(dim=1, stable=True).indices
        s_by, f_by = s.gather(1, order), f.gather(1, order)
        take = torch.zeros_like(order, dtype=torch.bool)
        take[:, 0] = True
        last_f = f_by[:, 0]
        for m in range(1, size):  # the greedy scan is sequential
            ok = s_by[:, m] >= last_f
            take[:, m] = ok
            last_f = torch.where(ok, f_by[:, m], last_f)
        selected = torch.zeros_like(take).scatter(1, order, take)
        prompt = torch.cat(
            (VALUE0 + s, torch.full((batch, 1), COMMA, device=s.device), VALUE0 + f), dim=1
        )
        return assemble(prompt, torch.where(selected, ON, OFF))

    def _inputs_str(self, prompt: list[int]) -> str:
        parts = _split(prompt, COMMA)
        f = parts[1] if len(parts) > 1 else []
        return f"s: {self._list(parts[0])}, f: {self._list(f)}"


# --- graphs ----------------------------------------------------------------------------------------


@register
class Bfs(ClrsTask):
    """Breadth-first search from ``s`` on a random 2-out graph given as an edge list; each node's
    parent ``pi`` (CLRS: the source and unreachable nodes are their own parent; a node's parent is
    its smallest neighbour one level closer). Nodes are named by distinct labels drawn from a pool
    of ``pool`` label tokens (default: the largest evaluation size), listed in increasing order."""

    name = "bfs"
    output_name = "pi"

    def __init__(
        self, *, pool: int | None = None, degree: int = 2, train_sizes=None, eval_sizes=None
    ):
        SequenceTask.__init__(self, train_sizes=train_sizes, eval_sizes=eval_sizes)
        largest = max(self.train_sizes[1], *self.eval_sizes)
        if pool is None:
            pool = largest
        if not is_int(pool) or pool < 1:
            raise ValueError(f"bfs: pool must be an integer >= 1, got {pool!r}.")
        if not is_int(degree) or degree < 1:
            raise ValueError(f"bfs: degree must be an integer >= 1, got {degree!r}.")
        self.pool, self.degree, self.trace, self.values = pool, degree, False, pool
        self.vocab_size = VALUE0 + pool
        if pool != largest:
            self.options["pool"] = pool
        if degree != 2:
            self.options["degree"] = degree
        self._validate_sizes()

    @property
    def max_size(self) -> int:
        return self.pool

    def n_edges(self, n: int) -> int:
        return self.degree * n if n >= 2 else 0

    def _prompt_len(self, n: int) -> int:
        return n + 3 + 2 * self.n_edges(n)

    def _batch(self, size: int, batch: int, g: torch.Generator) -> SequenceBatch:
        n, m, device = size, self.n_edges(size), g.device
        labels = torch.rand((batch, self.pool), generator=g, device=device).argsort(dim=1)[:, :n]
        labels = labels.sort(dim=1).values
        src_node = _randint(g, n, (batch,))
        if m:
            v = torch.arange(n, device=device).repeat_interleave(self.degree).expand(batch, m)
            u = (v + 1 + _randint(g, n - 1, (batch, m))) % n  # any node but v
            order = torch.rand((batch, m), generator=g, device=device).argsort(dim=1)
            v, u = v.gather(1, order), u.gather(1, order)
            flip = _randint(g, 2, (batch, m)).bool()
            v, u = torch.where(flip, u, v), torch.where(flip, v, u)
            edges = torch.stack((v, u), dim=2).reshape(batch, 2 * m)
        else:
            edges = torch.empty((batch, 0), dtype=torch.long, device=device)
        pi = self._parents(edges.reshape(batch, m, 2), src_node, n)
        comma = torch.full((batch, 1), COMMA, device=device)
        prompt = torch.cat(
            (
                VALUE0 + labels,
                comma,
                VALUE0 + labels.gather(1, src_node[:, None]),
                comma,
                VALUE0 + labels.gather(1, edges),
            ),
            dim=1,
        )
        return assemble(prompt, VALUE0 + labels.gather(1, pi))

    @staticmethod
    def _parents(edges: Tensor, s: Tensor, n: int) -> Tensor:
        """CLRS' ``pi`` for undirected ``edges`` [B, m, 2] (node indices) from sources ``s``."""
        b, device = s.shape[0], s.device
        own = torch.arange(n, device=device).expand(b, n)
        if not edges.shape[1]:
            return own.clone()
        src = torch.cat((edges[..., 0], edges[..., 1]), dim=1)
        dst = torch.cat((edges[..., 1], edges[..., 0]), dim=1)
        dist = torch.full((b, n), n + 1, dtype=torch.long, device=device)  # n + 1: unreached
        dist.scatter_(1, s[:, None], 0)
        frontier = dist == 0
        reached = frontier.clone()
        level = 0
        while True:  # level-synchronous BFS over the edge list, every row at once
            hits = torch.zeros((b, n), dtype=torch.int32, device=device)
            hits.scatter_add_(1, dst, frontier.gather(1, src).int())
            frontier = (hits > 0) & ~reached
            if not bool(frontier.any()):
                break
            level += 1
            reached |= frontier
            dist[frontier] = level
        d_src, d_dst = dist.gather(1, src), dist.gather(1, dst)
        closer = (d_src + 1 == d_dst) & (d_dst <= n)  # an edge from one level up
        parent = torch.full((b, n), n, dtype=torch.long, device=device).scatter_reduce(
            1, dst, torch.where(closer, src, n), reduce="amin"
        )
        return torch.where(parent == n, own, parent)

    def _inputs_str(self, prompt: list[int]) -> str:
        parts = _split(prompt, COMMA) + [[], []]
        nodes, s, edges = parts[0], parts[1], parts[2]
        pairs = ", ".join(
            f"({self._value_str(edges[i])},{self._value_str(edges[i + 1])})"
            for i in range(0, len(edges) - 1, 2)
        )
        s_str = " ".join(self._value_str(t) for t in s)
        return f"nodes: {self._list(nodes)}, s: {s_str}, edges: [{pairs}]"


_TRACED = tuple(c.name for c in (InsertionSort, BubbleSort, BinarySearch))
