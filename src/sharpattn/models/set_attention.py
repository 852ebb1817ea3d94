"""The set model of the max-retrieval task (Veličković et al., App. A.3, Deep-Sets style).

    h_i = ψ_x(x_i)            Dense-GELU-Dense-GELU                         (Eq. 9)
    y   = ψ_q(q)              Dense-GELU-Dense                              (Eq. 10)
    e_i = (Q y)ᵀ(K h_i)/√d    one head, Q/K/V projections with biases       (Eq. 11)
                              (computed with K and V folded into the query side, see qkv)
    α   = normalizer(e)       softmax by default; any registry method       (Eq. 12)
    z   = O Σ_i α_i V h_i     output projection, as Flax's MultiHeadDotProductAttention (Eq. 13)
    out = ϕ(z)                Dense-GELU-Dense to the class logits          (Eq. 14)

Initialisation and activation follow Flax's defaults (the paper's code): kernels LeCun-normal
(truncated normal, variance 1/fan_in), biases zero, GELU in its tanh form. The normalizer is a
name from the registry; ``forward(..., method=...)`` switches it for one call with the same
parameters (adaptive temperature "at inference only").

``SetAttention(members=S)`` (or `SetAttention.stack` of S single models) is S independent
models trained together: every layer is a `StackedLinear`,
inputs and outputs carry a leading member dimension ``(S, B, ...)``, and the attention of all
members runs as one [`attend`][sharpattn.attend] call over the flattened ``S·B`` sets. `member` gives
member s back as a single model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import attend
from .ensemble import StackedLinear, member_state, stack_states

Tensor = torch.Tensor


class SetAttention(nn.Module):
    def __init__(
        self,
        n_features: int = 11,
        n_classes: int = 10,
        width: int = 128,
        method: str = "softmax",
        members: int | None = None,
        **method_params,
    ):
        super().__init__()
        self.width, self.n_features, self.n_classes = width, n_features, n_classes
        self.members = members
        self.method = method
        self.method_params = method_params

        def linear(i: int, o: int) -> nn.Module:
            return nn.Linear(i, o) if members is None else StackedLinear(members, i, o)

        self.psi_x = nn.ModuleList([linear(n_features, width), linear(width, width)])
        self.psi_q = nn.ModuleList([linear(1, width), linear(width, width)])
        self.query = linear(width, width)
        self.key = linear(width, width)
        self.value = linear(width, width)
        self.out = linear(width, width)
        self.phi = nn.ModuleList([linear(width, width), linear(width, n_classes)])
        self.reset_parameters()

    @classmethod
    def stack(cls, models: list[SetAttention]) -> SetAttention:
        """The ensemble of ``models`` (same sizes and normalizer), each its own member."""
        m0 = models[0]
        ens = cls(m0.n_features, m0.n_classes, m0.width, m0.method, len(models), **m0.method_params)
        ens.load_state_dict(stack_states([m.state_dict() for m in models]))
        return ens

    def member(self, s: int) -> SetAttention:
        """Member ``s`` of an ensemble as a single model (a copy of its parameters)."""
        if self.members is None:
            raise ValueError("member() needs an ensemble (SetAttention(members=S)).")
        single = SetAttention(
            self.n_features, self.n_classes, self.width, self.method, **self.method_params
        )
        single.load_state_dict(member_state(self.state_dict(), s))
        return single

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Flax defaults: LeCun-normal kernels (truncated at ±2σ, σ corrected), zero biases."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, StackedLinear)):
                # 0.8796 = std of a unit normal truncated to [−2, 2] (jax.nn.initializers).
                std = math.sqrt(1.0 / m.in_features) / 0.87962566103423978
                nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
                nn.init.zeros_(m.bias)

    def embed(self, x: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
        """(h, y): item embeddings ``(B, n, d)`` (Eq. 9) and query embedding ``(B, d)`` (Eq. 10);
        an ensemble takes and gives a leading member dimension ``(S, B, ...)``."""
        h = F.gelu(self.psi_x[1](F.gelu(self.psi_x[0](x), approximate="tanh")), approximate="tanh")
        y = self.psi_q[1](F.gelu(self.psi_q[0](q), approximate="tanh"))
        return h, y

    def qkv(self, h: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Query, keys and values for [`attend`][sharpattn.attend], with K and V folded into the query side.

        With one query per set, e_i = (W_q y + b_q)ᵀ(W_k h_i + b_k) = [W_kᵀ q̃; q̃ᵀb_k]·[h_i; 1]
        (q̃ = W_q y + b_q), and Σ_i α_i (W_v h_i + b_v) = W_v (Σ_i α_i h_i) + (Σ_i α_i)·b_v.
        So attending with keys = values = [h_i; 1] gives the same logits for any normalizer,
        and the output (B, d+1) = [Σ α_i h_i; Σ α_i] that `readout` projects: the same
        function as separate K/V projections, without a d×d product per item.

        `forward` is `embed`, this, `attention` and `readout`; each is
        public, so a caller can embed and project once and attend with several normalizers.
        """
        qt = self.query(y)  # (..., B, d): q̃ = W_q y + b_q
        b_k = self.key.bias.reshape(*self.key.weight.shape[:-2], 1, -1)  # (d,) or (S, 1, d)
        q_aug = torch.cat((qt @ self.key.weight, (qt * b_k).sum(-1, keepdim=True)), dim=-1)
        kv = torch.cat((h, torch.ones_like(h[..., :1])), dim=-1).unsqueeze(
            -3
        )  # (..., B, 1, n, d+1)
        return q_aug[..., None, None, :], kv, kv  # q (..., B, 1, 1, d+1)

    def scores(self, x: Tensor, q: Tensor) -> Tensor:
        """The attention logits e_i = (Q y)ᵀ(K h_i)/√d of each set, ``(..., B, n)`` (Eq. 11)."""
        qh, kh, _ = self.qkv(*self.embed(x, q))
        return (qh @ kh.transpose(-2, -1))[..., 0, 0, :] / math.sqrt(self.width)

    def forward(
        self,
        x: Tensor,
        q: Tensor,
        *,
        method: str | None = None,
        return_weights: bool = False,
        check_finite: bool = True,
        **params,
    ):
        """Class logits ``(B, C)`` for sets ``x (B, n, F)`` and queries ``q (B, 1)`` (an
        ensemble: ``(S, B, C)`` for ``x (S, B, n, F)``, ``q (S, B, 1)``).

        ``method``/``params`` override the model's normalizer for this call (same parameters).
        With ``return_weights=True`` returns ``(logits, weights (B, n))``.
        """
        if method is None:
            method, params = self.method, {**self.method_params, **params}
        qkv = self.qkv(*self.embed(x, q))
        att = self.attention(
            *qkv, method, return_weights=return_weights, check_finite=check_finite, **params
        )
        if return_weights:
            att, weights = att
            return self.readout(att), weights
        return self.readout(att)

    def attention(self, qh: Tensor, kh: Tensor, vh: Tensor, method: str, **params):
        """Single-head attention Σ_i α_i (W_v h_i + b_v), ``(B, d)`` (Eqs. 12-13, before the
        output projection), over `qkv`'s query/keys/values with normalizer ``method``;
        with ``return_weights=True`` also the weights α ``(B, n)``. An ensemble's members attend
        in one call, their sets flattened into the batch (the attention has no weights)."""
        lead = qh.shape[:-3]  # (B,) or (S, B)
        flat = (t.reshape(-1, *t.shape[-3:]) for t in (qh, kh, vh))  # (S·B, 1, ·, d+1)
        att = attend(*flat, method, scale=1.0 / math.sqrt(self.width), **params)
        weights = None
        if params.get("return_weights"):
            att, weights = att[0], att[1][:, 0, 0, :].reshape(*lead, -1)
        att = att[:, 0, 0, :].reshape(*lead, -1)  # (..., B, d+1) = [Σ α_i h_i; Σ α_i]
        w_v, b_v = self.value.weight, self.value.bias.reshape(*self.value.weight.shape[:-2], 1, -1)
        out = att[..., :-1] @ w_v.transpose(-1, -2) + att[..., -1:] * b_v  # W_v Σα_i h_i + Σα_i b_v
        return out if weights is None else (out, weights)

    def readout(self, att: Tensor) -> Tensor:
        """Output projection, then ϕ: class logits ``(..., B, C)`` (Eqs. 13-14)."""
        z = self.out(att)  # (..., B, d)
        return self.phi[1](F.gelu(self.phi[0](z), approximate="tanh"))  # (..., B, C)
