"""Selective attention: learned per-token temperatures on queries and values.

Zhang, Chang, Li, Roy-Chowdhury, Chen, Oymak, *Selective Attention: Enhancing Transformer through
Principled Context Control* (NeurIPS 2024), Definition 1 and Sec. 3:

    Q ← τ_q(X) ⊙ Q,   K ← τ_k(X) ⊙ K,   V ← τ_v(X) ⊙ V,   then softmax(QKᵀ/√d)·V

with one scalar τ per token and head (rows of Q, K, V are scaled), and

    τ(x_n)      = τ_tok(x_n) + τ_pos(n)
    τ_tok(x)    = tanh(f(x))        (activation "tanh", the paper's σ; τ_tok ∈ (−1, 1))
                = e^{f(x)} − 1      (activation "exp", uncapped: with terms="token", τ = e^{f(x)})
    τ_pos(n)    = 1 + c·log n,   c = σ(α) (paper) or c = e^{−e^β} (the authors' code)

``f`` comes in three forms (``token=``):

- ``"mlp"`` (base SSA): f(x) = W₂·GELU(W₁x + b₁) + b₂, a two-layer MLP from the layer input to
  one output per head; the hidden width is not given by the paper (default ``embed_dim // 2``,
  which makes q+v temperatures ≈ 5% of a GPT-2-small / Pythia-160m sized model, the paper's
  "5%"; see `selective_parameter_count`).
- ``"shared"`` (weight sharing): f(x)_h = w_h · GELU((x·W_{q|k|v})_h), reusing the head's own
  projection; one vector w_h ∈ R^{head_dim} per head (paper: < 0.5% new parameters).
- ``"feature"`` (feature-based, App. B.2): f(x)_h = γ_h · φ(x) from a per-token feature φ
  (e.g. the token's log-frequency; one fitted scalar per head for a scalar feature; a feature
  vector [F] gets F scalars per head).

What ``n`` is: for a query, the number of keys it may attend to (the paper's 1-based position
under causal self-attention; with a cache, query i of Lq over Lk keys sees i + Lk − Lq + 1 keys;
masks reduce it); for a key or value, its 1-based position among the real tokens.

Identity at initialisation (the paper gives no initialisation; see the errata). We choose:

- the output layer of f is zero (W₂, b₂ for "mlp", w_h for "shared", γ_h for "feature"), so
  τ_tok = tanh(0) = 0 exactly;
- the position coefficient starts at c₀ = e^{−e^{2.5}} ≈ 5.1e-6 (β₀ = 2.5; with
  ``position_param="sigmoid"`` the paper's α starts at logit(c₀) ≈ −12.2, the same c₀).

So τ = 1 + c₀·log n at initialisation: |τ − 1| ≤ 5.1e-6·log n (5.3e-5 at n = 32,768), and a
patched layer computes what it did before to far better than 1e-3 relative. The authors' code
starts at β = 2 (c₀ = e^{−e²} ≈ 6.2e-4; pass ``position_init=AUTHORS_C0``): then |τ − 1| reaches
3.4e-3 at n = 256, and we measured a value-temperature layer moving by 1.2e-3 relative there, so
it is not an identity to 1e-3. Adam moves β by about its learning rate per step whatever the
gradient's size, so starting at 2.5 instead of 2 costs about 0.5/lr steps. With
``terms="token"`` the log n part is dropped (τ = 1 + τ_tok) and the identity is exact. Note τ
cannot reach 0 through τ_pos (it is ≥ 1), so suppressing a token happens only through
τ_tok → −1 (errata).

Gradients at initialisation reach the output layer of f and the position parameter; the first
layer of the "mlp" form gets gradient from the first update on (its output layer is zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..normalizers.families import log_n
from ..normalizers.registry import Param
from ..normalizers.scaled import length_scaled_beta
from .functional import attend
from .masking import Masking

__all__ = [
    "ACTIVATIONS",
    "AUTHORS_C0",
    "DEFAULT_BETA",
    "DEFAULT_C0",
    "OPTIONS",
    "Overhead",
    "POSITION_PARAMS",
    "SelectiveConfig",
    "TERMS",
    "TOKEN_FORMS",
    "Temperature",
    "apply_temperatures",
    "initial_theta",
    "key_positions",
    "parameter_overhead",
    "position_coefficient",
    "position_temperature",
    "query_positions",
    "selective_attend",
    "selective_parameter_count",
    "token_activation",
    "token_temperature_feature",
    "token_temperature_mlp",
    "token_temperature_shared",
]

Tensor = torch.Tensor

TOKEN_FORMS = ("mlp", "shared", "feature")
ACTIVATIONS = ("tanh", "exp")
TERMS = ("both", "token", "position")
POSITION_PARAMS = ("exp", "sigmoid")
# Initial position coefficient c₀ = e^{−e^β₀}: ours (β₀ = 2.5) and the authors' code's (β = 2).
DEFAULT_BETA = 2.5
DEFAULT_C0 = math.exp(-math.exp(DEFAULT_BETA))
AUTHORS_C0 = math.exp(-math.exp(2.0))


# ---------------------------------------------------------------- the formulas


def position_coefficient(theta: Tensor, param: str = "exp") -> Tensor:
    """c of τ_pos = 1 + c·log n: σ(α) (``"sigmoid"``, the paper) or e^{−e^β} (``"exp"``, the
    authors' code). Both lie in (0, 1)."""
    if param == "sigmoid":
        return torch.sigmoid(theta)
    if param == "exp":
        return torch.exp(-torch.exp(theta))
    raise ValueError(f"position_param must be one of {', '.join(POSITION_PARAMS)}, got {param!r}.")


def initial_theta(param: str, coefficient: float | None = None) -> float:
    """The α (sigmoid) or β (exp) whose coefficient is ``coefficient`` (default e^{−e^2.5})."""
    c = DEFAULT_C0 if coefficient is None else float(coefficient)
    if not 0 < c < 1:
        raise ValueError(f"the initial position coefficient must be in (0, 1), got {c}.")
    if param == "sigmoid":
        return math.log(c / (1 - c))
    if param == "exp":
        return math.log(-math.log(c))
    raise ValueError(f"position_param must be one of {', '.join(POSITION_PARAMS)}, got {param!r}.")


def position_temperature(n: Tensor, coefficient: Tensor | float) -> Tensor:
    """τ_pos(n) = 1 + c·log n (Sec. 3), length_scaled's inverse temperature
    (`length_scaled_beta`). ``n`` < 1 (a query that sees no
    key) counts as 1."""
    return length_scaled_beta(log_n(n), coefficient)


def query_positions(
    lq: int, lk: int, *, mask: Tensor | None = None, causal: bool = False, device=None
) -> Tensor:
    """n for each query: how many keys it may attend to (`Masking.visible_keys`), float
    ``[B', H', Lq]`` (``[1, 1, Lq]`` without a mask). ``mask`` is boolean, broadcastable to
    ``[B, H, Lq, Lk]``, True = may attend; ``causal`` aligns queries to the end of the keys
    (query i sees keys j <= i + Lk − Lq)."""
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError("mask must be a boolean tensor (True = may attend).")
        device = mask.device
    elif device is None:
        device = torch.get_default_device()
    n = Masking.build(mask, causal, lq, lk, device).visible_keys().squeeze(-1)
    return n.expand(*n.shape[:-1], lq)


def key_positions(lk: int, *, key_mask: Tensor | None = None, device=None) -> Tensor:
    """n for each key/value token: its 1-based position among real tokens, ``[B', 1, Lk]``.
    ``key_mask`` ``[B, Lk]`` (True = real token) makes left padding not count."""
    if key_mask is None:
        return torch.arange(1, lk + 1, device=device, dtype=torch.float32).view(1, 1, lk)
    return key_mask.to(torch.float32).cumsum(-1).unsqueeze(1)


def token_activation(f: Tensor, activation: str = "tanh") -> Tensor:
    """τ_tok from f: tanh(f) (the paper's, in (−1, 1): 1 + τ_tok < 2, so 1/τ > 1/2) or
    e^f − 1 (``"exp"``: 1 + τ_tok = e^f takes any positive value; both are 0 at f = 0)."""
    if activation == "tanh":
        return torch.tanh(f)
    if activation == "exp":
        return torch.expm1(f)
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}.")


def token_temperature_mlp(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str = "tanh",
):
    """τ_tok = tanh(W₂·GELU(W₁x + b₁) + b₂): x ``[B, L, d]`` -> ``[B, heads, L]``."""
    f = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)  # (B, L, heads)
    return token_activation(f, activation).transpose(1, 2)


def token_temperature_shared(proj: Tensor, w: Tensor, activation: str = "tanh") -> Tensor:
    """τ_tok = tanh(w_h·GELU(x·W_h)) with the head's own projection: proj ``[B, heads, L, hd]``,
    w ``[heads, hd]`` -> ``[B, heads, L]``."""
    f = torch.einsum("bhld,hd->bhl", F.gelu(proj), w.to(proj.dtype))
    return token_activation(f, activation)


def token_temperature_feature(features: Tensor, gamma: Tensor, activation: str = "tanh") -> Tensor:
    """τ_tok = tanh(γ_h·φ): features ``[B, L]``, ``[B, L, F]`` or per head ``[B, heads, L, F]``,
    γ ``[heads, F]`` -> ``[B, heads, L]``."""
    if features.dim() == 2:
        features = features.unsqueeze(-1)
    if features.dim() == 4:
        f = torch.einsum("bhlf,hf->bhl", features.to(gamma.dtype), gamma)
    else:
        f = torch.einsum("blf,hf->bhl", features.to(gamma.dtype), gamma)
    return token_activation(f, activation)


def selective_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str = "softmax",
    *,
    tau_q: Tensor | None = None,
    tau_k: Tensor | None = None,
    tau_v: Tensor | None = None,
    **kwargs,
):
    """Selective self-attention: scale the rows of q, k, v by their temperatures, then one
    [`sharpattn.attend`][sharpattn.attend] call (for softmax that is one fused SDPA call).

    τ's are per token and head: ``tau_q`` broadcastable to ``[B, H, Lq]``, ``tau_k``/``tau_v`` to
    ``[B, Hkv, Lk]``. Everything else (mask, causal, scale, impl, return_weights, normalizer
    parameters) goes to [`attend`][sharpattn.attend]; ``scale`` still defaults to 1/√D.
    """
    q, k, v = apply_temperatures(q, k, v, tau_q=tau_q, tau_k=tau_k, tau_v=tau_v)
    return attend(q, k, v, method, **kwargs)


def apply_temperatures(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    tau_q: Tensor | None = None,
    tau_k: Tensor | None = None,
    tau_v: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Q ← τ_q ⊙ Q, K ← τ_k ⊙ K, V ← τ_v ⊙ V (Definition 1): each row (token) of a
    ``[B, heads, L, D]`` tensor times its scalar; a missing τ leaves the tensor as it is."""
    if tau_q is not None:
        q = q * tau_q.unsqueeze(-1).to(q.dtype)
    if tau_k is not None:
        k = k * tau_k.unsqueeze(-1).to(k.dtype)
    if tau_v is not None:
        v = v * tau_v.unsqueeze(-1).to(v.dtype)
    return q, k, v


# ---------------------------------------------------------------- modules

#: The options of `SelectiveConfig` (besides ``targets``), checked as a normalizer's
#: parameters are (`Param`): type, choices, range.
OPTIONS = (
    Param("sharing", False, "the weight-sharing token temperature"),
    Param(
        "token", None, "the token term's form", kind="choice", choices=TOKEN_FORMS, optional=True
    ),
    Param("terms", "both", "the terms of τ", kind="choice", choices=TERMS),
    Param("hidden", None, "the MLP's width", kind="int", low=1, optional=True),
    Param("num_features", 1, "the size F of a token feature", kind="int", low=1),
    Param("position_param", "exp", "c's parametrisation", kind="choice", choices=POSITION_PARAMS),
    Param(
        "position_init",
        None,
        "the initial position coefficient c₀",
        kind="real",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
        optional=True,
    ),
    Param("activation", "tanh", "τ_tok's activation", kind="choice", choices=ACTIVATIONS),
)


@dataclass(frozen=True)
class SelectiveConfig:
    """How [`MultiheadAttention`][sharpattn.MultiheadAttention] makes its temperatures.

    targets: which of q, k, v get one (any of ``"q"``, ``"v"``, ``"qv"``, ``"kqv"``, ...).
    token: "mlp" | "shared" | "feature" (default "shared" if ``sharing`` else "mlp").
    terms: "both" (τ_tok + τ_pos), "token" (1 + τ_tok), "position" (τ_pos).
    hidden: MLP width for token="mlp" (default embed_dim // 2).
    num_features: size F of the per-token feature for token="feature".
    position_param: "exp" (c = e^{−e^β}, the authors' code) or "sigmoid" (c = σ(α), the paper).
    position_init: initial position coefficient c₀ (default e^{−e^2.5} ≈ 5.1e-6; the authors'
        code: ``AUTHORS_C0`` = e^{−e²} ≈ 6.2e-4).
    activation: τ_tok = tanh(f) ("tanh", the paper's) or e^f − 1 ("exp": no upper cap, so with
        terms="token" τ = e^f is any positive number); both give τ_tok = 0 at f = 0.
    """

    targets: str = "qv"
    sharing: bool = False
    token: str | None = None
    terms: str = "both"
    hidden: int | None = None
    num_features: int = 1
    position_param: str = "exp"
    position_init: float | None = None
    activation: str = "tanh"

    def __post_init__(self):
        t = self.targets
        if (
            not isinstance(t, str)
            or not t
            or any(c not in "kqv" for c in t)
            or len(set(t)) != len(t)
        ):
            raise ValueError(
                f"the selective targets must name some of q, k, v (e.g. 'q', 'v', 'qv', 'kqv'), got {t!r}."
            )
        for option in OPTIONS:
            option.check(getattr(self, option.name), "selective attention")
        if self.token is not None and self.sharing and self.token != "shared":
            raise ValueError(f"sharing=True means token='shared', not {self.token!r}.")

    @property
    def token_form(self) -> str | None:
        if self.terms == "position":
            return None
        return self.token or ("shared" if self.sharing else "mlp")

    @property
    def uses_position(self) -> bool:
        return self.terms in ("both", "position")


class Temperature(nn.Module):
    """τ = τ_tok + τ_pos for one of q, k, v: a ``[B, heads, L]`` scalar per token and head.

    See the module docstring for the formulas and why τ ≈ 1 at initialisation.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        config: SelectiveConfig | None = None,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        config = SelectiveConfig() if config is None else config
        factory = {"device": device, "dtype": dtype}
        self.token, self.position_param = config.token_form, config.position_param
        self.activation = config.activation
        self.num_heads = num_heads
        if self.token == "mlp":
            hidden = config.hidden or max(1, embed_dim // 2)
            self.fc1 = nn.Linear(embed_dim, hidden, **factory)
            self.fc2 = nn.Linear(hidden, num_heads, **factory)
            nn.init.zeros_(self.fc2.weight)  # τ_tok = tanh(0) = 0 at initialisation
            nn.init.zeros_(self.fc2.bias)
        elif self.token == "shared":
            self.w = nn.Parameter(torch.zeros(num_heads, head_dim, **factory))
        elif self.token == "feature":
            self.gamma = nn.Parameter(torch.zeros(num_heads, config.num_features, **factory))
        if config.uses_position:
            theta = initial_theta(config.position_param, config.position_init)
            name = "beta" if config.position_param == "exp" else "alpha"
            self.register_parameter(name, nn.Parameter(torch.full((num_heads,), theta, **factory)))

    @property
    def theta(self) -> Tensor | None:
        """The position parameter: β ("exp") or α ("sigmoid"); None without a position term."""
        return (
            getattr(self, "beta", None)
            if self.position_param == "exp"
            else getattr(self, "alpha", None)
        )

    def coefficient(self) -> Tensor | None:
        """c per head, or None when there is no position term."""
        theta = self.theta
        return None if theta is None else position_coefficient(theta, self.position_param)

    def token_term(self, x=None, proj=None, features=None) -> Tensor | None:
        """τ_tok ``[B, heads, L]`` from the layer input ``x`` ("mlp"), the head projections
        ``proj`` ``[B, heads, L, hd]`` ("shared") or ``features`` ("feature")."""
        if self.token == "mlp":
            if x is None:
                raise ValueError("the MLP token temperature needs the layer input x [B, L, d].")
            return token_temperature_mlp(
                x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation
            )
        if self.token == "shared":
            if proj is None:
                raise ValueError(
                    "the shared token temperature needs the projections [B, H, L, hd]."
                )
            return token_temperature_shared(proj, self.w, self.activation)
        if self.token == "feature":
            if features is None:
                raise ValueError(
                    "the feature-based token temperature needs token_features [B, L(, F)]."
                )
            return token_temperature_feature(features, self.gamma, self.activation)
        return None

    def forward(self, n: Tensor, x=None, proj=None, features=None) -> Tensor:
        """τ ``[B, heads, L]``; ``n`` (float, broadcastable to ``[B, heads, L]``) are the token
        positions, see `query_positions` / `key_positions`."""
        tok = self.token_term(x, proj, features)
        c = self.coefficient()
        # τ in at least float32 (float64 when the parameters are), whatever the activations are.
        dtype = torch.promote_types(torch.float32, next(self.parameters()).dtype)
        n = n.to(dtype)
        tau = (
            position_temperature(n, c.view(1, -1, 1).to(dtype))
            if c is not None
            else torch.ones_like(n)
        )
        if tok is not None:
            tau = tau + tok.to(dtype)
        return tau

    def extra_repr(self) -> str:
        pos = f"1 + c·log n, c via {self.position_param}" if self.theta is not None else "1"
        return f"heads={self.num_heads}, token={self.token}, position={pos!r}"


def selective_parameter_count(
    embed_dim: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    config: SelectiveConfig | None = None,
) -> int:
    """New parameters one attention layer gets from ``config`` (analytic; equals the count of a
    real [`MultiheadAttention`][sharpattn.MultiheadAttention] with kdim = vdim = embed_dim)."""
    config = SelectiveConfig() if config is None else config
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = embed_dim // num_heads if head_dim is None else head_dim
    total = 0
    for target in config.targets:
        heads = num_heads if target == "q" else num_kv_heads
        form = config.token_form
        if form == "mlp":
            hidden = config.hidden or max(1, embed_dim // 2)
            total += embed_dim * hidden + hidden + hidden * heads + heads
        elif form == "shared":
            total += heads * head_dim
        elif form == "feature":
            total += heads * config.num_features
        if config.uses_position:
            total += heads
    return total


@dataclass(frozen=True)
class Overhead:
    added: int  # parameters of the selective temperatures
    base: int  # all other parameters
    fraction: float  # added / base


def parameter_overhead(model: nn.Module) -> Overhead:
    """How many parameters the selective temperatures add to ``model`` (any module tree)."""
    added_ids = {
        id(p) for m in model.modules() if isinstance(m, Temperature) for p in m.parameters()
    }
    params = {id(p): p.numel() for p in model.parameters()}
    added = sum(n for i, n in params.items() if i in added_ids)
    base = sum(params.values()) - added
    return Overhead(added=added, base=base, fraction=added / base if base else math.inf)
