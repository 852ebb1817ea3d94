"""A tiny pre-LN causal transformer with any attention normalizer, in one readable file.

The model of Guo et al. (*Active-Dormant Attention Heads*, Eq. 1-4, App. C.1 and the public
code): learned absolute positions, pre-LayerNorm residual sublayers
``h ← h + attn(LN(h))``, ``h ← h + mlp(LN(h))`` with a ReLU MLP of width 4d, bias-free linears,
a final LayerNorm and an untied output layer; attention scores are q·k/√d_head and go through
any registered normalizer (``softmax``, ``relu`` = ReLU(s)/n, ...).

A model is a list of *layers* (the ``layers`` ModuleList), each ``"tf"`` (attn then mlp), ``"attn"`` or ``"mlp"``:
``layers=("tf",)`` is the one-layer model, ``("tf", "tf", "tf")`` the three-layer one and
``("tf", "tf", "mlp")`` the paper's "attn+mlp+attn+mlp+mlp" (`parse_layers` reads both
spellings). Layer L's output is ``layers.{L}.resid_post`` (the paper's Res at layer L).

Each attention sublayer is a [`sharpattn.MultiheadAttention`][sharpattn.MultiheadAttention] (``bias=False,
causal=True``), so `sharpattn.diagnostics.capture` records the internals under the same
names as the model: with ``with capture(model) as cap: model(idx)``, ``cap["layers.{L}.attn.scores"]``
(pre-normalizer scores, ``-inf`` after the query), ``.weights``, ``.values`` (value-state norms
‖O_h·V_h·LN(h)_j‖, ``[B, H, T]``) and ``cap["layers.{L}.resid_post"]`` ``[B, T, d]``, with L the
index in ``model.layers`` (an "mlp" layer has a residual but no attention).
``forward(idx, zero={"layers.0.mlp"})`` zeroes those sublayers' outputs (interventions).

Options beyond the paper's model (defaults keep it exactly): ``positions="rotary"`` drops the
position table and rotates q and k in every attention layer instead
(`sharpattn.attention.rotary`), so the model runs at any length (``max_len`` is then
unused); ``positions="none"`` has no position signal at all (NoPE: the causal mask alone
tells positions apart; Kazemnejad et al. 2023); ``positions="alibi"`` adds ALiBi's linear
bias −m_h·(i − j) to every head's scores (Press et al. 2022) and ``positions="nape"`` ALiBi on
half of the heads and nothing on the others (NoPE + ALiBi, as ASEntmax trains), both without
a position table (`sharpattn.attention.positions`); ``selective="q" | "v" | "qv"`` with ``selective_terms`` ("both", "token", "position")
and ``sharing`` gives every attention layer selective temperatures (Zhang et al.; identity at
initialisation, see `sharpattn.attention.selective`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..attention import MultiheadAttention, SelectiveConfig
from ..attention.mha import GATES
from ..attention.positions import LINEAR_BIASES, slopes_of
from ..normalizers import get

__all__ = [
    "LAYER_KINDS",
    "Layer",
    "MLP",
    "POSITIONS",
    "Transformer",
    "TransformerConfig",
    "layers_name",
    "parse_layers",
]

Tensor = torch.Tensor

LAYER_KINDS = ("tf", "attn", "mlp")
POSITIONS = ("learned", "rotary", "none", *LINEAR_BIASES)


def parse_layers(spec: str | int | Iterable[str]) -> tuple[str, ...]:
    """Layers from ``3`` (three "tf" layers), ``"tf,tf,mlp"`` or ``"attn+mlp+attn+mlp+mlp"``
    (an attn followed by an mlp is one "tf" layer)."""
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"the number of layers must be >= 1, got {spec}.")
        return ("tf",) * spec
    if isinstance(spec, str):
        spec = spec.strip()
        if spec.isdigit():
            return parse_layers(int(spec))
        if "+" in spec:
            parts, out, i = [p.strip() for p in spec.split("+")], [], 0
            while i < len(parts):
                if parts[i] == "attn" and i + 1 < len(parts) and parts[i + 1] == "mlp":
                    out.append("tf")
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            spec = out
        else:
            spec = [p.strip() for p in spec.split(",")]
    layers = tuple(spec)
    bad = [k for k in layers if k not in LAYER_KINDS]
    if not layers or bad:
        raise ValueError(
            f"layers must be a number or kinds from {', '.join(LAYER_KINDS)} "
            f"(e.g. 'attn+mlp+attn+mlp+mlp'), got {spec!r}."
        )
    return layers


def layers_name(layers: Iterable[str]) -> str:
    """``("tf", "tf", "mlp")`` -> ``"attn+mlp+attn+mlp+mlp"``."""
    return "+".join("attn+mlp" if k == "tf" else k for k in layers)


@dataclass
class TransformerConfig:
    vocab_size: int = 65  # input tokens (64 characters + BOS)
    n_out: int = 64  # output classes (BOS is never a target)
    max_len: int = 256  # learned absolute positions (unused with rotary positions)
    d_model: int = 256
    n_heads: int = 1
    layers: tuple[str, ...] = ("tf",)
    method: str = "softmax"  # attention normalizer (sharpattn.normalizers.available())
    method_params: dict = field(default_factory=dict)  # fixed normalizer parameters
    mlp_ratio: int = 4
    init_std: float = 0.02
    #: "learned" (a table of max_len), "rotary" (RoPE on q, k), "none" (NoPE), "alibi" (a linear
    #: bias on every head) or "nape" (ALiBi on half of the heads, NoPE on the others)
    positions: str = "learned"
    selective: str | None = None  # selective temperatures on "q", "v", "qv", ...
    selective_terms: str = "both"  # "both", "token" or "position"
    sharing: bool = False  # weight-sharing token temperature instead of the MLP
    gate: str | None = None  # gated attention: None, "headwise" or "elementwise" (Qiu et al. 2025)

    def __post_init__(self):
        self.layers = parse_layers(self.layers)
        if self.positions not in POSITIONS:
            raise ValueError(
                f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}."
            )
        if self.positions in LINEAR_BIASES:
            slopes_of(self.positions, self.n_heads)  # nape with one head: one sentence
        self.selective_config()  # validates the selective options
        if self.gate not in GATES:
            raise ValueError(
                f"gate must be one of {', '.join(map(repr, GATES))}, got {self.gate!r}."
            )
        get(self.method)  # unknown names fail here, with the list of known ones
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})."
            )
        for name in ("vocab_size", "n_out", "max_len", "d_model", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")

    def selective_config(self) -> SelectiveConfig | None:
        if self.selective is None:
            return None
        return SelectiveConfig(self.selective, sharing=self.sharing, terms=self.selective_terms)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(torch.relu(self.fc(x)))  # W2 ReLU(W1 x), Eq. (3)


class Layer(nn.Module):
    """One layer: pre-LN residual sublayers, attn then mlp ("tf"), or just one of them."""

    def __init__(self, cfg: TransformerConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind in ("tf", "attn"):
            self.ln_attn = nn.LayerNorm(cfg.d_model)
            self.attn = MultiheadAttention(
                cfg.d_model,
                cfg.n_heads,
                cfg.method,
                bias=False,
                causal=True,
                check_finite=False,
                rotary=cfg.positions == "rotary",
                alibi=cfg.positions if cfg.positions in LINEAR_BIASES else None,
                selective=cfg.selective_config(),
                gate=cfg.gate,
                **cfg.method_params,
            )
        if kind in ("tf", "mlp"):
            self.ln_mlp = nn.LayerNorm(cfg.d_model)
            self.mlp = MLP(cfg)

    def forward(self, h: Tensor, zero: Iterable[str] = ()) -> Tensor:
        """``zero``: the sublayers (``"attn"``, ``"mlp"``) whose output is replaced by 0."""
        if self.kind in ("tf", "attn") and "attn" not in zero:
            h = h + self.attn(self.ln_attn(h))  # Eq. (4)
        if self.kind in ("tf", "mlp") and "mlp" not in zero:
            h = h + self.mlp(self.ln_mlp(h))
        return h


class Transformer(nn.Module):
    """Token (+ learned position) embeddings, layers, final LayerNorm, untied output."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg, kind) for kind in cfg.layers)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.n_out, bias=False)
        for name, module in self.named_modules():
            # (not the selective temperatures nor the zero-initialised query-dependent maps of
            # a normalizer's parameters, ASEntmax's: both start at their module's own init)
            if isinstance(module, nn.Linear | nn.Embedding) and not (
                ".selective." in name or ".normalizer_projections." in name
            ):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)

    @property
    def sublayers(self) -> list[str]:
        """Names of every attn and mlp sublayer (what ``zero`` accepts)."""
        out = []
        for i, kind in enumerate(self.cfg.layers):
            out += [f"layers.{i}.{s}" for s in ("attn", "mlp") if kind in ("tf", s)]
        return out

    def forward(self, idx: Tensor, *, zero: Iterable[str] = ()) -> Tensor:
        """Logits ``[B, T, n_out]`` for token ids ``idx`` ``[B, T]``; ``zero``: sublayer names
        (`sublayers`) whose outputs are replaced by 0."""
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(
                f"idx must be a [B, T] long tensor, got {idx.dtype} {tuple(idx.shape)}."
            )
        t = idx.shape[1]
        if self.cfg.positions == "learned" and t > self.cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len {self.cfg.max_len}.")
        zero = frozenset(zero)
        unknown = sorted(zero - set(self.sublayers))
        if unknown:
            raise ValueError(
                f"cannot zero {', '.join(unknown)}: the sublayers are {', '.join(self.sublayers)}."
            )
        h = self.tok_emb(idx)  # (B, T, d)
        if self.cfg.positions == "learned":
            h = h + self.pos_emb(torch.arange(t, device=idx.device))
        for i, layer in enumerate(self.layers):
            h = layer(h, {z.rsplit(".", 1)[1] for z in zero if z.startswith(f"layers.{i}.")})
        return self.head(self.ln_f(h))  # (B, T, n_out)
