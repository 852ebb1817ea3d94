"""Diagnostics: metrics against independent NumPy float64 computations; capture on sharpattn and
Hugging Face models."""

import importlib
import math
import os

import numpy as np
import pytest
import torch
from torch import nn

from precision import assert_close
from sharpattn import MultiheadAttention
from sharpattn import normalizers as nz
from sharpattn.diagnostics import (
    attention_on,
    capture,
    classify_heads,
    delta_logit,
    dispersion_horizon,
    head_ablation,
    head_logit_spread,
    logit_spread,
    residual_peak,
    sink_logit_stats,
    sink_mass,
    sink_tokens,
    value_drain,
    weight_stats,
)

pytestmark = pytest.mark.numerical


def _np_spread(s, allowed):
    out = np.full(s.shape[:-1], np.nan)
    for idx in np.ndindex(*s.shape[:-1]):
        row = s[idx][allowed[idx]]
        if row.size:
            out[idx] = row.max() - row.min()
    return out


def test_logit_spread_matches_numpy_with_masks_empty_rows_and_huge_logits():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64) * 3
    s[0, 0, 0, 2] = 1e4
    s[0, 0, 0, 5] = -1e4
    s[1, 2, 3, 1] = float("-inf")  # -inf counts as masked
    mask = torch.rand(2, 3, 5, 7, generator=g) > 0.3
    mask[1, 1, 4] = False  # an empty row
    mask[0, 0, 0, [2, 5]] = True
    allowed = (mask & (s != float("-inf"))).numpy()
    ref = _np_spread(s.numpy(), allowed)
    got = logit_spread(s, mask).numpy()
    # a max minus a min: exact up to one rounding of the difference
    assert_close(got, ref, equal_nan=True)
    assert np.isnan(got[1, 1, 4]) and got[0, 0, 0] == s[0, 0, 0, 2].item() - s[0, 0, 0, 5].item()
    # single allowed key: spread 0
    one = torch.zeros(1, 4, dtype=torch.bool)
    one[0, 2] = True
    assert logit_spread(torch.randn(1, 4), one).item() == 0.0
    # per head: the largest row spread, NaN rows ignored
    head = head_logit_spread(s, mask).numpy()
    assert_close(head, np.nanmax(ref, axis=-1))
    # bf16 scores work (computed in float64)
    sb = s.to(torch.bfloat16).masked_fill(~mask, float("-inf"))
    ref_b = _np_spread(sb.double().numpy(), (sb != float("-inf")).numpy())
    assert_close(logit_spread(sb).numpy(), ref_b, equal_nan=True)


def test_dispersion_horizon_and_lemma_2_1():
    delta = np.array([0.0, 2.28, 5.69, 14.78])
    got = dispersion_horizon(torch.tensor(delta), theta=0.5, eps=0.05).numpy()
    assert_close(got, np.exp(delta / 0.5) / 0.05)
    # Lemma 2.1: n > n* items with logits in [0, δ] -> every softmax weight < ε
    g = torch.Generator().manual_seed(1)
    d, eps = 2.0, 0.02
    n = int(dispersion_horizon(d, eps=eps)) + 1
    logits = torch.rand(64, n, generator=g, dtype=torch.float64) * d
    logits[:, 0] = d  # the winner at the top of the range, the rest at the bottom
    logits[:, 1:] = 0.0
    assert nz.softmax(logits).max() < eps
    # and below the horizon the bound is attainable: the same pattern exceeds ε
    small = torch.zeros(1, n // 4, dtype=torch.float64)
    small[0, 0] = d
    assert nz.softmax(small).max() > eps
    with pytest.raises(ValueError):
        dispersion_horizon(1.0, eps=0.0)


def _np_sink_mass(a):
    n = a.shape[-1]
    out = np.zeros(a.shape[:-2] + (n,))
    for idx in np.ndindex(*a.shape[:-2]):
        for j in range(n):
            out[idx + (j,)] = np.mean([a[idx + (i, j)] for i in range(j, n)])
    return out


def _sink_pattern(n=8, heads=3):
    """Causal attention: 0.7 on token 0, 0.2 on token 3 (once visible), the rest uniform."""
    a = np.zeros((heads, n, n))
    for i in range(n):
        a[:, i, 0] = 0.7 if i >= 3 else 0.9
        if i >= 3:
            a[:, i, 3] = 0.2
        rest = [j for j in range(1, i + 1) if j != 3]
        left = 1 - a[:, i].sum(-1)
        for j in rest:
            a[:, i, j] += left / len(rest)
        if not rest:
            a[:, i, 0] += left
    return a


def test_sink_mass_and_sink_tokens_on_a_known_sink():
    a = _sink_pattern()
    assert_close(a.sum(-1), np.ones(a.shape[:-1]), n=a.shape[-1])
    got = sink_mass(torch.tensor(a))
    assert_close(got.numpy(), _np_sink_mass(a), n=a.shape[-2])  # a mean over queries
    assert sink_tokens(got).tolist() == [[0, 3]] * 3
    # random (non-causal) weights too
    w = torch.softmax(torch.randn(2, 4, 6, 6, dtype=torch.float64), -1)
    assert_close(sink_mass(w).numpy(), _np_sink_mass(w.numpy()), n=w.shape[-2])
    assert_close(sink_mass(w, queries="all").numpy(), w.numpy().mean(-2), n=w.shape[-2])
    with pytest.raises(ValueError, match="square"):
        sink_mass(torch.rand(2, 3))
    with pytest.raises(ValueError, match="queries"):
        sink_mass(w, queries="some")


def test_value_drain_and_residual_peak_match_numpy():
    g = torch.Generator().manual_seed(2)
    values = torch.rand(2, 4, 9, generator=g, dtype=torch.float64) + 0.5
    sink = torch.randint(0, 9, (2, 4), generator=g)
    got = value_drain(values, sink).numpy()
    v = values.numpy()
    for b in range(2):
        for h in range(4):
            j = int(sink[b, h])
            ref = v[b, h, j] / np.mean(np.delete(v[b, h], j))
            assert_close(got[b, h], ref, n=v.shape[-1])  # a mean over the other tokens
    resid = torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    resid[:, 0] *= 50  # a residual-state peak at token 0
    peak = residual_peak(resid, 0).numpy()
    r = np.linalg.norm(resid.numpy(), axis=-1)
    assert_close(peak, r[:, 0] / r[:, 1:].mean(-1), n=resid.shape[-1] * resid.shape[-2])
    assert (peak > 10).all()


def test_weight_stats_reuses_normalizer_stats():
    w = torch.softmax(torch.randn(3, 5, 7, dtype=torch.float64), -1)
    st = weight_stats(w)
    p = w.numpy()
    n = p.shape[-1]
    # terms -p log p are at most 1/e each, so magnitude log n bounds the sum's absolute error
    assert_close(st["entropy"].numpy(), -(p * np.log(p)).sum(-1), n=n, magnitude=math.log(n))
    assert np.array_equal(st["max_weight"].numpy(), p.max(-1))  # a max is exact
    assert_close(st["support"].numpy(), 1 / (p**2).sum(-1), n=n)


class Tiny(nn.Module):
    """Two pre-LN blocks of sharpattn MultiheadAttention in a ModuleList."""

    def __init__(self, d=16, heads=4, method="softmax", **params):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln": nn.LayerNorm(d),
                    "attn": MultiheadAttention(d, heads, method, causal=True, **params),
                }
            )
            for _ in range(2)
        )
        for b in self.blocks:
            b.forward = self._block(b)

    @staticmethod
    def _block(b):
        return lambda x: x + b["attn"](b["ln"](x))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _np_mha(mha, x, zero_head=None):
    """Causal softmax attention of a sharpattn MultiheadAttention in NumPy float64."""
    W = {
        n: getattr(mha, n).weight.detach().double().numpy()
        for n in ("q_proj", "k_proj", "v_proj", "out_proj")
    }
    B = {n: getattr(mha, n).bias.detach().double().numpy() for n in W}
    x = x.detach().double().numpy()
    b, n, _ = x.shape
    h, hd = mha.num_heads, mha.head_dim
    q, k, v = (
        (x @ W[p].T + B[p]).reshape(b, n, h, hd).transpose(0, 2, 1, 3)
        for p in ("q_proj", "k_proj", "v_proj")
    )
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = w @ v  # (b, h, n, hd)
    if zero_head is not None:
        o[:, zero_head] = 0
    vals = np.stack(
        [
            np.linalg.norm(v[:, i] @ W["out_proj"][:, i * hd : (i + 1) * hd].T, axis=-1)
            for i in range(h)
        ],
        1,
    )
    out = o.transpose(0, 2, 1, 3).reshape(b, n, h * hd) @ W["out_proj"].T + B["out_proj"]
    return s, w, vals, out


def test_capture_sharpattn_model_matches_numpy_and_removes_hooks():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 6, 16)
    with capture(model) as cap:
        y = model(x)
    assert cap.names() == sorted(
        f"layers.{L}.{q}"
        for L in (0, 1)
        for q in ("attn.scores", "attn.weights", "attn.values", "resid_post")
    )
    h0 = model.blocks[0]["ln"](x)
    s, w, vals, out = _np_mha(model.blocks[0]["attn"], h0)
    # float32 model against float64 NumPy: every quantity is a chain of two reductions over the
    # width d (a projection, then a dot product / the attention sum and the output projection), so
    # the reduction length is d·n_keys at most and the terms are of the size of the result.
    d, n = 16, 6
    assert_close(cap["layers.0.attn.scores"], s, dtype=torch.float32, n=d)
    assert_close(cap["layers.0.attn.weights"], w, dtype=torch.float32, n=d, magnitude=1.0)
    assert_close(cap["layers.0.attn.values"], vals, dtype=torch.float32, n=d)
    assert_close(cap["layers.0.resid_post"], x.double().numpy() + out, n=d * n)
    assert torch.equal(cap["layers.1.resid_post"], y)  # the same tensor the model returned
    assert cap.values_projected == {0: True, 1: True}
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    # removed on error too
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model):
            raise RuntimeError("boom")
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_head_ablation_matches_numpy():
    torch.manual_seed(1)
    model = Tiny(d=8, heads=2)
    model.blocks = model.blocks[:1]
    xs = [torch.randn(1, 5, 8) for _ in range(2)]
    target = torch.randn(1, 5, 8)

    def loss_fn(m, x):
        return (m(x) - target).pow(2).mean()

    got = head_ablation(model, loss_fn, {"a": xs}, heads=[(0, 0), (0, 1)])
    mha, ln = model.blocks[0]["attn"], model.blocks[0]["ln"]
    for head in (0, 1):
        deltas = []
        for x in xs:
            base = x.double().numpy() + _np_mha(mha, ln(x))[3]
            cut = x.double().numpy() + _np_mha(mha, ln(x), zero_head=head)[3]
            t = target.double().numpy()
            deltas.append(((cut - t) ** 2).mean() - ((base - t) ** 2).mean())
        # a difference of two float32 mean-squared losses: its error is that of the losses
        # (reductions over 5·8 outputs of width-8 chains), not of the small difference
        loss = float(((_np_mha(mha, ln(xs[0]))[3] + xs[0].double().numpy() - t) ** 2).mean())
        assert_close(
            got["a"][(0, head)], np.mean(deltas), dtype=torch.float32, n=5 * 8 * 8, magnitude=loss
        )
    assert classify_heads({(0, 0): 0.5, (0, 1): 0.01}, 0.1) == {(0, 0): "active", (0, 1): "dormant"}
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_capture_learnable_normalizer_params_reach_weights(gain_normalizer):
    torch.manual_seed(2)
    mha = MultiheadAttention(8, 2, gain_normalizer, gain=3.0)
    x = torch.randn(1, 4, 8)
    with capture(mha) as cap:
        mha(x)
    _, ref = mha(x, return_weights=True)
    assert torch.equal(cap["layers.0.attn.weights"], ref.detach())  # one computation, observed


@pytest.mark.parametrize("targets", ["q", "v", "qv", "kqv"])
@pytest.mark.parametrize("sharing", [False, True])
def test_capture_selective_module_sees_the_temperatures(targets, sharing):
    # The captured weights are the ones the module computes: attend() itself is observed, after
    # the selective temperatures scaled q, k, v. (Capture used to re-run the projections without
    # the temperatures: on selective="qv" with non-zero temperatures its weights were off by up
    # to 0.163.)
    torch.manual_seed(3)
    mha = MultiheadAttention(16, 2, selective=targets, sharing=sharing, causal=True)
    with torch.no_grad():
        for p in mha.selective.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        _, ref = mha(x, return_weights=True)
        out = mha(x)
        with capture(mha) as cap:
            got_out = mha(x)
    assert torch.equal(cap["layers.0.attn.weights"], ref)  # one computation, observed
    assert torch.equal(got_out, out)  # observing changes nothing
    # ablation goes through the same point: zeroing head 1 leaves head 0's output untouched
    with torch.no_grad(), capture(mha, ablate={(0, 1)}):
        cut = mha(x)
    assert not torch.equal(cut, out)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
import sharpattn.hf  # noqa: E402, F401  (lets capture record Hugging Face models)


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    m.set_attn_implementation("eager")
    return m


def test_capture_hf_matches_eager_attentions_and_restores():
    model = _gpt2()
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_attentions=True, output_hidden_states=True)
        with capture(model) as cap:
            assert model.config._attn_implementation == "sharpattn:softmax"
            out = model(ids)
    assert model.config._attn_implementation == "eager"
    # two float32 paths (sharpattn's attention vs eager) through 2 layers of width 32: each output
    # is a chain of reductions over the width (and the 4·32 MLP), of terms the size of the result
    assert_close(out.logits, ref.logits, n=4 * 32, magnitude=float(ref.logits.abs().max()))
    for L in (0, 1):
        assert_close(cap[f"layers.{L}.attn.weights"], ref.attentions[L], n=32, magnitude=1.0)
    assert_close(cap["layers.0.resid_post"], ref.hidden_states[1], n=4 * 32)
    # value norms: ‖c_proj_h · v_h‖ from GPT-2's fused qkv
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        hidden = model.transformer.h[0].ln_1(
            model.transformer.wte(ids) + model.transformer.wpe(torch.arange(10))
        )
        v = attn.c_attn(hidden)[..., 64:].view(1, 10, 4, 8).transpose(1, 2)
        o = attn.c_proj.weight.t().view(32, 4, 8)
        ref_vals = torch.einsum("bhjd,mhd->bhjm", v, o).norm(dim=-1)
    assert_close(cap["layers.0.attn.values"], ref_vals, n=32)  # a norm of a width-8 product
    # softmax weights -> spread: every head's δ is finite and positive
    assert (head_logit_spread(cap["layers.1.attn.scores"]) > 0).all()


def test_capture_hf_grouped_query_attention():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_attentions=True)
        with capture(model) as cap:
            model(ids, attention_mask=mask)
    for L in (0, 1):
        w = cap[f"layers.{L}.attn.weights"]
        assert w.shape == (2, 4, 7, 7) and (w[1, :, :, :2] == 0).all()
        # two float32 paths; scores are width-8 dot products of width-32 projections
        assert_close(w[0], ref.attentions[L][0], n=32, magnitude=1.0)
        assert_close(w[1, :, 2:], ref.attentions[L][1, :, 2:], n=32, magnitude=1.0)
    assert cap["layers.0.attn.values"].shape == (2, 4, 7)


def test_capture_long_inputs_record_attends_row_stats():
    """Beyond ``full_until`` keys: no score or weight matrix, only what
    ``attend(return_stats=True)`` gives per row, equal to the statistics of the full weights."""
    model = _gpt2()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with capture(model) as full:
            model(ids)
        with capture(model, full_until=16, query_block=7) as short:
            model(ids)
    w = full["layers.1.attn.weights"]
    n = ids.shape[1]
    assert "layers.0.attn.weights" not in short and "layers.0.attn.scores" not in short
    assert set(short.names()) >= {f"layers.1.attn.{s}" for s in ("entropy", "mass", "visible")}
    for gone in ("max_weight", "support", "spread", "sink_mass"):  # need the weight matrix
        assert f"layers.1.attn.{gone}" not in short
    # the same float32 attention computed two ways: sums over the 40 keys of float32 weights
    # (entropy: terms ≤ 1/e, magnitude log n)
    assert_close(
        short["layers.1.attn.entropy"],
        weight_stats(w)["entropy"],
        dtype=torch.float32,
        n=n,
        magnitude=math.log(n),
    )
    assert_close(short["layers.1.attn.mass"], w.sum(-1), dtype=torch.float32, n=n)
    assert short["layers.1.attn.visible"][0, 0].tolist() == list(range(1, n + 1))
    assert torch.equal(short["layers.0.attn.values"], full["layers.0.attn.values"])


def test_capture_of_a_model_no_integration_knows_says_what_to_import(monkeypatch):
    """Capture imports no integration: a Hugging Face model is captured through the model kind
    ``sharpattn.hf`` adds when imported, and without it capture says to import it."""
    capture_module = importlib.import_module("sharpattn.diagnostics.capture")
    monkeypatch.setattr(capture_module, "_KINDS", [])
    model = _gpt2()
    with pytest.raises(ValueError, match=r"import sharpattn\.hf first") as info:
        capture(model).__enter__()
    assert "\n" not in str(info.value)
    assert model.config._attn_implementation == "eager"  # nothing left switched


# --- the sink's logit and weight (Guo et al.) ----------------------------------------------


def test_sink_measures_by_hand():
    # one batch, one head, T = 3: query 2 sees keys 0, 1, 2
    s = torch.tensor([[[[0.0, 0, 0], [5.0, 1.0, 0], [4.0, 2.0, 0.0]]]])
    query = torch.tensor([[False, True, True]])
    # Δlogit: query 1: 5 − 1 = 4; query 2: 4 − (2 + 0)/2 = 3  →  3.5
    assert_close(delta_logit(s, query), 3.5, dtype=torch.float32, n=3)
    w = torch.tensor([[[[1.0, 0, 0], [0.7, 0.3, 0], [0.2, 0.5, 0.3]]]])
    assert_close(attention_on(w, query), (0.7 + 0.2) / 2, dtype=torch.float32, n=2)
    assert_close(
        attention_on(w, torch.tensor([[False, False, True]]), offset=1), 0.5, dtype=torch.float32
    )
    assert_close(attention_on(w, query, offset=1), (0.7 + 0.5) / 2, dtype=torch.float32, n=2)
    # capture stores the scores of keys after the query as -inf: same Δlogit
    masked = s.masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), -math.inf)
    assert_close(delta_logit(masked, query), 3.5, dtype=torch.float32, n=3)


def test_sink_logit_stats_by_hand():
    # one sequence, T = 4; queries 1, 2, 3 all selected; tokens 7, 9, 7 at positions 1..3
    s = torch.tensor([[[0.0, 0, 0, 0], [3.0, 1.0, 0, 0], [5.0, 1.0, 3.0, 0], [4.0, 0.0, 2.0, 1.0]]])
    tokens = torch.tensor([[64, 7, 9, 7]])
    q = torch.tensor([[True, True, True, True]])  # position 0 is dropped whatever it says
    # token 7: BOS logits 3, 4 → 3.5; Δ: 3 − 1 = 2, 4 − 1 = 3 → 2.5. token 9: BOS 5, Δ 5 − 2 = 3
    c = sink_logit_stats(s, tokens, q)
    assert c["tokens"] == 2
    assert_close(c["bos_logit_mean"], 4.25, dtype=torch.float64, n=4)
    assert_close(c["bos_logit_std"], 0.75, dtype=torch.float64, n=4)
    assert_close(c["delta_mean"], 2.75, dtype=torch.float64, n=4)
    assert_close(c["rel_spread"], 0.75 / 2.75, dtype=torch.float64, n=4)
    # keys after the query stored as -inf (as capture does) change nothing
    masked = s.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), -np.inf)
    assert sink_logit_stats(masked, tokens, q) == c
