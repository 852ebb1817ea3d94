"""attend() and MultiheadAttention against SDPA, NumPy and torch.nn.MultiheadAttention."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import reference as ref
from precision import assert_close
from sharpattn import MultiheadAttention, attend, causal_mask

pytestmark = pytest.mark.numerical


def qkv(b=2, h=4, hkv=4, lq=5, lk=7, d=8, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def adaptive_exact_entropy(scores, mask=None, coefficients=ref.ICML, threshold=0.5, floor=1.0):
    """``ref.adaptive`` with the exact entropy −Σ p·log p, which the fused path streams (the
    reference code's −Σ p·log(p + 1e-9) differs from it by up to n·1e-9: a definition, not
    rounding)."""

    def row(x):
        p = np.exp(x - x.max())
        p /= p.sum()
        pos = p > 0
        h = -np.sum(p[pos] * np.log(p[pos]))
        beta = max(np.polyval(coefficients, h), floor) if h > threshold else 1.0
        e = np.exp(beta * (x - x.max()))
        return e / e.sum()

    return ref.row_wise(scores, mask, row)


def test_causal_mask_aligns_queries_to_the_end():
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    m = causal_mask(4, 2)  # more queries than keys: the first two see nothing
    assert m.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    assert torch.equal(causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("impl", ["auto", "naive"])
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(causal=True, lq=6, lk=6),
        dict(hkv=2),
        dict(hkv=1, causal=True, lq=3, lk=9),
        dict(mask="padding"),
    ],
)
def test_softmax_equals_sdpa(case, impl):
    case = dict(case)
    causal, masked = case.pop("causal", False), case.pop("mask", None)
    q, k, v = qkv(dtype=torch.float32, **case)
    mask = None
    if masked:
        mask = torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)
        mask[0, ..., -3:] = False
    expect_mask = mask
    if causal:
        expect_mask = causal_mask(q.shape[2], k.shape[2])  # SDPA's is_causal is top-left aligned
    expect = F.scaled_dot_product_attention(
        q, k, v, attn_mask=expect_mask, enable_gqa=q.shape[1] != k.shape[1]
    )
    out = attend(q, k, v, "softmax", mask=mask, causal=causal, impl=impl)
    # two float32 implementations: width-d scores (relative error ε·√d·|s|), a sum over lk values
    smax = float(q.abs().max() * k.abs().max()) * q.shape[-1] ** 0.5
    vmax = float(v.abs().max())
    assert_close(out, expect, n=k.shape[2] * q.shape[-1], magnitude=vmax * (1 + smax))


@pytest.mark.parametrize("method", ["softmax", "adaptive"])
@pytest.mark.parametrize("case", [dict(), dict(causal=True, lq=3, lk=6), dict(hkv=2, lq=6)])
def test_attend_matches_numpy(method, case):
    case = dict(case)
    causal = case.pop("causal", False)
    q, k, v = qkv(**case)
    mask = (
        torch.rand(
            q.shape[0], 1, q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(3)
        )
        > 0.3
    )
    fn = {"softmax": ref.softmax, "adaptive": ref.adaptive}[method]
    expect = ref.attention(q, k, v, fn, mask=mask.numpy(), causal=causal, scale=0.7)
    out = attend(q, k, v, method, mask=mask, causal=causal, scale=0.7, impl="naive")
    lk, d = k.shape[2], q.shape[-1]
    smax = float(q.abs().max() * k.abs().max()) * d * 0.7
    vmax = float(v.abs().max())
    mag = vmax * (1 + 3 * smax)  # β ≤ 3 multiplies the logits (and their error)
    assert_close(out, expect, n=lk * d, magnitude=mag)
    # The fused path (what auto picks) against the float64 formula it implements: for adaptive,
    # β from the exact entropy (see adaptive_exact_entropy)
    fn = {"softmax": ref.softmax, "adaptive": adaptive_exact_entropy}[method]
    expect = ref.attention(q, k, v, fn, mask=mask.numpy(), causal=causal, scale=0.7)
    out = attend(q, k, v, method, mask=mask, causal=causal, scale=0.7, impl="fused")
    assert_close(out, expect, n=lk * d, magnitude=mag)


def test_empty_rows_give_zero_output_on_every_path():
    q, k, v = qkv(lq=6, lk=3, dtype=torch.float32, grad=True)
    for method, impl in (("softmax", "auto"), ("softmax", "naive"), ("adaptive", "auto")):
        out = attend(q, k, v, method, causal=True, impl=impl)  # queries 0-2 see no key
        assert torch.all(out[:, :, :3] == 0) and torch.isfinite(out).all()
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
        q.grad = k.grad = v.grad = None


def test_temperature_through_both_paths():
    q, k, v = qkv(dtype=torch.float64)
    theta = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64).view(1, 4, 1, 1)
    lk, d = k.shape[2], q.shape[-1]
    smax = float(q.abs().max() * k.abs().max()) * d**0.5  # |q·k|/√d
    for t in (0.3, theta):
        a = attend(q, k, v, "softmax", temperature=t, impl="fused")
        b = attend(q, k, v, "softmax", temperature=t, impl="naive")
        # two float64 paths: width-d scores over θ ≥ 0.3 (each weight's relative error is its
        # logit's), a sum over lk values
        mag = float(v.abs().max()) * (1 + smax / 0.3)
        assert_close(a, b, n=lk * d, magnitude=mag)
    with pytest.raises(ValueError, match="temperature"):
        attend(q, k, v, "softmax", temperature=0.0)


def test_return_weights_and_impl_errors(gain_normalizer):
    q, k, v = qkv()
    out, w = attend(q, k, v, "adaptive", return_weights=True)
    assert w.shape == (2, 4, 5, 7)
    assert torch.equal(out, w @ v)  # the naive path's output is these weights times v
    out2, w2 = attend(q, k, v, "softmax", return_weights=True)  # auto falls back to naive
    # against the fused path (float64): width-d scores, a sum over lk values
    lk, d = k.shape[2], q.shape[-1]
    smax = float(q.abs().max() * k.abs().max()) * d**0.5
    mag = float(v.abs().max()) * (1 + smax)
    assert_close(out2, attend(q, k, v, "softmax"), n=lk * d, magnitude=mag)
    with pytest.raises(ValueError, match="no fused path"):
        attend(q, k, v, gain_normalizer, impl="fused")
    with pytest.raises(ValueError, match="impl"):
        attend(q, k, v, impl="fast")
    with pytest.raises(ValueError, match="unknown attention method"):
        attend(q, k, v, "nope")


def test_shape_errors_name_both_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"\(2, 4, 5, 8\).*\(2, 4, 7, 6\)"):
        attend(q, k[..., :6], v)
    with pytest.raises(ValueError, match=r"\(2, 3, 7, 8\)"):
        attend(q, k[:, :3], v[:, :3])  # 3 key heads do not divide 4 query heads
    with pytest.raises(ValueError, match=r"\(2, 4, 7, 8\).*\(2, 4, 6, 8\)"):
        attend(q, k, v[:, :, :6])
    with pytest.raises(ValueError, match="4-d"):
        attend(q[0], k, v)
    with pytest.raises(ValueError, match="broadcast"):
        attend(q, k, v, mask=torch.ones(3, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="dtype"):
        attend(q, k.float(), v)
    bad = q.clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"\(0, 1, 2, 3\)"):
        attend(bad, k, v)


@pytest.mark.parametrize("method", ["softmax", "adaptive"])
@pytest.mark.parametrize("impl", ["auto", "naive"])
def test_attend_gradcheck(method, impl):
    q, k, v = qkv(b=1, h=2, hkv=1, lq=3, lk=4, d=3, grad=True)
    mask = torch.tensor([[True, True, False, True]])
    assert torch.autograd.gradcheck(
        lambda q, k, v: attend(q, k, v, method, mask=mask, causal=True, impl=impl), (q, k, v)
    )


# ---------------------------------------------------------------- MultiheadAttention


def test_mha_equals_torch_multihead_attention():
    torch.manual_seed(0)
    d, h = 16, 4
    theirs = torch.nn.MultiheadAttention(d, h, batch_first=True)
    ours = MultiheadAttention(d, h)
    with torch.no_grad():
        wq, wk, wv = theirs.in_proj_weight.chunk(3)
        bq, bk, bv = theirs.in_proj_bias.chunk(3)
        for proj, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)
    x = torch.randn(3, 10, d)
    real = torch.ones(3, 10, dtype=torch.bool)
    real[1, 7:] = False
    expect, expect_w = theirs(x, x, x, key_padding_mask=~real, average_attn_weights=False)
    out, w = ours(x, key_mask=real, return_weights=True)
    # two float32 implementations of one layer: projections (width d), scores, a 10-key sum and
    # the output projection, chained
    assert_close(out, expect, n=d * 10 * d)
    assert_close(w, expect_w, n=d * 10, magnitude=1.0)
    assert_close(ours(x, key_mask=real), expect, n=d * 10 * d)


def test_mha_padding_is_ignored_and_causal():
    torch.manual_seed(0)
    mha = MultiheadAttention(12, 3, method="adaptive", num_kv_heads=1, causal=True)
    x = torch.randn(2, 6, 12)
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0, 4:] = False
    out, w = mha(x, key_mask=real, return_weights=True)
    assert out.shape == (2, 6, 12) and w.shape == (2, 3, 6, 6)
    assert torch.all(w[0, :, :, 4:] == 0)
    assert torch.all(w.triu(1) == 0)  # causal
    x2 = x.clone()
    x2[0, 4:] = 100.0  # changing padded tokens changes nothing the real tokens see
    # exactly, on each path: padded keys get weight 0 and 0·v = 0; every sum the real tokens
    # see is the same (naive: the path that returned the weights; auto: the fused path)
    assert torch.equal(mha(x2, key_mask=real, return_weights=True)[0][0, :4], out[0, :4])
    chunked = [mha(t, key_mask=real, impl="chunked")[0, :4] for t in (x, x2)]
    assert torch.equal(*chunked)
    # auto: the fused path while every token's q and k keep β·s in its range (a bound from all
    # tokens, padded ones included: `fast.scores_in_range`); padded tokens of 100 leave it
    x3 = x.clone()
    x3[0, 4:] = 2.0
    assert torch.equal(mha(x3, key_mask=real)[0, :4], mha(x, key_mask=real)[0, :4])


def test_mha_dtype_cross_attention_and_errors():
    mha = MultiheadAttention(8, 2, kdim=5, vdim=3, dtype=torch.float64, temperature=0.5)
    q, kv_k, kv_v = (
        torch.randn(2, 4, 8).double(),
        torch.randn(2, 9, 5).double(),
        torch.randn(2, 9, 3).double(),
    )
    out = mha(q, kv_k, kv_v)
    assert out.dtype == torch.float64 and out.shape == (2, 4, 8)
    with pytest.raises(ValueError, match="no parameter"):
        MultiheadAttention(8, 2, method="adaptive", temperature=2.0)
    with pytest.raises(ValueError, match="divide"):
        MultiheadAttention(8, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="key_mask"):
        mha(q, kv_k, kv_v, key_mask=torch.ones(2, 9))


def test_mha_learnable_normalizer_parameters(gain_normalizer):
    """A learnable registry parameter becomes a per-head nn.Parameter that receives gradients."""
    torch.manual_seed(0)
    mha = MultiheadAttention(8, 2, method=gain_normalizer, gain=2.0)
    assert mha.normalizer_params["gain"].shape == (2,)
    assert torch.all(mha.normalizer_params["gain"] == 2.0)
    x = torch.randn(3, 5, 8)
    mha(x).pow(2).sum().backward()
    assert mha.normalizer_params["gain"].grad.abs().sum() > 0
    assert "normalizer_params.gain" in mha.state_dict()
    # equals softmax attention with the per-head gain folded into the temperature
    ref_mha = MultiheadAttention(8, 2)
    ref_mha.load_state_dict({k: v for k, v in mha.state_dict().items() if "gain" not in k})
    theta = (1 / mha.normalizer_params["gain"].detach()).view(1, 2, 1, 1)
    with torch.no_grad():
        q = ref_mha.q_proj(x).view(3, 5, 2, 4).transpose(1, 2)
        k = ref_mha.k_proj(x).view(3, 5, 2, 4).transpose(1, 2)
        v = ref_mha.v_proj(x).view(3, 5, 2, 4).transpose(1, 2)
        o = attend(q, k, v, temperature=theta).transpose(1, 2).reshape(3, 5, 8)
        # float32 scores·gain (naive) vs scores/θ (fused): the same projections, scores of
        # width 4, a 5-key sum and the output projection (width 8), chained
        assert_close(mha(x), ref_mha.out_proj(o), n=4 * 5 * 8)


def test_mha_trains():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 2, method="adaptive")
    x = torch.randn(16, 8, 16)
    target = x.flip(1)
    opt = torch.optim.Adam(mha.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = F.mse_loss(mha(x), target)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
