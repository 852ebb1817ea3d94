"""Corollary B.1 on the max-retrieval set model (issue 15, item 9b): the closed form against
the model's own forward, the search for n against brute force, and the proof's bound."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn.cli import main
from sharpattn.experiments import corollary_b1 as cb
from sharpattn.experiments import max_retrieval as mr
from sharpattn.lab.runner import RunFolder
from sharpattn.models import SetAttention

pytestmark = pytest.mark.numerical

P = 24


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = SetAttention(width=8).double().eval()
    pairs = cb.sample_pairs(P, torch.Generator().manual_seed(1))
    return model, pairs


def test_pairs_are_ordered_with_different_classes():
    xa, xb, q, ka, kb = cb.sample_pairs(500, torch.Generator().manual_seed(2))
    assert torch.all(xa[:, 0] > xb[:, 0]) and torch.all(ka != kb)
    assert torch.equal(xa[:, 1:].argmax(-1), ka) and torch.equal(xb[:, 1:].argmax(-1), kb)
    assert xa.shape == (500, 11) and q.shape == (500, 1)
    with pytest.raises(ValueError, match="pairs"):
        cb.sample_pairs(0, torch.Generator())


@pytest.mark.parametrize("method", ["softmax", "adaptive"])
def test_closed_form_is_the_models_own_forward(tiny, method):
    """α and the class logits of {v_a, v_b × (n − 1)} from the closed form equal the model's
    forward on the real set (float64 model; sums of n terms of size ≤ 1)."""
    model, (xa, xb, q, ka, _) = tiny
    xa, xb, q = xa.double(), xb.double(), q.double()
    pm = cb.PairModel(model, xa, xb, q)
    for n in (1, 2, 7, 300):
        alpha = cb.weight_of_a(torch.tensor([[float(n)]]), pm.e_a[:, None], pm.e_b[:, None], method)
        logits = pm.logits(alpha)[:, 0]  # (P, C)
        for i in range(0, P, 5):
            x = torch.cat((xa[i : i + 1], xb[i : i + 1].expand(n - 1, -1)))[None]
            out, w = model(x, q[i : i + 1], method=method, return_weights=True)
            # a softmax row of n float64 terms; β(H) multiplies H's error by |β'(H)| ≤ 5
            assert_close(alpha[i, 0], w[0, 0], n=n, magnitude=5 * max(1, math.log(n)))
            assert_close(logits[i], out[0], n=n * 8, magnitude=5 * float(out.detach().abs().max()))


def _brute_first(pm, ka, method, limit):
    ns = torch.arange(1, limit + 1, dtype=torch.float64)[None].expand(len(ka), -1)
    alpha = cb.weight_of_a(ns, pm.e_a[:, None], pm.e_b[:, None], method)
    bad = pm.predict(alpha) != ka[:, None]
    first = torch.where(bad.any(-1), bad.float().argmax(-1) + 1.0, torch.tensor(-1.0))
    return first


@pytest.mark.parametrize("method", ["softmax", "adaptive"])
def test_search_finds_the_first_misclassified_n(tiny, method):
    model, (xa, xb, q, ka, kb) = tiny
    pm = cb.PairModel(model, xa, xb, q)
    res = cb.measure_pairs(model, xa, xb, q, ka, kb, method)
    brute = _brute_first(pm, ka, method, 2000)
    small = brute > 0  # pairs that fail within 2000 items, found by trying every n
    assert small.sum() >= 3
    assert torch.equal(res["n_fail"][small], brute[small])
    assert torch.all(res["n_fail"][~small] > 2000) or torch.all(res["n_fail"][~small] == -1)


def test_search_is_exact_for_thresholds_beyond_float_integers():
    for t in (1.0, 2.0, 37.0, 123_456_789.0, 4.2e17, 3.3e33):
        got = cb.first_n(lambda n, t=t: n >= t, 1)
        assert abs(got.item() - t) <= max(1.0, 1e-12 * t), (t, got)
    assert cb.first_n(lambda n: n > 1e41, 1).item() == -1  # beyond the search limit


@pytest.mark.parametrize("method", ["softmax", "adaptive"])
def test_failure_and_epsilon_come_before_the_corollarys_bound(tiny, method):
    """n_B1 = e^{βδ}/ε bounds where α < ε (the proof: α ≤ e^{βδ}/n) and so, for proper pairs,
    where the prediction must have become κ_b's."""
    model, (xa, xb, q, ka, kb) = tiny
    res = cb.measure_pairs(model, xa, xb, q, ka, kb, method)
    assert torch.all(res["n_eps"] > 0)
    # the proof: α < ε for every integer n > e^{βδ}/ε, so the first such n is ≤ that bound + 1
    bound = 10 ** res["log10_n_bound"] * (1 + 1e-12)
    assert torch.all(res["n_eps"] - 1 <= bound)
    # α < ε at n_eps, not before: the softmax weight transcribed in NumPy float64
    if method == "softmax":
        gaps, n_eps = res["e_gap"].numpy(), res["n_eps"].numpy()
        a_at = 1 / (1 + (n_eps - 1) * np.exp(-gaps))
        a_before = 1 / (1 + (n_eps - 2) * np.exp(-gaps))
        assert np.all(a_at < cb.EPS) and np.all(a_before >= cb.EPS * (1 - 1e-12))
    proper = res["proper"] & (res["n_fail"] > 0)
    assert torch.all(res["n_fail"][proper] - 1 <= bound[proper])


def test_weight_of_a_rejects_other_methods():
    with pytest.raises(ValueError, match="method"):
        cb.weight_of_a(torch.tensor(3.0), torch.tensor(1.0), torch.tensor(0.0), "relu")


def test_cli_on_a_tiny_trained_run(tmp_path, capsys):
    # a run folder with one trained seed (training only: no evaluation or figures)
    config = mr.Config(seeds=1, group=1, steps=5, sizes=(16,), checkpoint_every=5, log_every=5)
    run = RunFolder(tmp_path, "max-retrieval", asdict(config), identity=()).path
    mr.train_all(run, config)
    assert main(["corollary-b1", str(run), "--pairs", "4"]) == 0
    out = capsys.readouterr().out
    assert "n_fail" in out and (run / "corollary_b1.json").is_file()
    assert "Corollary B.1" in (run / "report.md").read_text()
    assert main(["corollary-b1", str(run), "--seeds", "5"]) == 2
    err = capsys.readouterr().err
    assert "seed" in err and "Traceback" not in err
