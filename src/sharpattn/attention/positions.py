"""Linear position biases (ALiBi and NAPE) as extra head columns, so every path runs them.

ALiBi (Press et al., *Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation*, ICLR 2022) adds −m_h·(i − j) to the score of query position i and key position
j in head h, no position embedding anywhere. Its slopes: for H a power of 2, m_h = 2^{−8h/H},
h = 1..H; otherwise the slopes of the closest power of 2 below H, n, followed by every other
slope of 2n (its odd-numbered ones, 2^{−4(2k−1)/n}) until there are H (the paper's recipe).

NAPE (NoPE + ALiBi, the name ASEntmax's code, deep-spin/asentmax, gives it): ALiBi on the
first ⌊H/2⌋ heads with slopes 1, 1/2, …, 1/⌊H/2⌋ (its default "linear" slopes), and no bias at
all on the other heads (NoPE heads: only the causal mask tells their positions apart).

The normalizers take ``q, k, v`` and a ``scale``, not a bias matrix, and the fast paths never
build the score matrix. The bias is a dot product of augmented vectors instead: with p_i the
key position of query i (the last Lq of Lk positions, as a cache has them),

    scale·q_i·k_j − m_h·(p_i − j) = scale·(q_i, a_h, −a_h·p_i/g)·(k_j, j, g),   a_h = m_h/scale

so `bias_columns` appends those columns to q and k and every normalizer and path (naive,
chunked, tiles, C++ loops, Triton, torch's fused kernel) computes the biased scores with its
own products, O(n) memory, gradients included. ``g`` (a power of 2 near √Lk, exact in binary)
keeps the columns' magnitudes near √Lk·max(1, m_h/scale) rather than Lk·m_h/scale, so the
fused paths' range rule (`attend`) still admits them. The normalizer sees the biased scores:
a temperature (a normalizer's own β, selective temperatures) scales the bias with them, as in
ASEntmax's code, where the bias is added to the scores before entmax.

Precision: the key columns (positions times powers of 2) are exact, but the dot product adds
terms of size m_h·Lk/scale and cancels them, so a biased score carries an absolute rounding
error of about m_h·Lk·ε (ε = 2^{−24} in float32: 0.006 at 100,000 keys with m = 1; 2^{−53}
in float64). In 16-bit dtypes a position column would be exact only to 256 (bfloat16) or 2048
(float16): `MultiheadAttention` computes biased attention in float32 for 16-bit inputs.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

#: the linear-bias position schemes of `MultiheadAttention` (``alibi=``)
LINEAR_BIASES = ("alibi", "nape")


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's slopes m_1..m_H (Press et al.): 2^{−8h/H} for H a power of 2; otherwise those of
    the closest power of 2 below H, n, then every other slope of 2n (2^{−4(2k−1)/n}, k = 1, 2,
    …) until there are H."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {num_heads}.")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    n = 1 << (num_heads.bit_length() - 1)
    return geometric(n) + geometric(2 * n)[0::2][: num_heads - n]


def nape_slopes(num_heads: int) -> list[float]:
    """NAPE's slopes: 1/h on the first ⌊H/2⌋ heads (h = 1, 2, …), 0 (no bias) on the others."""
    biased = num_heads // 2
    if biased < 1:
        raise ValueError(
            f"nape puts ALiBi on half of the heads (⌊H/2⌋) and none on the others; with "
            f"{num_heads} head there is no ALiBi head: use at least 2 heads, or 'none'."
        )
    return [1.0 / h for h in range(1, biased + 1)] + [0.0] * (num_heads - biased)


def slopes_of(kind: str, num_heads: int) -> list[float]:
    """The slopes of a scheme of `LINEAR_BIASES` for ``num_heads`` heads."""
    if kind == "alibi":
        return alibi_slopes(num_heads)
    if kind == "nape":
        return nape_slopes(num_heads)
    raise ValueError(f"a linear bias must be one of {', '.join(LINEAR_BIASES)}, got {kind!r}.")


def append_columns(q: Tensor, k: Tensor, q_cols: Tensor, k_cols: Tensor, scale: float):
    """q ``[B, H, Lq, D]`` and k ``[B, Hkv, Lk, D]`` with columns appended so that every score
    gains Σ_c q_cols·k_cols: q gets ``q_cols / scale`` (broadcast to ``[B, H, Lq, C]``), k gets
    ``k_cols`` (to ``[B, Hkv, Lk, C]``), both cast to q's and k's dtypes. Any path then computes
    scale·q·kᵀ + Σ_c q_cols·k_cols with its own products (stick-breaking's score shift and the
    linear position biases both ride on it)."""
    c = q_cols.shape[-1]
    q_cols = (q_cols / scale).expand(*q.shape[:-1], c).to(q.dtype)
    k_cols = k_cols.expand(*k.shape[:-1], c).to(k.dtype)
    return torch.cat([q, q_cols], dim=-1), torch.cat([k, k_cols], dim=-1)


def bias_columns(q: Tensor, k: Tensor, slopes, scale: float) -> tuple[Tensor, Tensor]:
    """q and k with two columns appended (`append_columns`) such that every score of head h
    becomes scale·q_i·k_j − m_h·(p_i − j), p_i = Lk − Lq + i (queries at the last Lq of the Lk
    key positions). ``slopes``: the H slopes m_h (a sequence of numbers or a tensor ``[H]``);
    a head of slope 0 gets columns of 0 (no bias). The columns are computed in at least float32."""
    h, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    cd = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    if torch.is_tensor(slopes):
        m = slopes.to(device=q.device, dtype=cd)
    else:  # numbers: to the device without waiting for it (as_tensor's copy would, on CUDA)
        m = torch.tensor(slopes, dtype=cd).to(q.device, non_blocking=True)
    if m.shape != (h,):
        raise ValueError(
            f"a linear bias needs one slope per head ({h}), got shape {tuple(m.shape)}."
        )
    g = float(2.0 ** round(math.log2(math.sqrt(max(lk, 1)))))  # exact, near √Lk
    pos = torch.arange(lq, dtype=cd, device=q.device).add_(lk - lq)  # p_i
    key = torch.arange(lk, dtype=cd, device=q.device)
    m = m.view(1, h, 1, 1)
    # (m_h·g)·(j/g) = m_h·j and (−m_h·p_i/g)·g = −m_h·p_i: every factor is at most about
    # √Lk·max(1, m_h) in size; the key columns (positions times powers of 2) are exact
    q_cols = torch.cat([(m * g).expand(1, h, lq, 1), -m * (pos / g).view(1, 1, lq, 1)], dim=-1)
    k_cols = torch.stack([key / g, torch.full_like(key, g)], dim=-1).view(1, 1, lk, 2)
    return append_columns(q, k, q_cols, k_cols, scale)


__all__ = [
    "LINEAR_BIASES",
    "alibi_slopes",
    "append_columns",
    "bias_columns",
    "nape_slopes",
    "slopes_of",
]
