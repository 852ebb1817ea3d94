"""Rotary positions: against NumPy float64, norms, relative positions, MultiheadAttention and the
tiny transformer with rotary positions and selective temperatures."""

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn import MultiheadAttention
from sharpattn.attention.rotary import apply_rotary
from sharpattn.models.transformer import Transformer, TransformerConfig

pytestmark = pytest.mark.numerical


def rope_numpy(x, positions, base=10000.0):
    """Independent float64 RoPE: pair (i, i + D/2) rotated by m·base^(−2i/D), as 2×2 matrices."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    out = np.empty_like(x)
    for li, m in enumerate(positions):
        for i in range(d // 2):
            a = m * base ** (-2.0 * i / d)
            rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
            pair = np.stack([x[..., li, i], x[..., li, i + d // 2]], -1)  # (..., 2)
            r = pair @ rot.T
            out[..., li, i], out[..., li, i + d // 2] = r[..., 0], r[..., 1]
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotary_matches_numpy(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64) * 50
    pos = torch.tensor([0.0, 1, 2, 5, 100, 1023, 40000])
    want = rope_numpy(x.numpy(), pos.tolist())
    got = apply_rotary(x.to(dtype), pos)
    assert got.dtype == dtype
    # angles in float64, cos/sin and the two-term rotation in dtype (inputs rounded to it too):
    # a few roundings of terms of size max|x|
    assert_close(got, want, dtype=dtype, n=2, magnitude=float(x.abs().max()))
    # position 0 is the identity
    assert torch.equal(got[..., 0, :], x[..., 0, :].to(dtype))


def test_rotary_preserves_norms_and_scores_are_relative():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 16, generator=g, dtype=torch.float64)
    for m in (0.0, 3.0, 517.0):
        qm = apply_rotary(q.view(1, 16), torch.tensor([m]))[0]
        assert_close(qm.norm(), q.norm(), n=16)  # a rotation: the same sum of squares, rounded
    # q_m · k_n depends only on n − m
    for delta in (0, 1, 7, -5, 300):
        scores = []
        for m in (0, 11, 250, 4000):
            qm = apply_rotary(q.view(1, 16), torch.tensor([float(m)]))[0]
            kn = apply_rotary(k.view(1, 16), torch.tensor([float(m + delta)]))[0]
            scores.append(float(qm @ kn))
        # equal up to rounding: angles of up to 4300 rad in float64 (an angle's error ε·4300
        # moves a score by that times |q||k|), dot products of width 16
        mag = float(q.norm() * k.norm()) * 4300
        assert_close(scores, [scores[0]] * len(scores), dtype=torch.float64, n=16, magnitude=mag)
    # ...and does depend on it
    s0 = apply_rotary(q.view(1, 16), torch.tensor([0.0]))[0] @ k
    s1 = (
        apply_rotary(q.view(1, 16), torch.tensor([0.0]))[0]
        @ apply_rotary(k.view(1, 16), torch.tensor([3.0]))[0]
    )
    assert abs(float(s0 - s1)) > 1e-3


def test_rotary_odd_head_dim_is_an_error():
    with pytest.raises(ValueError, match="even"):
        MultiheadAttention(6, 2, rotary=True)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(torch.zeros(2, 3), torch.arange(2.0))


def test_mha_rotary_matches_numpy_attention():
    torch.manual_seed(0)
    d, h, length = 8, 2, 5
    mha = MultiheadAttention(d, h, bias=False, causal=True, rotary=True).double()
    x = torch.randn(1, length, d, dtype=torch.float64)
    got = mha(x)
    hd = d // h
    xn = x[0].numpy()
    q = (xn @ mha.q_proj.weight.detach().numpy().T).reshape(length, h, hd).transpose(1, 0, 2)
    k = (xn @ mha.k_proj.weight.detach().numpy().T).reshape(length, h, hd).transpose(1, 0, 2)
    v = (xn @ mha.v_proj.weight.detach().numpy().T).reshape(length, h, hd).transpose(1, 0, 2)
    q, k = rope_numpy(q, range(length)), rope_numpy(k, range(length))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = (w @ v).transpose(1, 0, 2).reshape(length, d) @ mha.out_proj.weight.detach().numpy().T
    assert_close(got[0], o, n=d * length * d)  # projections, the attention sum, output projection


def test_mha_rotary_with_cache_offset_matches_full_sequence():
    """The last Lq queries over all Lk keys equal the full causal pass's last rows."""
    torch.manual_seed(2)
    mha = MultiheadAttention(16, 4, causal=True, rotary=True, selective="qv").double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    full = mha(x)
    tail = mha(x[:, -3:], x, x)
    assert_close(tail, full[:, -3:], n=16 * 9 * 16)  # the same sums over another key layout


def lm(positions="rotary", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        vocab_size=20,
        n_out=20,
        max_len=16,
        d_model=32,
        n_heads=4,
        layers=2,
        positions=positions,
        **kw,
    )
    return Transformer(cfg).double()


def test_rotary_transformer_runs_at_4x_context_and_is_causal():
    model = lm(selective="qv", selective_terms="both")
    assert not hasattr(model, "pos_emb")
    idx = torch.randint(0, 20, (2, 64))  # 4 × max_len: fine with rotary positions
    out = model(idx)
    assert out.shape == (2, 64, 20) and torch.isfinite(out).all()
    idx2 = idx.clone()
    idx2[:, 40:] = (idx2[:, 40:] + 1) % 20
    assert torch.equal(model(idx2)[:, :40], out[:, :40])  # causal: exactly, not approximately
    with pytest.raises(ValueError, match="max_len"):
        lm("learned")(idx)
    with pytest.raises(ValueError, match="positions"):
        TransformerConfig(positions="sinusoidal")
    with pytest.raises(ValueError, match="terms"):
        TransformerConfig(selective="q", selective_terms="tokens")


@pytest.mark.parametrize("targets", ["q", "v", "qv"])
@pytest.mark.parametrize("terms", ["token", "position", "both"])
def test_selective_transformer_is_identity_at_init(targets, terms):
    idx = torch.randint(0, 20, (2, 48))
    vanilla = lm(seed=3)
    base = vanilla(idx)
    sel = lm(seed=3, selective=targets, selective_terms=terms)
    missing, unexpected = sel.load_state_dict(vanilla.state_dict(), strict=False)
    assert not unexpected and missing and all(".selective." in k for k in missing)
    assert sum(p.numel() for n, p in sel.named_parameters() if ".selective." in n) > 0
    # at init τ − 1 = c₀·log n ≈ 5.1e-6·log 48 with position terms (a model difference, not
    # rounding): the logits move by about that much relative; 1e-4 bounds it with room
    rel = ((sel(idx) - base).abs().max() / base.abs().max()).item()
    assert rel < 1e-4, rel


def test_learned_positions_unchanged_by_the_new_options():
    """The default model is the same module tree and the same initial weights as before."""
    model = lm("learned", seed=5)
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert not any("selective" in n for n in names)
    assert not any(m.rotary for m in model.modules() if isinstance(m, MultiheadAttention))


def test_capture_records_the_rotated_scores_and_weights():
    from sharpattn.diagnostics import capture

    model = lm()
    idx = torch.randint(0, 20, (2, 24))
    with capture(model) as cap:
        model(idx)
    mha = model.layers[1].attn
    with torch.no_grad():
        h = model.layers[0](model.tok_emb(idx))
        _, weights = mha(model.layers[1].ln_attn(h), return_weights=True)
    assert torch.equal(cap["layers.1.attn.weights"], weights)  # the same computation, recorded
