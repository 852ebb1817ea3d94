"""The tiny pre-LN transformer: shapes, causality, captured internals, interventions."""

import numpy as np
import pytest
import torch

from precision import assert_close
from reference import transformer_internals
from sharpattn import MultiheadAttention
from sharpattn.diagnostics import capture
from sharpattn.models.transformer import Transformer, TransformerConfig, layers_name, parse_layers

pytestmark = pytest.mark.numerical


def model(layers="tf", method="softmax", d=32, heads=1, seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(
        TransformerConfig(d_model=d, n_heads=heads, layers=layers, method=method, max_len=24, **kw)
    ).double()


def tokens(b=3, t=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (b, t), generator=g)
    x[:, 0] = 64
    return x


def test_parse_layers():
    assert parse_layers(3) == ("tf", "tf", "tf")
    assert parse_layers("2") == ("tf", "tf")
    assert parse_layers("attn+mlp+attn+mlp+mlp") == ("tf", "tf", "mlp")
    assert parse_layers("tf,tf,mlp") == ("tf", "tf", "mlp")
    assert parse_layers("mlp+attn") == ("mlp", "attn")
    assert layers_name(("tf", "tf", "mlp")) == "attn+mlp+attn+mlp+mlp"
    for bad in ("", "conv", 0, "attn+conv"):
        with pytest.raises(ValueError, match="layers"):
            parse_layers(bad)


@pytest.mark.parametrize("layers", ["tf", "tf,tf", "tf,tf,tf", "attn+mlp+attn+mlp+mlp"])
@pytest.mark.parametrize("method", ["softmax", "relu"])
def test_shapes_and_causality(layers, method):
    m = model(layers, method)
    x = tokens()
    logits = m(x)
    assert logits.shape == (3, 20, 64)
    y = x.clone()
    y[:, 12] = (y[:, 12] + 1) % 64  # change one token: no earlier position may notice
    after = m(y)
    assert torch.equal(logits[:, :12], after[:, :12])
    assert not torch.allclose(logits[:, 12:], after[:, 12:])


def test_parameter_count_and_no_biases():
    m = model("tf", d=256)
    att = m.layers[0].attn
    assert isinstance(att, MultiheadAttention) and att.causal and att.method == "softmax"
    names = [n for n, _ in m.named_parameters()]
    assert not any(n.endswith("bias") and "ln" not in n for n in names)  # only LayerNorm biases
    d = 256
    linear = 4 * d * d + 2 * 4 * d * d  # q, k, v, o and the 4d MLP
    emb = 65 * d + 24 * d + 64 * d  # tokens, positions, untied output
    ln = 3 * 2 * d
    assert sum(p.numel() for p in m.parameters()) == linear + emb + ln


@pytest.mark.parametrize("method", ["softmax", "relu"])
@pytest.mark.parametrize(("layers", "heads"), [("attn", 1), ("mlp,tf,mlp", 2), ("tf,tf", 2)])
def test_capture_equals_a_direct_computation(method, layers, heads):
    """diagnostics.capture on the tiny transformer: scores, weights, value-state norms
    ‖O_h·V_h·LN(h)_j‖ and every layer's residual (MLP-only layers too, named by their index in
    model.layers) equal a float64 NumPy computation from the weights; capture changes nothing."""
    m = model(layers, method, heads=heads)
    x = tokens()
    plain = m(x)
    with capture(m) as cap:
        logits = m(x)
    assert torch.equal(logits, plain)  # capture changes nothing
    ref, h_last = transformer_internals(m, x)
    names = {f"layers.{i}.resid_post" for i in ref}
    names |= {f"layers.{i}.attn.{n}" for i, r in ref.items() for n in r if n != "resid_post"}
    assert set(cap.names()) == names
    for i, rec in ref.items():
        for n, want in rec.items():
            key = f"layers.{i}.{n}" if n == "resid_post" else f"layers.{i}.attn.{n}"
            got = cap[key].numpy()
            if n == "values":
                want = np.linalg.norm(want, axis=-1)  # (B, H, T)
            if n == "scores":
                assert np.array_equal(np.isinf(got), np.isinf(want))
                got, want = np.where(np.isinf(got), 0, got), np.where(np.isinf(want), 0, want)
            # a float64 model through up to 3 layers of width 32 (MLP 4·32) against NumPy: chained
            # reductions of at most 32·128 terms; capture computes value norms in float32
            dtype = torch.float32 if n == "values" else torch.float64
            mag = 1.0 if n == "weights" else None
            assert_close(got, want, dtype=dtype, n=32 * 128, magnitude=mag, msg=key)
    assert_close(cap[f"layers.{len(ref) - 1}.resid_post"], h_last, n=32 * 128)
    assert not any(mod._forward_hooks for mod in m.modules())  # hooks removed


def test_zeroing_sublayers():
    m = model("tf,tf")
    x = tokens()
    assert m.sublayers == ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]
    everything = m(x, zero=m.sublayers)
    emb = m.tok_emb(x) + m.pos_emb(torch.arange(20))
    assert_close(everything, m.head(m.ln_f(emb)), n=32)  # same ops, maybe another kernel
    one = m(x, zero=["layers.0.attn"])
    lay = m.layers[0]
    h = emb + lay.mlp(lay.ln_mlp(emb))
    assert_close(one, m.head(m.ln_f(m.layers[1](h))), n=32 * 128)
    with pytest.raises(ValueError, match="cannot zero layers.2.mlp"):
        m(x, zero=["layers.2.mlp"])


def test_errors():
    with pytest.raises(ValueError, match="unknown attention method"):
        TransformerConfig(method="nope")
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(d_model=30, n_heads=4)
    m = model()
    with pytest.raises(ValueError, match="exceeds max_len"):
        m(tokens(t=30))
    with pytest.raises(ValueError, match="long tensor"):
        m(tokens().float())
