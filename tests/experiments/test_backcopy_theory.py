"""The simplified model of Guo et al. Section 2.2: Proposition A.0 and the Theorem 2 flows,
against autograd and an independent NumPy integration."""

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn.experiments.backcopy.theory import SimplifiedModel, gradient_flow
from sharpattn.tasks.bigram_backcopy import BigramBackcopy

pytestmark = pytest.mark.numerical


def small_model(seed=0, v=5, n_triggers=1, zero_column=False):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(v), size=v)
    if zero_column:  # token v−1 follows no non-trigger (like '&' in tiny Shakespeare)
        p[n_triggers:, -1] = 0
        p /= p.sum(-1, keepdims=True)
    pi = rng.dirichlet(np.ones(v))
    trig = np.arange(v) < n_triggers
    return SimplifiedModel(
        P=p,
        pi_tilde=np.where(trig, 0, pi),
        M=10 * pi,
        xi=np.where(trig, 0, rng.uniform(0.5, 2, v)),
    )


def np_loss(m, a, b):
    """Eq. (10)-(11) written out independently: Σ_v π̃_v Σ_k p_vk (log Σ_i p_vi e^{x_vi} − x_vk − log p_vk)."""
    total = 0.0
    mm = m.M.sum()
    for v in range(len(a)):
        x = (np.exp(a[v]) * b + m.M * m.xi) / (np.exp(a[v]) + mm)
        lse = np.log(np.sum(m.P[v] * np.exp(x)))
        k = m.P[v] > 0
        total += m.pi_tilde[v] * np.sum(m.P[v, k] * (lse - x[k] - np.log(m.P[v, k])))
    return total


def fd_grad(m, a, b, h=1e-6):
    ga, gb = np.zeros_like(a), np.zeros_like(b)
    for i in range(len(a)):
        e = np.zeros_like(a)
        e[i] = h
        ga[i] = (np_loss(m, a + e, b) - np_loss(m, a - e, b)) / (2 * h)
        gb[i] = (np_loss(m, a, b + e) - np_loss(m, a, b - e)) / (2 * h)
    return ga, gb


def test_loss_and_proposition_a0_against_autograd_on_the_real_task():
    task = BigramBackcopy.tiny_shakespeare()
    m = SimplifiedModel.from_task(task)
    rng = np.random.default_rng(1)
    a, b = rng.normal(2, 1, m.V), rng.normal(0, 1, m.V)
    at = torch.tensor(a, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    ea = torch.exp(at)[:, None]
    x = (ea * bt[None] + torch.tensor(m.M * m.xi)[None]) / (ea + m.M.sum())
    logl = torch.log_softmax(x + torch.log(torch.tensor(m.P)), -1)
    p = torch.tensor(m.P)
    loss = -(torch.tensor(m.pi_tilde)[:, None] * torch.where(p > 0, p * logl, 0)).sum()
    loss.backward()
    # float64 sums over V·V terms of size |log p| ≤ −log min P: the loss, and the gradients
    # (terms of the size of the largest component)
    n, big = m.V * m.V, float(-np.log(m.P[m.P > 0].min()))
    assert_close(m.loss(a, b), float(loss.detach()), dtype=torch.float64, n=n, magnitude=big)
    ga, gb = m.grad(a, b)
    for g, ref in ((ga, at.grad), (gb, bt.grad)):
        assert_close(g, ref, n=n, magnitude=float(ref.abs().max()))


def test_gradient_flow_against_an_independent_rk4():
    m = small_model()
    rng = np.random.default_rng(2)
    a0, b0 = rng.normal(0, 1, 5), rng.normal(0, 1, 5)
    assert_close(np_loss(m, a0, b0), m.loss(a0, b0), dtype=torch.float64, n=m.V * m.V)
    flow = gradient_flow(m, a0, b0, 10.0, n_points=5)
    # classical RK4 on dx/dt = −∇loss, gradient by central differences of np_loss
    y, dt = np.concatenate([a0, b0]), 0.1

    def f(y):
        ga, gb = fd_grad(m, y[:5], y[5:])
        return -np.concatenate([ga, gb])

    for _ in range(int(round(10.0 / dt))):
        k1 = f(y)
        k2 = f(y + dt / 2 * k1)
        k3 = f(y + dt / 2 * k2)
        k4 = f(y + dt * k3)
        y = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    assert_close(flow.t[-1], 10.0, dtype=torch.float64, n=5)  # a time grid of 5 points
    # not rounding: two integrators (the library's adaptive solver and RK4 at dt = 0.1 on
    # central-difference gradients) each carry a truncation error of about 1e-7 here
    np.testing.assert_allclose(flow.alpha[-1], y[:5], atol=1e-6)
    np.testing.assert_allclose(flow.beta[-1], y[5:], atol=1e-6)
    assert np.abs(flow.beta[-1] - b0).max() > 1e-2  # it moved: the comparison can fail


def test_theorem_2a_alpha_grows_like_half_log_t():
    m = small_model(seed=3)
    flow = gradient_flow(m, 0.0, 0.0, 1e14, train=("alpha",), n_points=60)
    late = flow.t >= 1e12
    off = m.alpha_offset()
    for v in range(1, 5):  # non-triggers
        slope = np.polyfit(np.log(flow.t[late]), flow.alpha[late, v], 1)[0]
        # an asymptotic law (½ log t + offset) checked at finite t: the 0.01 is the theorem's
        # o(1) at t ≥ 1e12, not rounding
        assert abs(slope - 0.5) <= 0.01
        assert abs(flow.alpha[-1, v] - 0.5 * np.log(flow.t[-1]) - off[v]) <= 0.01
    assert np.all(flow.alpha[:, 0] == 0)  # a trigger's α has no gradient (π̃ = 0)
    assert np.all(flow.beta == 0)  # β fixed


@pytest.mark.parametrize("zero_column", [False, True])
def test_theorem_2b_beta_limit(zero_column):
    m = small_model(seed=4, zero_column=zero_column)
    rng = np.random.default_rng(5)
    b0 = rng.normal(0, 1, 5)
    flow = gradient_flow(m, 2.0, b0, 1e8, train=("beta",))
    exact = m.beta_limit_exact(2.0, b0)
    # not rounding: the solver's tolerance at t = 1e8 (the limit is approached as 1/t)
    np.testing.assert_allclose(flow.beta[-1], exact, atol=1e-7)
    ga, gb = m.grad(np.full(5, 2.0), exact)
    # a stationary point: 0 up to the rounding of sums of V·V terms of size |β|
    assert_close(gb, np.zeros(5), n=m.V * m.V, magnitude=float(np.abs(exact).max()))
    # the flow conserves Σβ exactly; the solver keeps it to its tolerance (rtol 1e-9, atol 1e-11)
    assert abs(flow.beta[-1].mean() - b0.mean()) <= 1e-9
    printed = m.beta_limit(2.0, b0)
    if zero_column:  # the printed formula assumes every token follows some non-trigger
        assert len(np.unique(m.components())) == 2
        assert flow.beta[-1, -1] == b0[-1]  # a zero column: no gradient, never moves
        assert np.abs(printed - exact).max() > 1e-3
    else:
        assert_close(printed, exact, n=m.V, magnitude=float(np.abs(b0).max()))  # two closed forms


def test_flow_errors():
    m = small_model()
    with pytest.raises(ValueError, match="train"):
        gradient_flow(m, 0.0, 0.0, 1.0, train=("gamma",))
    with pytest.raises(ValueError, match="t_end"):
        gradient_flow(m, 0.0, 0.0, 0.0)
