"""App. C.3 of Guo et al.: the simplified model of Theorem 2, trained by Adam on Bigram-Backcopy.

Section 2.2 reduces the one-layer transformer to a few named parameters (Fig. 5, Eqs. 6-8); App.
C.3 trains that model with two changes: a trainable MLP with Gaussian initialisation in place of
the exact log-transition of Eq. (8), and Val_BOS = O·β with a trainable O ∈ R^{V×V}. For a
sequence [BOS, v_1, ..., v_{T-1}] and the query at position n (token v_n):

* attention logits (Eq. 6): on the BOS key α_{v_n}·1{v_n ∉ T}; on key n−1 (n ≥ 2) λ·1{v_n ∈ T};
  every other logit 0. Weights: softmax over the keys 0..n (BOS's own query sees only BOS);
* value states (Eq. 7 + C.3): Val_BOS = O·β; a token k at position i ≥ 1 has ξ_k·1{k ∉ T}·e_k;
* output logits (Fig. 5, parallel attn + mlp, no LayerNorm):
  TF_n = mlp(v_n) + Σ_i w_{n,i}·Val_i, mlp(v) = W₂·ReLU(W₁·e_v) on one-hot tokens (BOS included).

The trainable parameters are the paper's: ``mlp``, ``O``, ``alpha`` (α ∈ R^V), ``beta``
(β ∈ R^V), ``lam`` (λ) and ``xi`` (ξ ∈ R^V); AdamW at lr 0.03 (the paper's "Adam with a
learning rate of 0.03"; the authors' public code adds weight decay 1e-4, 5,000 steps and batch
512 in ``Simple-model.sh``, betas (0.9, 0.99) and ε = 1e-8 in ``train_main.py``). Initialisation
(stated nowhere): W₁ ~ N(0, 1), W₂ ~ N(0, 1/hidden), O ~ N(0, 1/V), β ~ N(0, I); α, ξ, λ = 0
(attention uniform, no value on the tokens at the start).

Training goes through `SimplifiedModel.loss`, whose gradient with respect to the
``[B, T, V]`` output logits is written out and computed a few sequences at a time
(`_NextTokenLoss`, checked against autograd and finite differences in the tests): at
the paper's sizes (batch 512 × 256 tokens) autograd through `SimplifiedModel.forward`
costs 4-7× more time per step on one thread.

Everything else is the one-layer runs' (`backcopy`): the same task, batches of fresh
sequences from a checkpointed stream, the loss at every position, the same measures on fixed
evaluation sequences (excess risk per kind of query = mean KL to the true next-token
distribution; Δlogit over non-trigger queries, which here is α averaged over their positions;
the BOS weight; ‖Val_BOS‖ = ‖Oβ‖ against the other positions' mean value norm), one
`Trainer` run per seed (resume, seeding, progress), measured at every 20 steps
up to step 400 and at log-spaced steps after it (Fig. 18's axis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...diagnostics import attention_on, delta_logit
from ...lab import runner
from ...tasks.bigram_backcopy import KIND_BACKCOPY, KIND_BIGRAM, BigramBackcopy
from .config import Training
from .training import initialise

Tensor = torch.Tensor


@dataclass
class SimplifiedConfig(Training):
    """One training run of the simplified model (App. C.3): `Training`'s settings (here 5,000
    steps, weight decay 1e-4, a checkpoint every 250 steps), then these. Measures at every
    ``linear_every`` steps up to ``linear_until`` and at ``n_log`` log-spaced steps after it."""

    steps: int = 5000
    weight_decay: float = 1e-4
    checkpoint_every: int = 250
    lr: float = 0.03
    hidden: int = 256
    linear_until: int = 400
    linear_every: int = 20
    n_log: int = 30

    COUNTS: ClassVar[tuple[str, ...]] = (*Training.COUNTS, "hidden", "linear_every", "n_log")

    def __post_init__(self):
        super().__post_init__()
        if not self.lr > 0 or self.weight_decay < 0 or self.linear_until < 0:
            raise ValueError(
                f"need lr > 0, weight_decay >= 0 and linear_until >= 0, got {self.lr}, "
                f"{self.weight_decay} and {self.linear_until}."
            )

    def log_at(self) -> list[int]:
        return runner.log_steps(self.steps, self.n_log, self.linear_until, self.linear_every)


#: the settings of the command: App. C.3 and the authors' script (5,000 steps, batch 512)
PAPER = SimplifiedConfig()


class SimplifiedModel(nn.Module):
    """The simplified transformer of Fig. 5 with App. C.3's trainable MLP and O (module
    docstring). Tokens are ids 0..V−1 with the triggers first (0..n_triggers−1) and BOS = V, as
    `BigramBackcopy` numbers them."""

    def __init__(self, V: int, n_triggers: int, hidden: int = 256):  # noqa: N803 (the paper's V)
        super().__init__()
        if not 1 <= n_triggers < V or hidden < 1:
            raise ValueError(
                f"need 1 <= n_triggers < V and hidden >= 1, got {n_triggers}, {V}, {hidden}."
            )
        self.V, self.n_triggers = V, n_triggers
        self.mlp = nn.Sequential(
            nn.Linear(V + 1, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, V, bias=False)
        )
        with torch.no_grad():
            self.mlp[0].weight.normal_(0.0, 1.0)  # one-hot input: unit-variance hidden units
            self.mlp[2].weight.normal_(0.0, 1.0 / math.sqrt(hidden))
        self.O = nn.Parameter(torch.randn(V, V) / math.sqrt(V))
        self.alpha = nn.Parameter(torch.zeros(V))
        self.beta = nn.Parameter(torch.randn(V))
        self.xi = nn.Parameter(torch.zeros(V))
        self.lam = nn.Parameter(torch.zeros(()))

    # ----- the pieces of Eqs. (6)-(8) --------------------------------------------------------
    def non_trigger(self) -> Tensor:
        """``[V]`` float mask 1{v ∉ T}."""
        return (torch.arange(self.V, device=self.alpha.device) >= self.n_triggers).to(self.alpha)

    def value_bos(self) -> Tensor:
        """Val_BOS = O·β ``[V]``."""
        return self.O @ self.beta

    def value_scale(self) -> Tensor:
        """``[V + 1]``: ξ_k·1{k ∉ T} for the tokens, and 0 at BOS's id (its value is O·β)."""
        return torch.cat([self.xi * self.non_trigger(), self.xi.new_zeros(1)])

    def mlp_table(self) -> Tensor:
        """``[V + 1, V]`` mlp(v) for every token v (BOS last): the MLP reads only the token."""
        return self.mlp(torch.eye(self.V + 1, dtype=self.alpha.dtype, device=self.alpha.device))

    def _logits_on_bos_and_prev(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(a, l, act)`` ``[B, T]``: the logit on BOS, the logit on the previous key and
        whether that key gets λ (a trigger query at n ≥ 2)."""
        pos = torch.arange(x.shape[-1], device=x.device)
        trig = x < self.n_triggers
        a = torch.where((~trig) & (x != self.V), self.alpha[x.clamp_max(self.V - 1)], 0.0)
        act = trig & (pos >= 2)
        return a, torch.where(act, self.lam, 0.0), act

    def scores(self, x: Tensor) -> Tensor:
        """``[B, T, T]`` attention logits (Eq. 6), keys after the query ``-inf``."""
        a, l, _ = self._logits_on_bos_and_prev(x)
        t = x.shape[-1]
        s = torch.diag_embed(l[:, 1:], offset=-1)  # λ at (n, n − 1)
        s = s + F.pad(a[..., None], (0, t - 1))  # α at (n, 0)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        return s.masked_fill(~causal, float("-inf"))

    def values(self, x: Tensor) -> Tensor:
        """``[B, T, V]`` value state of each position: O·β at BOS, ξ_k·1{k ∉ T}·e_k elsewhere."""
        scale = self.value_scale()[x]
        vals = torch.zeros(*x.shape, self.V, dtype=scale.dtype, device=x.device)
        vals = vals.scatter(-1, x.clamp_max(self.V - 1)[..., None], scale[..., None])
        return torch.where((x == self.V)[..., None], self.value_bos(), vals)

    def value_norms(self, x: Tensor) -> Tensor:
        """``[B, T]`` ‖Val‖ of each position (‖Oβ‖ at BOS, |ξ_k|·1{k ∉ T} elsewhere)."""
        return torch.where(x == self.V, self.value_bos().norm(), self.value_scale()[x].abs())

    def forward_explicit(self, x: Tensor) -> Tensor:
        """The output logits through the full ``[B, T, T]`` attention matrix (measures, tests)."""
        w = torch.softmax(self.scores(x), dim=-1)
        return self.mlp_table()[x] + w @ self.values(x)

    def key_weights(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(w_bos, w_rest, w_extra)`` ``[B, T]``: the weight of the BOS key, of every other key
        and, at a trigger query, what the previous key gets on top of ``w_rest`` (every key but
        BOS and the previous one has logit 0; shifted by the largest logit: no overflow)."""
        a, l, act = self._logits_on_bos_and_prev(x)
        pos = torch.arange(x.shape[-1], device=x.device, dtype=a.dtype)
        m = torch.maximum(a, l).clamp_min(0.0)
        e_bos, e_rest, e_prev = torch.exp(a - m), torch.exp(-m), torch.exp(l - m)
        actf = act.to(a.dtype)
        denom = e_bos + (pos - actf) * e_rest + actf * e_prev  # keys 1..n: n of them
        return e_bos / denom, e_rest / denom, actf * (e_prev - e_rest) / denom

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, V]`` output logits TF_n in O(B·T·V): a BOS term, a running sum of the token
        values and a correction at the previous key."""
        w_bos, w_rest, w_extra = self.key_weights(x)
        scale = self.value_scale()[x]
        vals = torch.zeros(*x.shape, self.V, dtype=scale.dtype, device=x.device)
        vals = vals.scatter(-1, x.clamp_max(self.V - 1)[..., None], scale[..., None])  # 0 at BOS
        running = vals.cumsum(-2)  # Σ_{1 ≤ i ≤ n} Val_i
        prev = F.pad(vals[:, :-1], (0, 0, 1, 0))  # Val_{n−1}
        attn = (
            w_bos[..., None] * self.value_bos()
            + w_rest[..., None] * running
            + w_extra[..., None] * prev
        )
        return self.mlp_table()[x] + attn

    def loss(self, x: Tensor, chunk: int = 32) -> Tensor:
        """Mean next-token cross-entropy over every position of ``x`` ``[B, T + 1]``, as
        ``F.cross_entropy(self(x[:, :-1]), x[:, 1:])``, with the gradient of the ``[B, T, V]``
        part written out and computed ``chunk`` sequences at a time (`_NextTokenLoss`):
        4-5× faster than autograd through `forward` at the paper's sizes on one thread."""
        inp, target = x[:, :-1], x[:, 1:]
        w_bos, w_rest, w_extra = self.key_weights(inp)
        scale = self.value_scale()[: self.V]
        return _NextTokenLoss.apply(
            self.mlp_table(), self.value_bos(), scale, w_bos, w_rest, w_extra, inp, target, chunk
        )


class _NextTokenLoss(torch.autograd.Function):
    """The simplified model's mean cross-entropy and its gradient in one pass over the positions.

    With z_n = table[x_n] + w_bos,n·u + s∘K_n, K_n = w_rest,n·C_n + w_extra,n·e_{x_{n−1}} (C_n the
    counts of each token among positions 1..n), u = O·β, s = (ξ∘1{∉T}) and
    G_n = (softmax(z_n) − e_{y_n}) / N, the gradients are ∂table[v] = Σ_{x_n = v} G_n,
    ∂u = Σ_n w_bos,n G_n, ∂s = Σ_n G_n∘K_n, ∂w_bos,n = G_n·u, ∂w_rest,n = Σ_k G_nk s_k C_nk and
    ∂w_extra,n = G_{n,x_{n−1}} s_{x_{n−1}}; autograd takes them on to the parameters. Computed
    in the forward pass, ``chunk`` sequences at a time (their ``[chunk, T, V]`` arrays stay in
    cache), in a fixed order: the same batch gives the same numbers every time.
    """

    @staticmethod
    def forward(ctx, table, u, s, w_bos, w_rest, w_extra, x, y, chunk):
        n_pos, v = x.numel(), u.shape[0]
        prev = torch.cat([x[:, :1], x[:, :-1]], dim=1).clamp_max(v - 1)  # x_{n−1} (n ≥ 1)
        grads = [torch.zeros_like(table), torch.zeros_like(u), torch.zeros_like(s)]
        g_bos, g_rest, g_extra = (torch.empty_like(w) for w in (w_bos, w_rest, w_extra))
        total = torch.zeros((), dtype=torch.float64)
        for b0 in range(0, x.shape[0], chunk):
            sl = slice(b0, b0 + chunk)
            xs, ys, ps = x[sl], y[sl], prev[sl]
            wb, wr, we = w_bos[sl, :, None], w_rest[sl, :, None], w_extra[sl, :, None]
            counts = table.new_zeros(xs.shape[1], xs.shape[0], v + 1)
            counts = counts.scatter_(-1, xs.T[..., None], 1.0).cumsum_(0)  # [T, b, V + 1]
            counts = counts.permute(1, 0, 2)[..., :v]  # BOS dropped; cumsum is fastest on dim 0
            k = (counts * wr).scatter_add_(-1, ps[..., None], we)
            z = F.embedding(xs, table).addcmul_(wb, u.expand_as(k)).addcmul_(k, s.expand_as(k))
            z = z.sub_(z.amax(-1, keepdim=True))
            z_y = z.gather(-1, ys[..., None])
            g = z.exp_()  # in place: one exp pass
            norm = g.sum(-1, keepdim=True)
            total += (norm.log() - z_y).double().sum()  # −log softmax(z)_y
            g = g.div_(norm).scatter_add_(-1, ys[..., None], torch.full_like(norm, -1.0))
            g /= n_pos
            flat = g.reshape(-1, v)
            grads[0].index_add_(0, xs.reshape(-1), flat)
            grads[1] += wb.reshape(-1) @ flat
            grads[2] += (g * k).sum((0, 1))
            g_bos[sl] = g @ u
            g_rest[sl] = (g * counts) @ s
            g_extra[sl] = g.gather(-1, ps[..., None])[..., 0] * s[ps]
        ctx.save_for_backward(*grads, g_bos, g_rest, g_extra)
        return (total / n_pos).to(table.dtype)

    @staticmethod
    def backward(ctx, grad):
        return (*(grad * g for g in ctx.saved_tensors), None, None, None)


def build_model(cfg: SimplifiedConfig, task: BigramBackcopy) -> SimplifiedModel:
    """The run's freshly initialised model (seeded; the global RNG is left alone)."""
    return initialise(cfg, lambda: SimplifiedModel(task.V, task.n_triggers, cfg.hidden))


def next_token_loss(model: SimplifiedModel, x: Tensor) -> Tensor:
    """Mean cross-entropy of the next token at every position of ``x`` ``[B, T + 1]``."""
    return model.loss(x)


@torch.no_grad()
def measure(model: SimplifiedModel, task: BigramBackcopy, tokens: Tensor) -> dict:
    """The measures of a logged step on ``tokens`` ``[B, T]`` (module docstring): risks,
    attention on BOS and on the previous key, Δlogit, α over the non-trigger tokens (mean,
    5th / 95th percentiles, and every α_v), λ, ‖Oβ‖, ‖β‖ and the mean ‖Val‖ of the other
    positions."""
    was = model.training
    model.eval()
    try:
        logits = model(tokens)
        s = model.scores(tokens)[:, None]  # [B, 1, T, T]: one head, backcopy's layout
        w = torch.softmax(s, dim=-1)
        norms = model.value_norms(tokens)
    finally:
        model.train(was)
    kind = task.position_kind(tokens)
    bigram_q, copy_q = kind == KIND_BIGRAM, kind == KIND_BACKCOPY
    alpha = model.alpha.detach().double()
    nt = alpha[task.n_triggers :].cpu().numpy()
    return {
        **task.risks(logits, tokens),
        "bos_weight": attention_on(w, bigram_q),
        "bos_weight_trigger": attention_on(w, copy_q),
        "prev_weight_trigger": attention_on(w, copy_q, offset=1),
        "delta_logit": delta_logit(s, bigram_q),
        "alpha_mean": float(nt.mean()),
        "alpha_q05": float(np.quantile(nt, 0.05)),
        "alpha_q95": float(np.quantile(nt, 0.95)),
        "lambda": float(model.lam.detach()),
        "val_bos": float(model.value_bos().double().norm()),
        "beta_norm": float(model.beta.detach().double().norm()),
        "val_other": float(norms[:, 1:].double().mean()),
        "xi_mean": float(model.xi.detach()[task.n_triggers :].double().mean()),
        "alpha": alpha.tolist(),
    }
