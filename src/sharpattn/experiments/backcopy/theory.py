"""The simplified model of Guo et al. Section 2.2 and the gradient flow of Theorem 2.

The attention head is reduced to the attention logits α ∈ R^V of the BOS key (one per query
token) and the value state β ∈ R^V of BOS; the MLP outputs log P exactly and the value state of
a token k is ξ_k·e_k. For a non-trigger query v the output logits are (Eq. 9)

    TF_v = log p_v + (e^{α_v}·β + M∘ξ) / (e^{α_v} + M),

with M_k the number of tokens k in the context and M = Σ_k M_k. The loss is the cross-entropy
against p_v, averaged with the stable distribution restricted to non-triggers π̃ (Eq. 10-11).
Its gradient flow is (Proposition A.0)

    dα_v/dt = π̃_v e^{α_v} / (e^{α_v} + M)² · Σ_i (p_vi − l_vi)(M β_i − M_i ξ_i),
    dβ_v/dt = Σ_k π̃_k e^{α_k} / (e^{α_k} + M) · (p_kv − l_kv),

l_v = softmax(TF_v). Theorem 2: (a) with β = b·1 fixed, α(t) = ½ log t · 1 + r(t) with r
bounded; (b) with α = a·1 fixed, β(t) → [β̄(0) + e^{−a} B̄]·1 − e^{−a} M∘ξ, B̄ = mean(M∘ξ)
(the mean of β is conserved: Σ_v dβ_v/dt = 0).

Beyond the paper (our expansion, checked numerically in the report): for large α,
E_l[Mξ] − E_p[Mξ] ≈ Var_{p_v}(Mξ)/(e^α + M), so dα_v/dt ≈ π̃_v Var_{p_v}(Mξ) e^{−2α_v} and
r_v(t) → ½ log(2 π̃_v Var_{p_v}(Mξ)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.integrate import solve_ivp


@dataclass(frozen=True)
class SimplifiedModel:
    """Fixed quantities of the simplified model (all float64 NumPy arrays of length V).

    P: ``[V, V]`` bigram transition; pi_tilde: stable distribution, 0 on triggers; M: token
    counts in the context; xi: value scales ξ (0 on triggers).
    """

    P: np.ndarray
    pi_tilde: np.ndarray
    M: np.ndarray
    xi: np.ndarray

    @classmethod
    def from_task(cls, task, n: int = 255, xi: float = 1.0) -> SimplifiedModel:
        """From a `BigramBackcopy` task: π = stationary
        distribution of P, M = n·π (a context of n tokens with stationary counts), ξ = ``xi``
        on non-triggers."""
        pi = task.stationary_distribution().cpu().numpy()
        trig = np.zeros(task.V, dtype=bool)
        trig[list(task.triggers)] = True
        return cls(
            P=task.transition.cpu().numpy(),
            pi_tilde=np.where(trig, 0.0, pi),
            M=n * pi,
            xi=np.where(trig, 0.0, float(xi)),
        )

    @property
    def V(self) -> int:  # noqa: N802
        return len(self.pi_tilde)

    @property
    def m_total(self) -> float:
        return float(self.M.sum())

    def probs(self, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """``[V, V]`` predicted distributions l_v = softmax(TF_v) (Eq. 9, 17)."""
        ea = np.exp(alpha)[:, None]
        x = (ea * beta[None, :] + (self.M * self.xi)[None, :]) / (ea + self.m_total)
        x = x - x.max(-1, keepdims=True)
        w = self.P * np.exp(x)
        return w / w.sum(-1, keepdims=True)

    def loss(self, alpha: np.ndarray, beta: np.ndarray) -> float:
        """Σ_v π̃_v · CE(p_v, l_v) (Eq. 10-11, 19)."""
        logl = np.log(np.where(self.P > 0, self.probs(alpha, beta), 1.0))
        return float(-(self.pi_tilde[:, None] * self.P * logl).sum())

    def grad(self, alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(∂loss/∂α, ∂loss/∂β) from Proposition A.0."""
        m = self.m_total
        ea = np.exp(alpha)
        diff = self.probs(alpha, beta) - self.P  # l − p, [V, V]
        g_alpha = self.pi_tilde * ea / (ea + m) ** 2 * (diff @ (m * beta - self.M * self.xi))
        g_beta = (self.pi_tilde * ea / (ea + m)) @ diff
        return g_alpha, g_beta

    def beta_limit(self, alpha: float, beta0: np.ndarray) -> np.ndarray:
        """Theorem 2(b) as printed: lim β(t) = [β̄(0) + e^{−α} B̄]·1 − e^{−α} M∘ξ (α = alpha·1)."""
        mx = self.M * self.xi
        return (beta0.mean() + np.exp(-alpha) * mx.mean()) - np.exp(-alpha) * mx

    def components(self) -> np.ndarray:
        """``[V]`` label of each token's component: tokens are linked when they share the
        support of a bigram row with π̃ > 0. A token after no non-trigger is alone."""
        parent = list(range(self.V))

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for k in np.flatnonzero(self.pi_tilde > 0):
            support = np.flatnonzero(self.P[k] > 0)
            for j in support[1:]:
                parent[find(j)] = find(support[0])
        return np.array([find(i) for i in range(self.V)])

    def beta_limit_exact(self, alpha: float, beta0: np.ndarray) -> np.ndarray:
        """The limit of the β flow without assuming every token follows some non-trigger.

        Σ_{v∈C} dβ_v/dt = 0 on every component C of `components` (each row's l and p
        both sum to 1 over the component holding its support), so the limit is
        β_v = mean_C β(0) + e^{−α}(mean_C(M∘ξ) − M_v ξ_v). With one component this is the
        printed Theorem 2(b); a token that never follows a non-trigger keeps β_v(0).
        """
        mx = self.M * self.xi
        out = np.empty(self.V)
        labels = self.components()
        for c in np.unique(labels):
            idx = labels == c
            out[idx] = beta0[idx].mean() + np.exp(-alpha) * (mx[idx].mean() - mx[idx])
        return out

    def alpha_offset(self) -> np.ndarray:
        """Our leading-order constant of Theorem 2(a): α_v(t) − ½ log t → ½ log(2 π̃_v Var_{p_v}(Mξ))
        (NaN on triggers, whose α does not move)."""
        mx = self.M * self.xi
        var = self.P @ mx**2 - (self.P @ mx) ** 2
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.pi_tilde > 0, 0.5 * np.log(2 * self.pi_tilde * var), np.nan)


@dataclass
class Flow:
    """A solved gradient flow: times ``t`` ``[T]``, ``alpha`` and ``beta`` ``[T, V]``."""

    t: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray


def gradient_flow(
    model: SimplifiedModel,
    alpha0: np.ndarray,
    beta0: np.ndarray,
    t_end: float,
    *,
    train: tuple[str, ...] = ("alpha", "beta"),
    n_points: int = 200,
    rtol: float = 1e-9,
    atol: float = 1e-11,
) -> Flow:
    """Integrate dα/dt = −∂loss/∂α, dβ/dt = −∂loss/∂β (the variables not in ``train`` stay
    fixed) from t = 0 to ``t_end``, reporting ``n_points`` log-spaced times (and t = 0).

    The flow is solved in τ = log(1 + t) (dx/dτ = (1 + t)·dx/dt), so t up to 1e12 costs a few
    hundred steps: α grows like ½ log t, which is linear in τ.
    """
    bad = set(train) - {"alpha", "beta"}
    if bad or not train:
        raise ValueError(f"train must name 'alpha' and/or 'beta', got {train!r}.")
    if not t_end > 0:
        raise ValueError(f"t_end must be positive, got {t_end}.")
    v = model.V
    alpha0 = np.asarray(alpha0, dtype=np.float64) * np.ones(v)
    beta0 = np.asarray(beta0, dtype=np.float64) * np.ones(v)

    def rhs(tau, y):
        a, b = y[:v], y[v:]
        ga, gb = model.grad(a, b)
        scale = np.exp(tau)  # 1 + t
        return np.concatenate(
            [
                -scale * ga if "alpha" in train else np.zeros(v),
                -scale * gb if "beta" in train else np.zeros(v),
            ]
        )

    t_eval = np.concatenate([[0.0], np.logspace(-2, np.log10(t_end), n_points)])
    t_eval = np.unique(np.clip(t_eval, 0.0, t_end))
    tau_eval = np.log1p(t_eval)
    sol = solve_ivp(
        rhs,
        (0.0, float(tau_eval[-1])),
        np.concatenate([alpha0, beta0]),
        method="LSODA",
        t_eval=tau_eval,
        rtol=rtol,
        atol=atol,
    )
    if not sol.success:
        raise RuntimeError(f"the gradient-flow integration failed: {sol.message}")
    return Flow(t=np.expm1(sol.t), alpha=sol.y[:v].T, beta=sol.y[v:].T)


def prop_b0_gradient(m: float, t: int) -> float:
    """Prop. B.0 / Fig. 15: the loss gradient of the residual-norm scalar m at step t ≥ 1,
    −log t / (√t·m³) (the paper's dm = log t / [√t m³] is the direction m moves in)."""
    return -np.log(t) / (np.sqrt(t) * m**3)


def prop_b0_simulation(
    optimizer: str = "adam",
    steps: int = 10_000,
    lr: float = 0.3,
    m0: float = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 1e-8,
) -> np.ndarray:
    """``[steps + 1]`` trajectory of m trained by torch's AdamW (``optimizer="adam"``, the
    paper's betas, ε = 1e-8, weight decay 1e-8) or plain SGD on the gradient of
    `prop_b0_gradient`, in float64 (App. B.3: lr 0.3 for both)."""
    import torch

    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}.")
    if steps < 1 or not m0 > 0:
        raise ValueError(f"need steps >= 1 and m0 > 0, got {steps} and {m0}.")
    m = torch.tensor([float(m0)], dtype=torch.float64, requires_grad=True)
    if optimizer == "adam":
        opt = torch.optim.AdamW([m], lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD([m], lr=lr)
    out = np.empty(steps + 1)
    out[0] = m0
    for t in range(1, steps + 1):
        m.grad = torch.tensor([prop_b0_gradient(float(m.detach()), t)], dtype=torch.float64)
        opt.step()
        out[t] = float(m.detach())
    return out
