"""Independent float64 NumPy transcriptions of the formulas, for tests to compare against."""

from __future__ import annotations

import math

import numpy as np

ICML = [-0.037, 0.481, -2.3, 4.917, -1.791]
ARXIV = [-0.04, 0.48, -2.3, 4.92, -1.79]


def allowed_of(scores: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    allowed = scores != -np.inf
    if mask is not None:
        allowed = allowed & np.broadcast_to(mask, scores.shape)
    return allowed


def row_wise(scores, mask, row_fn) -> np.ndarray:
    """Apply ``row_fn`` to the allowed entries of each row; disallowed entries and empty rows 0."""
    s = np.asarray(scores, dtype=np.float64)
    allowed = allowed_of(s, mask)
    out = np.zeros_like(s)
    for idx in np.ndindex(s.shape[:-1]):
        a = allowed[idx]
        if a.any():
            out[idx][a] = row_fn(s[idx][a])
    return out


def _softmax_row(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def softmax(scores, mask=None, temperature=1.0) -> np.ndarray:
    return row_wise(scores, mask, lambda x: _softmax_row(x / temperature))


def adaptive(scores, mask=None, coefficients=ICML, threshold=0.5, floor=1.0) -> np.ndarray:
    """Veličković et al. Fig. 4, row by row."""

    def row(x):
        p = _softmax_row(x)
        h = np.sum(-p * np.log(p + 1e-9))
        beta = max(np.polyval(coefficients, h), floor) if h > threshold else 1.0
        return _softmax_row(beta * x)

    return row_wise(scores, mask, row)


def attention(q, k, v, weights_fn, mask=None, causal=False, scale=None) -> np.ndarray:
    """out = weights_fn(scale·q·kᵀ, mask)·v with GQA by repetition and end-aligned causality."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    h, hkv = q.shape[1], k.shape[1]
    k = np.repeat(k, h // hkv, axis=1)
    v = np.repeat(v, h // hkv, axis=1)
    lq, lk = q.shape[2], k.shape[2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    full = np.ones(scores.shape, dtype=bool)
    if mask is not None:
        full &= np.broadcast_to(mask, scores.shape)
    if causal:
        full &= np.array([[j <= i + lk - lq for j in range(lk)] for i in range(lq)], dtype=bool)
    return np.einsum("bhqk,bhkd->bhqd", weights_fn(scores, full), v)


def transformer_internals(m, x):
    """Every layer's internals of `models.transformer.Transformer` ``m`` (softmax or relu) on
    tokens ``x``, by hand in float64 NumPy from the model's weights:
    {L: (scores with -inf above the diagonal, weights, value vectors O_h·V_h·LN(h) [B, H, T, d],
    residual after the layer)}."""
    cfg = m.cfg
    w_ = {n: p.detach().double().numpy() for n, p in m.named_parameters()}
    b, t = x.shape
    d, heads = cfg.d_model, cfg.n_heads
    hd = d // heads

    def ln(h, name):
        mu = h.mean(-1, keepdims=True)
        var = h.var(-1, keepdims=True)
        return (h - mu) / np.sqrt(var + 1e-5) * w_[name + ".weight"] + w_[name + ".bias"]

    h = w_["tok_emb.weight"][x.numpy()] + w_["pos_emb.weight"][:t]
    causal = np.tril(np.ones((t, t), dtype=bool))
    out = {}
    for i, kind in enumerate(cfg.layers):
        pre = f"layers.{i}"
        rec = {}
        if kind in ("tf", "attn"):
            a = ln(h, f"{pre}.ln_attn")

            def proj(n, a=a, pre=pre):
                return (a @ w_[f"{pre}.attn.{n}_proj.weight"].T).reshape(b, t, heads, hd)

            q, k, v = (proj(n).transpose(0, 2, 1, 3) for n in "qkv")  # (B, H, T, hd)
            s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            if cfg.method == "softmax":
                e = np.exp(s - s.max(-1, keepdims=True))
                wts = e / e.sum(-1, keepdims=True)
            else:  # relu: ReLU(s) / (number of visible keys)
                wts = np.where(causal, np.maximum(s, 0), 0) / np.arange(1, t + 1)[:, None]
            o = w_[f"{pre}.attn.out_proj.weight"].reshape(d, heads, hd)
            vals = np.einsum("bhjk,mhk->bhjm", v, o)  # O_h·V_h·LN(h)_j
            h = h + np.einsum("bhij,bhjm->bim", wts, vals)
            rec.update(scores=s, weights=wts, values=vals)
        if kind in ("tf", "mlp"):
            a = ln(h, f"{pre}.ln_mlp")
            h = h + np.maximum(a @ w_[f"{pre}.mlp.fc.weight"].T, 0) @ w_[f"{pre}.mlp.proj.weight"].T
        rec["resid_post"] = h
        out[i] = rec
    return out, h
