"""Linear position biases (ALiBi, NAPE) as extra head columns: pinned to an explicit bias matrix
in float64, for several normalizers, on the naive and the fast paths, forward and gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from methods import reference
from sharpattn import MultiheadAttention, attend
from sharpattn.attention import functional
from sharpattn.attention.positions import alibi_slopes, bias_columns, nape_slopes
from sharpattn.models.transformer import Transformer, TransformerConfig
from sharpattn.normalizers import get

METHODS = ["softmax", "sigmoid", "sparsemax", "stick_breaking", "entmax15", "relu", "asentmax"]


def test_alibi_slopes_follow_the_paper():
    # a power of 2: 2^(−8h/H), h = 1..H
    assert alibi_slopes(8) == [2.0**-h for h in range(1, 9)]
    assert alibi_slopes(4) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    assert alibi_slopes(1) == [2.0**-8]
    # otherwise: the closest power of 2 below (4 → 2^-2, 2^-4, 2^-6, 2^-8), then the odd-numbered
    # slopes of twice it (8 → 2^-1, 2^-3, ...)
    assert alibi_slopes(6) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert alibi_slopes(12)[8:] == [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]


def test_nape_slopes_put_alibi_on_the_first_half_of_the_heads():
    assert nape_slopes(8) == [1.0, 0.5, 1 / 3, 0.25, 0.0, 0.0, 0.0, 0.0]
    assert nape_slopes(3) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2 heads"):
        nape_slopes(1)


def explicit(q, k, v, slopes, method, scale, params=None):
    """float64: scores scale·q·kᵀ − m_h·(p_i − j) as a matrix (queries at the last Lq of Lk
    positions, GQA by repetition), the registry normalizer on them, times v."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    lq, lk = q.shape[2], k.shape[2]
    p = torch.arange(lq, dtype=torch.float64)[:, None] + (lk - lq)
    j = torch.arange(lk, dtype=torch.float64)
    bias = -torch.tensor(slopes, dtype=torch.float64).view(1, -1, 1, 1) * (p - j)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale + bias
    allowed = j <= p
    w = get(method).fn(scores.masked_fill(~allowed, -math.inf), allowed, **(params or {}))
    return scores, allowed, w @ v


def inputs(lq=5, lk=9, d=8, heads=4, kv=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, lq, d, generator=g, dtype=dtype)
    k = torch.randn(2, kv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(2, kv, lk, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("impl", ["naive", "auto"])
@pytest.mark.parametrize("slopes", ["alibi", "nape"])
def test_bias_columns_give_the_explicit_bias(method, impl, slopes):
    q, k, v = inputs()
    m = alibi_slopes(4) if slopes == "alibi" else nape_slopes(4)
    m = [4 * s for s in m]  # slopes large enough to change the weights at these lengths
    scale = 1 / math.sqrt(q.shape[-1])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    qa, ka = bias_columns(q, k, m, scale)
    out = attend(qa, ka, v, method, causal=True, scale=scale, impl=impl)
    scores, allowed, want = explicit(q, k, v, m, method, scale)
    # the forward against the tests' own NumPy transcription of the normalizer
    w = reference(method, scores, allowed.expand_as(scores), {})
    rep = q.shape[1] // k.shape[1]
    by_hand = np.einsum("bhqk,bhkd->bhqd", w, v.detach().repeat_interleave(rep, 1).numpy())
    np.testing.assert_allclose(out.detach().numpy(), by_hand, atol=1e-10)
    # the gradients against autograd through the explicit bias matrix
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("method", ["softmax", "sigmoid", "stick_breaking"])
def test_long_rows_in_float32_stay_on_the_fast_path_within_the_stated_error(method):
    """20,000 keys, the last 3 positions queried (a cache's offset): the columns' sizes pass the
    fused paths' range rule, and the float32 result is within the documented rounding of the
    float64 explicit bias."""
    lq, lk, d = 3, 20_000, 16
    q, k, v = inputs(lq, lk, d, heads=2, kv=1, dtype=torch.float32, seed=1)
    m = alibi_slopes(2)  # 1/16 and 1/256
    scale = 1 / math.sqrt(d)
    qa, ka = bias_columns(q, k, m, scale)
    sizes = functional._check_ranges(qa, ka, v, scale, torch.float32)
    assert max(sizes) < torch.finfo(torch.float32).max ** 0.25  # the fused kernel is allowed
    out = attend(qa, ka, v, method, causal=True, scale=scale)
    want = explicit(q, k, v, m, method, scale)[2]
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("want_lse", [False, True])
def test_softmax_with_bias_columns_keeps_a_fused_kernel(monkeypatch, want_lse):
    """q and k carry two more columns than v: the CPU's fused kernels get one head size (zero
    columns added), so softmax stays on them, never on torch's O(n²)-memory reference path
    (which SDPA picks for unequal sizes) nor on the block fallback; the result is unchanged."""
    from sharpattn.attention.cpu import fused

    # more rows than a decoding step (`decoding.ROWS`), which runs its own pass
    q, k, v = inputs(lq=24, lk=24, d=8, heads=4, kv=4, dtype=torch.float32, seed=2)
    qa, ka = bias_columns(q, k, alibi_slopes(4), 0.3)
    seen = []
    sdpa, flash = torch.nn.functional.scaled_dot_product_attention, fused._FLASH

    def record(real):
        def call(q_, k_, v_, *a, **kw):
            seen.append((q_.shape[-1], k_.shape[-1], v_.shape[-1]))
            return real(q_, k_, v_, *a, **kw)

        return call

    def no_fallback(*a, **kw):
        raise AssertionError("softmax with bias columns took the block fallback")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record(sdpa))
    monkeypatch.setattr(fused, "_FLASH", record(flash))
    monkeypatch.setattr(fused, "chunked_softmax_attention", no_fallback)
    if want_lse:
        from sharpattn.attention.masking import Masking

        masking = Masking.build(None, True, 24, 24, "cpu")
        out, _ = fused.softmax_attention(qa, ka, v, masking, 0.3)
    else:
        out = attend(qa, ka, v, "softmax", causal=True, scale=0.3)
    assert seen and all(a == b == c and a % 8 == 0 for a, b, c in seen), seen
    assert out.shape == v.shape
    want = explicit(q, k, v, alibi_slopes(4), "softmax", 0.3)[2]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_a_head_of_slope_zero_is_left_unbiased():
    q, k, v = inputs()
    m = [0.5, 0.0, 0.25, 0.0]
    qa, ka = bias_columns(q, k, m, 0.3)
    biased = attend(qa, ka, v, "softmax", causal=True, scale=0.3)
    plain = attend(q, k, v, "softmax", causal=True, scale=0.3)
    # its columns are 0: the same scores, up to the order of the sums
    torch.testing.assert_close(biased[:, 1::2], plain[:, 1::2], atol=1e-14, rtol=0)
    assert not torch.allclose(biased[:, 0::2], plain[:, 0::2])


def test_multihead_attention_alibi_matches_the_explicit_bias():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, "sparsemax", causal=True, bias=False, alibi="alibi").double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    out = mha(x)
    q = mha.q_proj(x).view(2, 7, 4, 4).transpose(1, 2)
    k = mha.k_proj(x).view(2, 7, 4, 4).transpose(1, 2)
    v = mha.v_proj(x).view(2, 7, 4, 4).transpose(1, 2)
    o = explicit(q, k, v, alibi_slopes(4), "sparsemax", 0.5)[2]
    torch.testing.assert_close(out, mha.out_proj(o.transpose(1, 2).reshape(2, 7, 16)))
    assert "alibi='alibi'" in repr(mha)


def test_multihead_attention_attends_16_bit_inputs_in_float32():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 2, "softmax", causal=True, alibi="nape")
    x = torch.randn(1, 300, 16)
    ref = mha(x)
    half = mha.to(torch.bfloat16)(x.bfloat16())
    assert half.dtype == torch.bfloat16
    # positions up to 300 would be rounded in a bfloat16 column (exact only to 256)
    torch.testing.assert_close(half.float(), ref, atol=0.05, rtol=0.05)


def test_refusals_are_one_sentence():
    with pytest.raises(ValueError, match="at least 2 heads"):
        MultiheadAttention(8, 1, alibi="nape")
    with pytest.raises(ValueError, match="pick one"):
        MultiheadAttention(8, 2, alibi="alibi", rotary=True)
    with pytest.raises(ValueError, match="alibi must be None or one of"):
        MultiheadAttention(8, 2, alibi="rope")
    with pytest.raises(ValueError, match="at least 2 heads"):
        TransformerConfig(positions="nape", n_heads=1, d_model=8)


@pytest.mark.parametrize("positions", ["alibi", "nape"])
def test_transformer_runs_beyond_any_table(positions):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=7,
        n_out=7,
        d_model=16,
        n_heads=2,
        layers=2,
        max_len=8,
        positions=positions,
        method="stick_breaking",
    )
    model = Transformer(cfg)
    assert not hasattr(model, "pos_emb")
    idx = torch.randint(7, (2, 40))
    logits = model(idx)  # 40 > max_len: no position table
    assert logits.shape == (2, 40, 7) and torch.isfinite(logits).all()
    # causal: a prefix's logits do not depend on what follows
    torch.testing.assert_close(model(idx[:, :12]), logits[:, :12], atol=1e-5, rtol=1e-5)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
