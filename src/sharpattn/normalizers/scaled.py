"""Length-scaled softmax: the inverse temperature grows with log n, so a fixed logit margin keeps
its winner as n grows (Scalable-Softmax; the position temperature of selective attention; the
query scalings of Llama 4 and Qwen).

"n" is the number of allowed keys of the row (`_contract.visible_keys`); under a causal
mask without padding it is the query's position + 1, the quantity the model codes below use.
Every β here is a per-row factor on the scores: each method is a `RowScaled`
family, whose fast path multiplies the rows of q by the same β function.
"""

from __future__ import annotations

import math

import torch

from ._contract import nonnegative, normalizer
from .families import RowScaled, log_n
from .registry import Normalizer, Param, register

Tensor = torch.Tensor


def ssmax_beta(log_n: Tensor, s: float | Tensor) -> Tensor:
    """SSMax's inverse temperature of a row, s·log n (shared with the fused query-scaling path)."""
    return s * log_n


def llama4_beta(n: Tensor, floor_scale: float, attn_scale: float) -> Tensor:
    """Llama 4's attention temperature of a row with n keys, 1 + a·log(1 + ⌊n / F⌋) (shared with the
    fused query-scaling path). Computed in float64 (n is an exact count, so ⌊n / F⌋ is exact) and
    returned in n's dtype."""
    steps = torch.floor(n.to(torch.float64) / float(floor_scale))
    return (1.0 + float(attn_scale) * torch.log1p(steps)).to(n.dtype)


def logn_beta(n: Tensor, train_length: float) -> Tensor:
    """Qwen's log-n query scale of a row with n keys, max(1, log n / log L) (shared with the fused
    query-scaling path): 1 up to the training length L, log_L n beyond it. Computed in float64 and
    returned in n's dtype; rows without a key get 1."""
    log_l = math.log(float(train_length))
    return (torch.log(n.to(torch.float64).clamp_min(1.0)) / log_l).clamp_min(1.0).to(n.dtype)


def length_scaled_beta(log_n: Tensor, c: float | Tensor) -> Tensor:
    """length_scaled's inverse temperature of a row, 1 + c·log n with c >= 0 (shared with the
    fused query-scaling path)."""
    return 1.0 + nonnegative(c, "c") * log_n


# The family hooks: β of a row from its visible keys n and the method's parameters
def _ssmax_rows(n: Tensor, s: float | Tensor = 0.43, **_) -> Tensor:
    return ssmax_beta(log_n(n), s)


def _length_scaled_rows(n: Tensor, c: float | Tensor = 0.0, **_) -> Tensor:
    return length_scaled_beta(log_n(n), c)


def _llama4_rows(n: Tensor, floor_scale: float = 8192, attn_scale: float = 0.1, **_) -> Tensor:
    return llama4_beta(n, floor_scale, attn_scale)


def _logn_rows(n: Tensor, train_length: float = 2048, **_) -> Tensor:
    return logn_beta(n, train_length)


SSMAX = RowScaled(_ssmax_rows)
LENGTH_SCALED = RowScaled(_length_scaled_rows)
LLAMA4 = RowScaled(_llama4_rows)
LOGN = RowScaled(_logn_rows)


@normalizer
def ssmax(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    s: float | Tensor = 0.43,
    check_finite: bool = True,
) -> Tensor:
    """Scalable-Softmax: softmax(s·log(n)·scores) over the allowed keys (Nakanishi 2025).

    ``s`` is the scaling parameter, learnable per head in [`MultiheadAttention`][sharpattn.MultiheadAttention] (0.43 is
    the value reported for SSMax). Any real ``s`` is accepted (s < 0 reverses the ranking; s = 0
    is uniform). A row with one key (n = 1, log n = 0) puts weight 1 on it.
    """
    return SSMAX.weights(scores, mask, check_finite=check_finite, s=s)


@normalizer
def length_scaled(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    c: float | Tensor = 0.0,
    check_finite: bool = True,
) -> Tensor:
    """softmax((1 + c·log n)·scores) over the allowed keys, c >= 0.

    The functional form of selective attention's position temperature (Zhang et al. 2024) and
    of Chiang & Cholak's (2022) log-length scaling; c = 0 is softmax. A plain-number ``c`` must
    be >= 0; a tensor ``c`` (the learnable per-head parameter) is clamped at 0 with a
    straight-through gradient (see `_contract.nonnegative`).
    """
    return LENGTH_SCALED.weights(scores, mask, check_finite=check_finite, c=c)


@normalizer
def llama4_temperature(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    floor_scale: float = 8192,
    attn_scale: float = 0.1,
    check_finite: bool = True,
) -> Tensor:
    """Llama 4's attention temperature tuning: softmax(β(n)·scores), β(n) = 1 + attn_scale·log(1 +
    ⌊n / floor_scale⌋).

    As Hugging Face transformers' ``Llama4TextAttention`` defines it (``attn_temperature_tuning``,
    applied to the queries of the NoPE layers): ``attn_scales = log1p(floor((cache_position + 1) /
    floor_scale)) * attn_scale + 1``, defaults floor_scale = 8192, attn_scale = 0.1 (transformers
    5.23, ``models/llama4``). There the count is the absolute position + 1 (padding included); here
    it is n, the row's allowed keys, which is the same under a causal mask without padding.
    β = 1 for n < floor_scale: the method is softmax up to 8192 keys by default.
    """
    return LLAMA4.weights(
        scores, mask, check_finite=check_finite, floor_scale=floor_scale, attn_scale=attn_scale
    )


@normalizer
def logn(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    train_length: float = 2048,
    check_finite: bool = True,
) -> Tensor:
    """Qwen's log-n attention scaling: softmax(β(n)·scores), β(n) = max(1, log n / log L),
    L = ``train_length``.

    As Qwen(-1)'s Hugging Face model code defines it (``modeling_qwen.py``, ``use_logn_attn``):
    ``logn_list = [math.log(i, seq_length) if i > seq_length else 1 for i in range(1, 32768)]``,
    the query at absolute position p multiplied by ``logn_list[p]`` = log_L(p + 1) beyond the
    training length ``seq_length`` (``QWenConfig`` default 2048), 1 within it. Qwen applies it at
    inference only (``not self.training``); this normalizer applies it whenever it is called, which
    changes nothing for rows with n <= L. n is the row's allowed keys (= p + 1 under a causal mask
    without padding).
    """
    return LOGN.weights(scores, mask, check_finite=check_finite, train_length=train_length)


ssmax = register(
    Normalizer(
        name="ssmax",
        fn=ssmax,
        formula="softmax over s·log(n)·s_j (scaling s learnable per head)",
        citation="Nakanishi 2025, Scalable-Softmax Is Superior for Attention",
        sums_to_one=True,
        params=(Param("s", 0.43, "scaling parameter s (0.43 reported for SSMax)", learnable=True),),
        family=SSMAX,
    )
).fn
length_scaled = register(
    Normalizer(
        name="length_scaled",
        fn=length_scaled,
        formula="softmax over (1 + c·log n)·s_j, c >= 0 (learnable per head)",
        citation="Zhang et al. 2024, Selective Attention; Chiang & Cholak 2022",
        sums_to_one=True,
        params=(
            Param(
                "c",
                0.0,
                "log-length coefficient c >= 0 (c = 0 is softmax)",
                learnable=True,
                low=0.0,
                clamped=True,
            ),
        ),
        family=LENGTH_SCALED,
    )
).fn
llama4_temperature = register(
    Normalizer(
        name="llama4_temperature",
        fn=llama4_temperature,
        formula="softmax over β(n)·s_j, β(n) = 1 + a·log(1 + ⌊n / F⌋) (F = floor_scale, a = attn_scale)",
        citation="Meta Llama 4 (Hugging Face transformers Llama4TextAttention, attn_temperature_tuning)",
        sums_to_one=True,
        params=(
            Param(
                "floor_scale",
                8192,
                "F: keys per step of the temperature (8192 in Llama 4)",
                low=0.0,
                low_open=True,
            ),
            Param("attn_scale", 0.1, "a: strength of the temperature (0.1 in Llama 4)"),
        ),
        family=LLAMA4,
    )
).fn
logn = register(
    Normalizer(
        name="logn",
        fn=logn,
        formula="softmax over max(1, log n / log L)·s_j (L = train_length)",
        citation="Qwen (Bai et al. 2023; Qwen-7B modeling_qwen.py, use_logn_attn)",
        sums_to_one=True,
        params=(
            Param(
                "train_length",
                2048,
                "L: the training length (Qwen's seq_length)",
                low=1.0,
                low_open=True,
            ),
        ),
        family=LOGN,
    )
).fn
