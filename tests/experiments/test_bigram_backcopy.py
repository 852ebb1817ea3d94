"""The Bigram-Backcopy task: counts against the corpus, sampler properties, exact Bayes risk."""

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from precision import assert_close
from sharpattn.tasks.bigram_backcopy import (
    KIND_BACKCOPY,
    KIND_BIGRAM,
    KIND_BOS,
    BigramBackcopy,
    count_text,
    packaged_counts,
)

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"

pytestmark = pytest.mark.numerical


@pytest.fixture(scope="module")
def task():
    return BigramBackcopy.tiny_shakespeare()


def test_packaged_counts_equal_a_direct_count_of_the_corpus():
    text = CORPUS.read_text(encoding="utf-8")
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    uniq, counts = np.unique(codes, return_counts=True)
    assert len(uniq) == 65  # tiny Shakespeare: 65 characters, the rarest is dropped
    order = sorted(range(len(uniq)), key=lambda i: (-counts[i], uniq[i]))[:64]
    kept = [chr(int(uniq[i])) for i in order]
    index = np.full(int(uniq.max()) + 1, -1)
    index[[ord(c) for c in kept]] = np.arange(64)
    a, b = index[codes[:-1]], index[codes[1:]]
    ok = (a >= 0) & (b >= 0)
    direct = np.zeros((64, 64), dtype=np.int64)
    np.add.at(direct, (a[ok], b[ok]), 1)

    pkg = packaged_counts()
    assert pkg["chars"] == kept
    assert pkg["unigram_counts"] == [int(counts[i]) for i in order]
    assert np.array_equal(np.array(pkg["bigram_counts"]), direct)
    assert "$" not in kept and kept[:3] == [" ", "e", "t"]


def test_from_text_equals_the_packaged_task(task):
    other = BigramBackcopy.from_text(CORPUS)
    assert other.chars == task.chars
    assert torch.equal(other.transition, task.transition)


def test_vocabulary_triggers_and_transition(task):
    assert (task.V, task.bos, task.vocab_size) == (64, 64, 65)
    assert [task.chars[i] for i in task.triggers] == [" ", "e", "t"]
    p = task.transition
    assert_close(p.sum(-1), torch.ones(64, dtype=torch.float64), n=64)
    c = torch.tensor(packaged_counts()["bigram_counts"], dtype=torch.float64)
    assert_close(p, c / c.sum(-1, keepdim=True), n=64)
    assert task.decode(task.encode("the cat")) == "⟨s⟩the cat"


def test_count_text_on_a_small_text_and_errors(tmp_path):
    text = "aaaabbbccd" * 3 + "z"
    c = count_text(text, vocab_size=4)
    assert c["chars"] == ["a", "b", "c", "d"]
    assert c["bigram_counts"][0][0] == 9 and c["bigram_counts"][3][0] == 2  # "da" twice
    with pytest.raises(ValueError, match="distinct characters"):
        count_text("abc", vocab_size=4)
    with pytest.raises(FileNotFoundError, match="no text file"):
        BigramBackcopy.from_text(tmp_path / "missing.txt")
    path = tmp_path / "t.txt"
    path.write_text(text * 5)
    t = BigramBackcopy.from_text(path, vocab_size=4, n_triggers=1)
    x = t.sample(8, 30, seed=0)
    assert int(x[:, 1:].max()) < 4


def test_samples_follow_the_rules(task):
    x = task.sample(64, 200, seed=3)
    assert x.shape == (64, 200) and x.dtype == torch.long
    assert bool((x[:, 0] == task.bos).all()) and bool((x[:, 1:] != task.bos).all())
    assert not bool(task.is_trigger(x[:, 1]).any())  # the first token is not a trigger
    trig = task.is_trigger(x[:, 1:-1])
    assert bool((x[:, 2:][trig] == x[:, :-2][trig]).all())  # backcopy after every trigger
    assert int(trig.sum()) > 1000  # triggers are common (a third of the tokens or so)
    assert torch.equal(x, task.sample(64, 200, seed=3))
    assert not torch.equal(x, task.sample(64, 200, seed=4))


def test_first_token_distribution(task):
    x = task.sample(40_000, 2, seed=11)[:, 1]
    observed = torch.bincount(x, minlength=64).double()
    expected = task.first_distribution * len(x)
    assert float(task.first_distribution[:3].sum()) == 0.0 and int(observed[:3].sum()) == 0
    common = expected > 20
    res = chisquare(
        observed[common], expected[common] * observed[common].sum() / expected[common].sum()
    )
    assert res.pvalue > 1e-3


def test_bigram_transitions_after_non_triggers(task):
    x = task.sample(2000, 128, seed=5)
    cur, nxt = x[:, 1:-1], x[:, 2:]
    p = task.transition
    for v in (3, 4, 5):  # the most frequent non-triggers: 'o', 'a', 'h'
        observed = torch.bincount(nxt[cur == v], minlength=64).double()
        expected = p[v] * observed.sum()
        common = expected > 10
        res = chisquare(
            observed[common], expected[common] * observed[common].sum() / expected[common].sum()
        )
        assert res.pvalue > 1e-3, (v, res)


def test_bayes_risk_is_exact(task):
    x = task.sample(16, 100, seed=1)
    risk = task.bayes_risk(x)
    kind = task.position_kind(x)
    assert bool((kind[:, 0] == KIND_BOS).all())
    assert float(risk[kind == KIND_BACKCOPY].abs().max()) == 0.0  # zero after every trigger
    p = task.transition.numpy()
    h = -np.array([sum(q * np.log(q) for q in row if q > 0) for row in p])
    sel = kind == KIND_BIGRAM
    # entropies: sums of 64 terms ≤ 1/e each, magnitude log 64
    assert_close(risk[sel], h[x[sel].numpy()], n=64, magnitude=np.log(64))
    f = task.first_distribution.numpy()
    h0 = -(f[f > 0] * np.log(f[f > 0])).sum()
    assert_close(risk[:, 0], np.full(risk.shape[0], h0), n=64, magnitude=np.log(64))
    dist = task.next_token_distribution(x)
    assert_close(dist.sum(-1), torch.ones_like(risk), n=65)
    copies = dist[:, 1:][kind[:, 1:] == KIND_BACKCOPY]
    assert torch.equal(copies.argmax(-1), x[:, :-1][kind[:, 1:] == KIND_BACKCOPY])


def test_bad_sequences_raise(task):
    with pytest.raises(ValueError, match="BOS"):
        task.bayes_risk(torch.tensor([[3, 4, 5]]))
    with pytest.raises(ValueError, match="trigger"):
        task.bayes_risk(torch.tensor([[task.bos, 0, 4]]))
    with pytest.raises(ValueError, match="token ids"):
        task.bayes_risk(torch.tensor([[task.bos, 99]]))
    with pytest.raises(ValueError, match="batch"):
        task.sample(0, 10)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        task.encode("$")


def test_stationary_distribution(task):
    pi = task.stationary_distribution()
    # a float64 stationary vector of a 64-state chain: π P = π up to the rounding of 64-term sums
    assert_close(pi @ task.transition, pi, n=64, magnitude=float(pi.max()))
    assert_close(pi.sum(), 1.0, n=64)
    freq = torch.tensor(packaged_counts()["unigram_counts"], dtype=torch.float64)
    # ≈ the corpus frequencies (a modelling statement: the chain's edge effects, not rounding)
    assert float((pi - freq / freq.sum()).abs().max()) < 1e-3


def test_counts_helper_matches_counter():
    text = "hello world, hello there"
    c = count_text(text, vocab_size=5)
    freq = Counter(text)
    assert c["unigram_counts"] == [freq[ch] for ch in c["chars"]]


def test_risks_of_the_true_distribution_are_bayes(task):
    x = task.sample(8, 40, seed=0)
    p = task.next_token_distribution(x)
    r = task.risks(torch.log(p.clamp_min(1e-300)), x)
    # a risk minus the Bayes risk: means over 8·40 positions of float64 terms up to log 64
    for key in ("bigram_excess", "backcopy_excess"):
        assert_close(r[key], 0.0, dtype=torch.float64, n=8 * 40, magnitude=math.log(64))
    uniform = task.risks(torch.zeros(8, 40, 64), x)
    assert_close(uniform["backcopy_risk"], math.log(64), dtype=torch.float32, n=8 * 40)
    assert uniform["bigram_excess"] > 1.0
