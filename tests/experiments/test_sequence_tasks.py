"""Sequence tasks (tasks/sequence.py, clrs_text.py, length_suite.py): every answer checked against an
independent plain-Python implementation on decoded rows, the token layout, seeding, sizes, text."""

from __future__ import annotations

import re
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from sharpattn.tasks import clrs_text as ct
from sharpattn.tasks import length_suite as ls
from sharpattn.tasks import sequence as sq
from sharpattn.tasks.sequence import BOS, EOS, IGNORE, PAD, SEP

CLRS = sq.available("clrs")
SYNTHETIC = sq.available("synthetic")
NAMES = sq.available()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- decoding ------------------------------------------------------------------------------------


def decode_seq2seq(tokens: list[int], targets: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, answer) of one seq2seq row, checking the layout on the way."""
    x = tokens + [targets[-1] if targets[-1] != IGNORE else PAD]
    assert x[0] == BOS and x.count(SEP) == 1
    sep = x.index(SEP)
    assert EOS in x[sep + 1 :], "the answer must end with EOS"
    eos = x.index(EOS, sep + 1)
    prompt, answer = x[1:sep], x[sep + 1 : eos]
    assert all(t == PAD for t in x[eos + 1 :])
    specials = {PAD, BOS, SEP, EOS}
    assert not specials & set(prompt) and not specials & set(answer)
    return prompt, answer


def values(ids: list[int], base: int) -> list[int]:
    assert all(t >= base for t in ids)
    return [t - base for t in ids]


def split(ids: list[int], tok: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for t in ids:
        out.append([]) if t == tok else out[-1].append(t)
    return out


def mask_bits(ids: list[int]) -> list[int]:
    assert set(ids) <= {ct.OFF, ct.ON}
    return [int(t == ct.ON) for t in ids]


def one_hot(n: int, i: int) -> list[int]:
    return [int(j == i) for j in range(n)]


def interval(n: int, lo: int, hi: int) -> list[int]:
    return [int(lo <= j <= hi) for j in range(n)]


def trace_parts(answer: list[int]) -> tuple[list[list[int]], list[int]]:
    assert answer.count(ct.BAR) == 1
    k = answer.index(ct.BAR)
    snaps = split(answer[:k], ct.COMMA) if k else []
    assert all(snaps), "no empty snapshot"
    return snaps, answer[k + 1 :]


# --- independent references (plain Python) ---------------------------------------------------------


def insertion_trace(a: list[int]) -> list[list[int]]:
    a, out = list(a), []
    for j in range(1, len(a)):
        key, i = a[j], j - 1
        while i >= 0 and a[i] > key:
            a[i + 1] = a[i]
            i -= 1
        a[i + 1] = key
        out.append(list(a))
    return out[:-1]  # the last snapshot is the output


def bubble_trace(a: list[int]) -> list[list[int]]:
    a, out = list(a), []
    for i in range(len(a) - 1):
        for j in reversed(range(i + 1, len(a))):
            if a[j] < a[j - 1]:
                a[j], a[j - 1] = a[j - 1], a[j]
        out.append(list(a))
    return out[:-1]


def binary_search_trace(keys: list[int], x: int) -> tuple[list[tuple[int, int]], int]:
    low, high, hist = 0, len(keys) - 1, []
    while low < high:
        mid = (low + high) // 2
        if x <= keys[mid]:
            high = mid
        else:
            low = mid + 1
        hist.append((low, high))
    return hist[:-1], high


def kadane_clrs(a: list[int]) -> tuple[int, int]:
    best_low = best_high = i = 0
    best = s = a[0]
    for j in range(1, len(a)):
        x = a[j]
        if s + x >= x:
            s += x
        else:
            i, s = j, x
        if s > best:
            best_low, best_high, best = i, j, s
    return best_low, best_high


def kadane_brute(a: list[int]) -> tuple[int, int]:
    best = min(
        ((-sum(a[i : j + 1]), j, i) for j in range(len(a)) for i in range(j + 1)),
    )
    return best[2], best[1]


def check_insertion_sort(task, prompt, answer, size):
    keys = values(prompt, ct.VALUE0)
    if not task.trace:
        assert values(answer, ct.VALUE0) == sorted(keys)
        return
    snaps, final = trace_parts(answer)
    ref = insertion_trace(keys) if task.name == "insertion_sort" else bubble_trace(keys)
    assert [values(s, ct.VALUE0) for s in snaps] == ref
    assert values(final, ct.VALUE0) == sorted(keys)


def check_minimum(task, prompt, answer, size):
    keys = values(prompt, ct.VALUE0)
    assert mask_bits(answer) == one_hot(len(keys), keys.index(min(keys)))


def check_binary_search(task, prompt, answer, size):
    parts = split(prompt, ct.COMMA)
    assert len(parts) == 2 and len(parts[1]) == 1
    keys, x = values(parts[0], ct.VALUE0), values(parts[1], ct.VALUE0)[0]
    n = len(keys)
    assert keys == sorted(keys)
    ret = next((i for i, k in enumerate(keys) if k >= x), n - 1)
    if not task.trace:
        assert mask_bits(answer) == one_hot(n, ret)
        return
    hist, high = binary_search_trace(keys, x)
    assert high == ret
    snaps, final = trace_parts(answer)
    assert [mask_bits(s) for s in snaps] == [interval(n, lo, hi) for lo, hi in hist]
    assert mask_bits(final) == one_hot(n, ret)


def check_kadane(task, prompt, answer, size):
    h = (task.values - 1) // 2
    a = [v - h for v in values(prompt, ct.VALUE0)]
    assert all(-h <= v <= h for v in a)
    lo, hi = kadane_clrs(a)
    if len(a) <= 64:
        assert (lo, hi) == kadane_brute(a)
    assert mask_bits(answer) == interval(len(a), lo, hi)


def check_string_matcher(task, prompt, answer, size):
    parts = split(prompt, ct.COMMA)
    hay, needle = values(parts[0], ct.VALUE0), values(parts[1], ct.VALUE0)
    n = len(hay)
    assert len(needle) == (n // 4 if n >= 4 else 1)
    assert max(hay + needle) < task.alphabet
    text = "".join(chr(65 + c) for c in hay)
    first = text.find("".join(chr(65 + c) for c in needle))
    assert first >= 0, "the needle is planted"
    assert mask_bits(answer) == one_hot(n, first)


def check_activity_selector(task, prompt, answer, size):
    parts = split(prompt, ct.COMMA)
    s, f = values(parts[0], ct.VALUE0), values(parts[1], ct.VALUE0)
    assert len(s) == len(f) and all(a <= b for a, b in zip(s, f, strict=True))
    order = sorted(range(len(s)), key=lambda i: (f[i], i))
    sel = [0] * len(s)
    sel[order[0]] = 1
    last = order[0]
    for m in order[1:]:
        if s[m] >= f[last]:
            sel[m] = 1
            last = m
    assert mask_bits(answer) == sel


def check_bfs(task, prompt, answer, size):
    nodes_t, s_t, edges_t = split(prompt, ct.COMMA)
    nodes, s, flat = values(nodes_t, ct.VALUE0), values(s_t, ct.VALUE0), values(edges_t, ct.VALUE0)
    n = len(nodes)
    assert nodes == sorted(set(nodes)) and max(nodes) < task.pool and len(s) == 1
    s = s[0]
    edges = list(zip(flat[::2], flat[1::2], strict=True))
    assert len(edges) == (task.degree * n if n >= 2 else 0)
    adj = {v: set() for v in nodes}
    for a, b in edges:
        assert a != b and a in adj and b in adj
        adj[a].add(b)
        adj[b].add(a)
    dist, queue = {s: 0}, deque([s])
    while queue:
        u = queue.popleft()
        for w in adj[u]:
            if w not in dist:
                dist[w] = dist[u] + 1
                queue.append(w)
    pi = [
        v if v == s or v not in dist else min(u for u in adj[v] if dist.get(u) == dist[v] - 1)
        for v in nodes
    ]  # labels increase with the node index, so the smallest label is CLRS' smallest index
    assert values(answer, ct.VALUE0) == pi


def check_list(task, prompt, answer, size):
    src, trg = values(prompt, ls.VALUE0), values(answer, ls.VALUE0)
    assert max(src) < task.values
    expected = {"copy": list(src), "reverse": src[::-1], "sort": sorted(src)}[task.name]
    assert trg == expected


def check_mqar(task, prompt, answer, size):
    q_len = task.num_q * (1 + task.k_len)
    context, queries = prompt[:-q_len], prompt[-q_len:]
    pairs = task.pairs(size)
    region = size // pairs
    assert len(context) == pairs * region
    table, offsets = {}, []
    for r in range(pairs):
        chunk = context[r * region : (r + 1) * region]
        assert chunk.count(ls.KV_SEP) == 1
        i = chunk.index(ls.KV_SEP)
        key, val = tuple(chunk[i - task.k_len : i]), tuple(chunk[i + 1 : i + 1 + task.v_len])
        assert all(t >= ls.SYM0 for t in key + val)
        rest = chunk[: i - task.k_len] + chunk[i + 1 + task.v_len :]
        assert set(rest) == {ls.SPACE} and chunk[i + 1 + task.v_len] == ls.SPACE
        assert key not in table and val not in table.values(), "distinct keys and values"
        table[key] = val
        offsets.append(i - task.k_len)
    MQAR_OFFSETS.extend(offsets)
    expected = []
    for qi in range(task.num_q):
        group = queries[qi * (1 + task.k_len) : (qi + 1) * (1 + task.k_len)]
        assert group[0] == ls.Q_SEP
        expected += [ls.Q_SEP, *table[tuple(group[1:])]]
    assert answer == expected


MQAR_OFFSETS: list[int] = []  # the unit's place in each region, for the spread test


def check_flip_flop(task, prompt, answer, size):
    cmds, bits = prompt[0::2], prompt[1::2]
    assert len(prompt) == 2 * (size // 2) - 1
    assert cmds[0] == ls.WRITE and cmds[-1] == ls.READ
    assert set(cmds[1:-1]) <= {ls.WRITE, ls.IGNORE_CMD} and set(bits) <= {ls.BIT0, ls.BIT0 + 1}
    last = max(i for i, c in enumerate(cmds) if c == ls.WRITE)
    assert answer == [bits[last]]


def check_local_count(task, inputs, labels, size):
    x, counts = values(inputs, ls.VALUE0), values(labels, task.count0)
    assert max(x) < task.values and max(counts) < task.max_reps
    ref, run = [], 0
    for i, v in enumerate(x):
        run = run + 1 if i and v == x[i - 1] else 0
        ref.append(run)
    assert counts == ref
    starts = [i for i in range(len(x)) if ref[i] == 0] + [len(x)]
    blocks = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert all(2 <= b <= task.max_reps for b in blocks[:-1])  # the last block may be cut


def check_two_back(task, inputs, labels, size):
    src, lab = values(inputs, ls.VALUE0), values(labels, ls.VALUE0)
    assert src[0] == 0 and all(1 <= v < task.values for v in src[1:])
    k = task.steps
    assert lab == [src[i - k] if i >= k else 0 for i in range(len(src))]


def passkey_row(key: str, before: int, size: int, pattern: int) -> list[int]:
    """The passkey prompt written out from its definition (Landmark attention's generate_prompt,
    one token per filler sentence and per digit): filler cut from the start of the repeated
    pattern, the key line, filler cut from the start again, the question."""
    words = [ls.FILLER0 + (i % pattern) for i in range(size)]  # the repeated text
    key_line = [ls.KEY] + [ls.DIGIT0 + int(c) for c in key]
    return words[:before] + key_line + words[: size - before] + [ls.QUERY]


def parse_passkey(prompt: list[int], digits: int) -> tuple[str, int]:
    """(the key as a string of digits, filler tokens before it), read from the tokens alone."""
    assert prompt[-1] == ls.QUERY and prompt.count(ls.QUERY) == 1
    assert prompt.count(ls.KEY) == 1
    k = prompt.index(ls.KEY)
    names = {ls.DIGIT0 + d: str(d) for d in range(10)}
    key = "".join(names[t] for t in prompt[k + 1 : k + 1 + digits])
    others = prompt[:k] + prompt[k + 1 + digits : -1]
    assert not set(others) & set(names), "digits only in the key"
    return key, k


def check_passkey(task, prompt, answer, size):
    key, before = parse_passkey(prompt, task.digits)
    assert len(key) == task.digits and key[0] != "0"  # five digits, no leading zero
    assert 0 <= before <= size
    assert prompt == passkey_row(key, before, size, task.pattern)
    names = {ls.DIGIT0 + d: str(d) for d in range(10)}
    assert "".join(names[t] for t in answer) == key  # the answer is the key, nothing else
    PASSKEYS.append((size, before, key))


PASSKEYS: list[tuple[int, int, str]] = []  # (size, position, key) of every checked row


REFERENCE = {
    "insertion_sort": check_insertion_sort,
    "bubble_sort": check_insertion_sort,
    "minimum": check_minimum,
    "binary_search": check_binary_search,
    "find_maximum_subarray_kadane": check_kadane,
    "naive_string_matcher": check_string_matcher,
    "activity_selector": check_activity_selector,
    "bfs": check_bfs,
    "copy": check_list,
    "reverse": check_list,
    "sort": check_list,
    "mqar": check_mqar,
    "flip_flop": check_flip_flop,
    "local_count": check_local_count,
    "two_back": check_two_back,
    "passkey": check_passkey,
}


def check_batch(task: sq.SequenceTask, size: int, rows: int, seed: int) -> sq.SequenceBatch:
    """Layout invariants and the reference answer of every row."""
    b = task.batch(size, rows, gen(seed))
    tokens, targets = b.tokens, b.targets
    assert tokens.dtype == torch.int64 and targets.dtype == torch.int64
    assert tokens.shape == targets.shape == (rows, task.length(size))
    assert int(tokens.min()) >= 0 and int(tokens.max()) < task.vocab_size
    scored = targets[b.scored]
    assert int(scored.min()) >= 0 and int(scored.max()) < task.vocab_size
    assert torch.equal(b.scored, targets != IGNORE)
    for r in range(rows):
        tok, tgt = tokens[r].tolist(), targets[r].tolist()
        if task.layout == "labelling":
            assert tok[0] == BOS and tgt[0] == IGNORE and IGNORE not in tgt[1:]
            assert PAD not in tok and {BOS, SEP, EOS}.isdisjoint(tok[1:])
            REFERENCE[task.name](task, tok[1:], tgt[1:], size)
        else:
            prompt, answer = decode_seq2seq(tok, tgt)
            p = len(prompt)
            # every prompt position and SEP is IGNORE; answer tokens and EOS are scored, as the
            # next token; nothing after EOS is
            assert all(t == IGNORE for t in tgt[: p + 1])
            n_scored = len(answer) + 1
            assert tgt[p + 1 : p + 1 + n_scored] == answer + [EOS]
            assert all(t == IGNORE for t in tgt[p + 1 + n_scored :])
            REFERENCE[task.name](task, prompt, answer, size)
        text = task.text(tokens[r], targets[r])
        assert text.startswith(f"{task.name}:\n")
    return b


SIZES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 33, 64, 100)


@pytest.mark.parametrize("name", NAMES)
def test_answers_match_independent_implementations(name):
    task = sq.get(name)
    sizes = sorted({s for s in SIZES if s >= task.min_size} | {task.min_size, task.min_size + 1})
    for size in sizes:
        for seed in range(3):
            check_batch(task, size, rows=6, seed=seed)
    check_batch(task, max(task.eval_sizes), rows=2, seed=7)  # the largest evaluation size


@pytest.mark.parametrize("name", ["insertion_sort", "bubble_sort", "binary_search"])
def test_traces_match_independent_implementations(name):
    task = sq.get(name, trace=True)
    assert task.trace_cost in ("O(n^2)", "O(n log n)")
    for size in (1, 2, 3, 4, 5, 8, 17, 33):
        for seed in range(4):
            check_batch(task, size, rows=6, seed=seed)
    if name == "binary_search":
        check_batch(task, max(task.eval_sizes), rows=3, seed=1)
        # rows of one batch take different numbers of halvings: the shorter ones are padded
        b = task.batch(100, 64, gen(0))
        assert len({int(n) for n in b.scored.sum(dim=1)}) > 1


@pytest.mark.parametrize("name", ["local_count", "two_back"])
def test_seq2seq_layout_of_the_labelling_tasks(name):
    lab, s2s = sq.get(name), sq.get(name, layout="seq2seq")
    assert lab.layout == "labelling" and s2s.layout == "seq2seq"
    for size in (3, 10, 50):
        check_batch(s2s, size, rows=4, seed=size)
        a, b = lab.batch(size, 4, gen(size)), s2s.batch(size, 4, gen(size))
        p = size + (1 if name == "two_back" else 0)  # the source's length
        assert torch.equal(b.tokens[:, 1 : p + 1], a.tokens[:, 1:])  # same draws, other layout
        assert torch.equal(b.targets[:, p + 1 : 2 * p + 1], a.targets[:, 1:])


@given(
    name=st.sampled_from(NAMES),
    size=st.integers(1, 70),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60, deadline=None)
def test_property_any_size_and_seed(name, size, rows, seed):
    task = sq.get(name)
    size = max(size, task.min_size)
    check_batch(task, size, rows, seed)


@given(st.lists(st.integers(-31, 31), min_size=1, max_size=40))
@settings(max_examples=100, deadline=None)
def test_property_kadane_on_chosen_keys(a):
    """The vectorised Kadane on hand-picked keys (ties, all-negative, zeros) against brute force."""
    task = sq.get("find_maximum_subarray_kadane")
    # Feed chosen keys through the generator's own computation: patch its random draw.
    h = task.half
    keys = torch.tensor([[v + h for v in a]])
    orig = ct._randint
    try:
        ct._randint = lambda g, high, shape: keys.clone()
        b = task.batch(len(a), 1, gen(0))
    finally:
        ct._randint = orig
    prompt, answer = decode_seq2seq(b.tokens[0].tolist(), b.targets[0].tolist())
    assert [v - h for v in values(prompt, ct.VALUE0)] == a
    lo, hi = kadane_brute(a)
    assert (lo, hi) == kadane_clrs(a)
    assert mask_bits(answer) == interval(len(a), lo, hi)


# --- seeding, shapes, sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_seeded_and_length(name):
    task = sq.get(name)
    size = max(task.train_sizes)
    a, b, c = (task.batch(size, 8, gen(s)) for s in (5, 5, 6))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.tokens, c.tokens)
    for s in (*task.train_sizes, *task.eval_sizes[:3]):
        assert task.batch(s, 2, gen(0)).tokens.shape[1] == task.length(s)


@pytest.mark.parametrize("name", NAMES)
def test_sizes_and_vocabulary_defaults(name):
    task = sq.get(name)
    lo, hi = task.train_sizes
    assert task.family in sq.FAMILIES and task.layout in sq.LAYOUTS
    assert task.min_size <= lo <= hi <= 64
    ev = task.eval_sizes
    assert all(s & (s - 1) == 0 for s in ev) and list(ev) == sorted(set(ev))
    assert ev[0] <= hi * 2 and ev[-1] >= 64 * hi
    assert lo <= ev[0] <= hi or ev[0] > hi  # in the training range if a power of 2 is there
    assert task.length(ev[-1]) <= 12 * ev[-1] + 64  # linear in the size
    assert task.vocab_size <= 2 * ev[-1] + 128
    assert sq.get(name, **task.options).options == task.options  # options recreate the task
    custom = sq.get(name, train_sizes=(5, 9))
    assert custom.train_sizes == (5, 9) and custom.eval_sizes[-1] >= 64 * 9


def test_default_eval_sizes():
    assert sq.default_eval_sizes((4, 16)) == (16, 32, 64, 128, 256, 512, 1024)
    assert sq.default_eval_sizes((16, 48)) == (32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert sq.default_eval_sizes((5, 7)) == (8, 16, 32, 64, 128, 256, 512)
    assert sq.default_eval_sizes((1, 1), factor=4) == (1, 2, 4)


def test_registry_and_bad_input():
    assert set(CLRS) >= {
        "insertion_sort",
        "bubble_sort",
        "minimum",
        "binary_search",
        "find_maximum_subarray_kadane",
        "naive_string_matcher",
        "bfs",
        "activity_selector",
    }
    assert set(SYNTHETIC) == {
        "mqar",
        "copy",
        "sort",
        "reverse",
        "local_count",
        "two_back",
        "flip_flop",
        "passkey",
    }
    assert sorted(CLRS + SYNTHETIC) == NAMES and set(NAMES) <= set(sq.TASKS)
    one_sentence = re.compile(r"^[^\n]+\.$")
    cases = [
        (lambda: sq.get("quicksort"), "Unknown task 'quicksort'; known tasks: activity_selector"),
        (lambda: sq.available("nlp"), "Unknown task family"),
        (lambda: sq.get("copy", colour=3), "does not take these options"),
        (lambda: sq.get("minimum", trace=True), "minimum has no trace"),
        (lambda: sq.get("copy").batch(0, 2, gen(0)), "copy needs size >= 1, got 0"),
        (lambda: sq.get("flip_flop").length(3), "flip_flop needs size >= 4"),
        (lambda: sq.get("mqar").batch(4, 2, gen(0)), "mqar needs size >= 5"),
        (lambda: sq.get("two_back").batch(2, 2, gen(0)), "two_back needs size >= 3"),
        (lambda: sq.get("bfs").batch(1025, 1, gen(0)), "bfs can make sizes up to 1024"),
        (lambda: sq.get("bfs", pool=100), "bfs can make sizes up to 100"),
        (lambda: sq.get("copy").batch(8, 0, gen(0)), "batch must be an integer >= 1"),
        (lambda: sq.get("copy").batch(8.0, 2, gen(0)), "size must be an integer"),
        (lambda: sq.get("copy", train_sizes=(9, 3)), "train_sizes must be two integers"),
        (lambda: sq.get("sort", eval_sizes=()), "eval_sizes must be a non-empty"),
        (lambda: sq.get("local_count", layout="tree"), "layout must be one of"),
        (lambda: sq.get("flip_flop", write_prob=1.0), "write_prob must be in"),
        (lambda: sq.get("mqar", kv_fraction=0), "kv_fraction must be in"),
        (lambda: sq.get("naive_string_matcher", alphabet=1), "alphabet must be an integer >= 2"),
        (lambda: sq.get("passkey", digits=0), "digits must be an integer >= 1"),
        (lambda: sq.get("passkey", digits=19), "digits must be at most 18"),
        (lambda: sq.get("passkey", pattern=0), "pattern must be an integer >= 1"),
        (lambda: sq.get("passkey").batch(0, 2, gen(0)), "passkey needs size >= 1, got 0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert message in str(err.value) and one_sentence.match(str(err.value)), str(err.value)
    assert sq.get("bfs", pool=4096).batch(1025, 1, gen(0)).tokens.shape[1] == sq.get(
        "bfs", pool=4096
    ).length(1025)


# --- text ------------------------------------------------------------------------------------------


def test_text_in_clrs_text_format():
    v = ct.VALUE0
    row = [BOS, v + 3, v + 1, v + 2, SEP, v + 1, v + 2, v + 3]
    assert sq.get("insertion_sort").text(torch.tensor(row)) == (
        "insertion_sort:\nkey: [3 1 2]\npred:\n[1 2 3]\n\n"
    )
    row = [BOS, v + 1, v + 4, v + 9, ct.COMMA, v + 5, SEP, ct.OFF, ct.OFF, ct.ON]
    assert sq.get("binary_search").text(row) == (
        "binary_search:\nkey: [1 4 9], target: 5\nreturn:\n2\n\n"
    )
    task = sq.get("binary_search", trace=True)
    b = task.batch(6, 1, gen(3))
    text = task.text(b.tokens[0])
    assert re.fullmatch(
        r"binary_search:\nkey: \[[\d ]+\], target: \d+, initial_trace: \(0, 5\)\n"
        r"trace \| \(low, high\):\n(\(\d, \d\), )*\(\d, \d\) \| \((?P<r>\d), (?P=r)\)\n\n",
        text,
    ), text
    kadane = sq.get("find_maximum_subarray_kadane")
    h = kadane.half
    row = [BOS, v + h - 2, v + h + 3, v + h + 4, v + h - 9, SEP, ct.OFF, ct.ON, ct.ON, ct.OFF]
    assert kadane.text(row).split("\n")[1:4] == ["key: [-2 3 4 -9]", "start, end:", "1, 2"]
    for name in CLRS:
        t = sq.get(name)
        b = t.batch(5, 1, gen(0))
        lines = t.text(b.tokens[0]).split("\n")
        assert lines[0] == f"{name}:" and lines[2] == f"{t.output_name}:" and lines[-2:] == ["", ""]


def test_text_of_the_synthetic_suite():
    mqar = sq.get("mqar")
    b = mqar.batch(10, 1, gen(0))
    lines = mqar.text(b.tokens[0]).split("\n")
    assert lines[0] == "mqar:" and re.fullmatch(r"src: [_\d: ]+( \? \d+){4}", lines[1])
    assert lines[1].count(":") == 1 + mqar.pairs(10)
    assert re.fullmatch(r"trg: (\? \d+ ?){4}", lines[2])
    lc = sq.get("local_count")
    b = lc.batch(6, 1, gen(0))
    lines = lc.text(b.tokens[0], b.targets[0]).split("\n")
    assert re.fullmatch(r"src: \d+( \d+){5}", lines[1]) and re.fullmatch(
        r"labels: 0( \d+){5}", lines[2]
    )
    ff = sq.get("flip_flop")
    b = ff.batch(6, 1, gen(0))
    assert re.fullmatch(r"flip_flop:\nsrc: w [01] [wi] [01] r\ntrg: [01]\n", ff.text(b.tokens[0]))
    pk = sq.get("passkey")
    row = pk.batch(7, 1, gen(0)).tokens[0]
    m = re.fullmatch(
        r"passkey:\nsrc: ([a-z ]*)key (\d) (\d) (\d) (\d) (\d) ([a-z ]*)\?\n"
        r"trg: (\d \d \d \d \d)\n",
        pk.text(row),
    )
    assert m, pk.text(row)
    assert m[8] == " ".join(m.group(2, 3, 4, 5, 6))
    words = (m[1] + m[7]).split()
    assert len(words) == 7 and set(words) <= set(ls.FILLER_WORDS)


# --- distributions (light sanity) -----------------------------------------------------------------


def test_generators_spread_their_draws():
    MQAR_OFFSETS.clear()
    check_batch(sq.get("mqar"), 2000, rows=4, seed=0)  # 64 pairs in regions of 31 tokens
    assert len(set(MQAR_OFFSETS)) > 3  # the unit's place in its region varies
    b = sq.get("flip_flop").batch(64, 2000, gen(0))
    ones = (b.targets[b.scored] == ls.BIT0 + 1).float().mean()  # bits and EOS
    assert 0.2 < float(ones) < 0.3  # half of the answer bits (EOS is the other half)
    lc = sq.get("local_count")
    b = lc.batch(400, 4, gen(0))
    counts = b.targets[:, 1:] - lc.count0
    assert int(counts.max()) == lc.max_reps - 1  # the longest blocks occur
    s = sq.get("naive_string_matcher").batch(64, 256, gen(0))
    first = [
        decode_seq2seq(s.tokens[r].tolist(), s.targets[r].tolist())[1].index(ct.ON)
        for r in range(256)
    ]
    assert min(first) < 5 and max(first) > 40  # the needle is planted anywhere


# --- passkey retrieval ------------------------------------------------------------------------------


def test_passkey_position_and_digits_are_uniform():
    """Position uniform on 0..size (chi-square over the size + 1 places, at fixed seeds so the
    test is deterministic), each digit uniform (the first on 1..9), positions at both ends."""
    task = sq.get("passkey")
    for size, rows in ((15, 3200), (63, 6400)):
        PASSKEYS.clear()
        for seed in range(4):
            check_batch(task, size, rows=rows // 4, seed=seed)
        where = [p for _, p, _ in PASSKEYS]
        counts = [where.count(i) for i in range(size + 1)]
        assert counts[0] > 0 and counts[-1] > 0
        assert stats.chisquare(counts).pvalue > 0.01, counts
        for i in range(task.digits):
            digit = [int(k[i]) for _, _, k in PASSKEYS]
            seen = [digit.count(d) for d in range(1 if i == 0 else 0, 10)]
            assert sum(seen) == rows and stats.chisquare(seen).pvalue > 0.01, (i, seen)
    # the rows of a batch are independent draws: many different keys and places
    b = task.batch(40, 64, gen(0))
    assert len({tuple(r) for r in b.targets.tolist()}) > 60


def test_passkey_seeded_sizes_and_options():
    task = sq.get("passkey")
    assert task.family == "synthetic" and task.layout == "seq2seq"
    assert task.train_sizes == (16, 48) and task.eval_sizes[-1] >= 64 * 48
    assert task.vocab_size == sq.N_SPECIAL + 10 + 2 + 5  # specials, digits, key, ?, filler
    a, b, c = (task.batch(30, 5, gen(s)) for s in (11, 11, 12))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.targets, c.targets)
    for size in (1, 16, 48, 3072, 4096):  # up to 64x (and 85x) the longest training filler
        assert task.length(size) == size + 14
        PASSKEYS.clear()
        batch = check_batch(task, size, rows=2, seed=size)
        assert int(batch.scored.sum()) == 2 * 6  # five digits and EOS per row, nothing else
        assert [s for s, _, _ in PASSKEYS] == [size, size]
    other = sq.get("passkey", digits=3, pattern=2)
    assert other.options == {"digits": 3, "pattern": 2} and other.vocab_size == sq.N_SPECIAL + 14
    for size in (1, 2, 9, 100):
        check_batch(other, size, rows=8, seed=size)
    assert other.length(9) == 9 + 2 * 3 + 4
    one = sq.get("passkey", digits=1, pattern=1)
    check_batch(one, 5, rows=16, seed=0)
