"""The sequence-task engine (experiments/sequence.py) behind `reproduce clrs` and `leaderboard`:
its measures against independent computations, the method list, training/evaluation of one job,
resume, and both commands end to end on a tiny configuration."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from sharpattn import normalizers as nz
from sharpattn.cli import main
from sharpattn.experiments import clrs, leaderboard
from sharpattn.experiments import sequence as seq

pytestmark = pytest.mark.usefixtures("one_thread")


def test_area_is_the_trapezoid_on_log2_size_normalised():
    sizes, acc = [4, 8, 32, 256], [1.0, 0.5, 0.25, 0.0]
    x = [math.log2(s) for s in sizes]  # 2, 3, 5, 8: independent trapezoid by hand
    by_hand = sum((x[i + 1] - x[i]) * (acc[i] + acc[i + 1]) / 2 for i in range(3)) / (x[-1] - x[0])
    assert seq.area(sizes, acc) == pytest.approx(by_hand, rel=1e-12)
    assert seq.area(sizes, [1.0] * 4) == pytest.approx(1.0, rel=1e-12)
    assert seq.area(sizes, [0.0] * 4) == 0.0
    assert seq.area([16], [0.75]) == 0.75


def test_every_trainable_registry_method_is_on_the_leaderboard():
    ms = seq.methods()
    for name in nz.available():
        assert (name in ms) != (name in seq.UNTRAINABLE), name
    assert ms["adaptive (inference)"].recipe == ms["softmax"].recipe  # shares the softmax model
    assert ms["adaptive"].recipe != ms["softmax"].recipe
    assert {"selective_q", "selective_v", "selective_qv"} <= set(ms)
    with pytest.raises(ValueError, match="unknown leaderboard method"):
        seq.resolve(["softmax", "nope"])


def test_compare_is_scipys_paired_t_test():
    a = {0: {"auc": 0.1}, 1: {"auc": 0.3}, 2: {"auc": 0.2}}
    b = {0: {"auc": 0.4}, 1: {"auc": 0.35}, 2: {"auc": 0.6}}
    mean, sd, p = seq.compare(b, a, "auc")
    vb = [0.4, 0.35, 0.6]
    assert mean == pytest.approx(np.mean(vb), rel=1e-12)
    assert sd == pytest.approx(np.std(vb, ddof=1), rel=1e-12)
    assert p == pytest.approx(stats.ttest_rel(vb, [0.1, 0.3, 0.2]).pvalue, rel=1e-9)
    one = seq.compare({0: {"auc": 0.5}}, {0: {"auc": 0.1}}, "auc")
    assert one[0] == 0.5 and math.isnan(one[1]) and math.isnan(one[2])
