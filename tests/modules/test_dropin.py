"""DropInMultiheadAttention is torch.nn.MultiheadAttention with method="softmax" (same state
dict, same outputs, weights and gradients), and swap puts it in place of torch's in any model."""

import pytest
import torch
from torch import nn

import sharpattn
from precision import assert_close
from sharpattn import DropInMultiheadAttention, swap

E, H, B, L, S = 8, 2, 2, 5, 4
NEG = float("-inf")


def _padding(dtype=torch.bool):
    pad = torch.tensor([[False, False, False, False], [False, False, True, True]])
    return pad if dtype == torch.bool else torch.zeros(B, S).masked_fill(pad, NEG).to(dtype)


def _causal(lq, lk):
    return torch.ones(lq, lk, dtype=torch.bool).triu(1)


def _heads_mask():
    g = torch.Generator().manual_seed(3)
    m = torch.rand(B * H, L, S, generator=g) > 0.6
    m[:, :, 0] = False  # every query sees a key (torch gives NaN rows otherwise)
    return m


#: name -> (constructor kwargs, forward kwargs, unbatched, self-attention)
CASES = {
    "seq_first": ({}, {}, False, False),
    "batch_first": ({"batch_first": True}, {}, False, False),
    "unbatched": ({}, {}, True, False),
    "unbatched_batch_first": ({"batch_first": True}, {}, True, False),
    "padding_bool": ({}, {"key_padding_mask": _padding()}, False, False),
    "padding_float": ({"batch_first": True}, {"key_padding_mask": _padding(None)}, False, False),
    "attn_mask_2d": ({}, {"attn_mask": _causal(L, S)}, False, False),
    "attn_mask_3d": ({"batch_first": True}, {"attn_mask": _heads_mask()}, False, False),
    "attn_mask_float": (
        {},
        {"attn_mask": torch.zeros(L, S).masked_fill(_causal(L, S), NEG)},
        False,
        False,
    ),
    "both_masks": ({}, {"attn_mask": _causal(L, S), "key_padding_mask": _padding()}, False, False),
    "is_causal": (
        {"batch_first": True},
        {"attn_mask": _causal(L, L), "is_causal": True, "need_weights": False},
        False,
        True,
    ),
    "weights_per_head": ({}, {"average_attn_weights": False}, False, False),
    "no_weights": ({}, {"need_weights": False}, False, False),
    "kdim_vdim": ({"kdim": 6, "vdim": 3, "batch_first": True}, {}, False, False),
    "no_bias": ({"bias": False}, {"key_padding_mask": _padding()}, False, False),
}


def _inputs(kw, unbatched, self_attention, dtype):
    g = torch.Generator().manual_seed(0)
    kd, vd = kw.get("kdim", E), kw.get("vdim", E)
    lk = L if self_attention else S

    def make(n, d):
        shape = (n, d) if unbatched else (B, n, d) if kw.get("batch_first") else (n, B, d)
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    q = make(L, E)
    if self_attention:
        return q, q, q
    return q, make(lk, kd), make(lk, vd)


def _pair(kw, dtype):
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(E, H, **kw, dtype=dtype)
    ours = DropInMultiheadAttention(E, H, **kw, dtype=dtype)
    ours.load_state_dict(ref.state_dict())  # strict: the same parameter names
    with torch.no_grad():  # nonzero biases, so that they are compared too
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _forward_kwargs(fwd, unbatched, dtype):
    """The case's forward arguments: float masks in ``dtype`` (torch wants the query's), the
    padding mask of one sequence when unbatched."""
    fwd = {
        k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in fwd.items()
    }
    if unbatched and "key_padding_mask" in fwd:
        fwd["key_padding_mask"] = fwd["key_padding_mask"][1]
    return fwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_torch_multihead_attention(case, dtype):
    kw, fwd, unbatched, self_attention = CASES[case]
    fwd = _forward_kwargs(fwd, unbatched, dtype)
    ref, ours = _pair(kw, dtype)
    results = []
    for module in (ref, ours):
        inputs = _inputs(kw, unbatched, self_attention, dtype)
        out, weights = module(*inputs, **fwd)
        loss = out.square().sum() + (0 if weights is None else weights.square().sum())
        params = [p for p in module.parameters()]
        grads = torch.autograd.grad(loss, [*dict.fromkeys(inputs), *params])
        results.append((out, weights, grads))
    (o1, w1, g1), (o2, w2, g2) = results
    assert o2.shape == o1.shape
    assert_close(o2, o1, n=E)
    if fwd.get("need_weights", True):
        assert w2.shape == w1.shape
        assert_close(w2, w1, n=E)
    else:
        assert w1 is None and w2 is None
    assert len(g1) == len(g2)
    for a, b in zip(g2, g1, strict=True):
        assert_close(a, b, n=E * L, ulps=32)  # a chain of reductions: loss, out_proj, attention


def test_state_dict_names_are_torchs():
    for kw in ({}, {"kdim": 6, "vdim": 3}, {"bias": False}):
        ref = nn.MultiheadAttention(E, H, **kw)
        ours = DropInMultiheadAttention(E, H, **kw)
        assert list(ours.state_dict()) == list(ref.state_dict())


def test_dropout_while_training_only():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dropout=0.5)
    ours = DropInMultiheadAttention(E, H, dropout=0.5)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(L, B, E)
    ref.eval(), ours.eval()
    assert_close(ours(x, x, x)[0], ref(x, x, x)[0], n=E)
    ours.train()
    _, w = ours(x, x, x, average_attn_weights=False)
    assert (w == 0).any()  # dropped weights, the others scaled by 2
    ours(x, x, x, need_weights=False)[0].sum().backward()


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.ModuleDict({"attn": nn.MultiheadAttention(E, H, kdim=6, vdim=6)})
        self.same = self.inner["attn"]  # one module at two places
        self.head = nn.Linear(E, 1)

    def forward(self, x, y):
        return self.head(self.inner["attn"](x, y, y)[0] + self.same(x, y, y, need_weights=False)[0])


@pytest.mark.parametrize("grad", [False, True], ids=["eval_no_grad", "eval_grad"])
def test_swap_transformer_encoder(grad):
    """In eval mode without gradients torch's encoder takes fused and nested-tensor paths; after
    swap it calls the drop-in. Padding positions: torch's nested path returns 0 there, its other
    path and the drop-in a value nothing reads, so only real tokens are compared."""
    model = _encoder().eval()
    x = torch.randn(B, L, E)
    pad = torch.tensor([[False] * L, [False] * 3 + [True] * 2])
    causal = _causal(L, L)
    with torch.set_grad_enabled(grad):
        before = model(x, mask=causal, src_key_padding_mask=pad)
        assert swap(model, "softmax") is model
        after = model(x, mask=causal, src_key_padding_mask=pad)
    assert all(isinstance(layer.self_attn, DropInMultiheadAttention) for layer in model.layers)
    assert_close(after[~pad], before[~pad], n=E * L)
    swap_again = _encoder()
    swap(swap_again, "sigmoid").train()
    out = swap_again(x, src_key_padding_mask=pad)
    out.square().sum().backward()
    assert swap_again.layers[0].self_attn.in_proj_weight.grad is not None


def test_swap_custom_module_keeps_weights_device_dtype():
    model = Holder().double()
    x, y = torch.randn(L, B, E, dtype=torch.float64), torch.randn(S, B, 6, dtype=torch.float64)
    before = model(x, y)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    swap(model, "softmax")
    assert isinstance(model.inner["attn"], DropInMultiheadAttention)
    assert model.same is model.inner["attn"]
    assert model.inner["attn"].in_proj_weight is None
    assert model.inner["attn"].q_proj_weight.dtype == torch.float64
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
    assert_close(model(x, y), before, n=E * L)
    model = swap(Holder(), "adaptive")
    x, y = x.float(), y.float()
    model(x, y).sum().backward()
    assert model.inner["attn"].k_proj_weight.grad is not None


def test_swap_learnable_parameters_start_per_head():
    model = swap(Holder(), "ssmax", s=0.3)
    s = model.inner["attn"].normalizer_params["s"]
    assert s.shape == (H,) and torch.all(s == 0.3)


def _one_sentence(err):
    text = str(err.value)
    assert text.endswith(".") and text.count(". ") == 0, text
    return text


def test_refusals_are_one_sentence():
    with pytest.raises(ValueError) as err:
        DropInMultiheadAttention(E, H, add_bias_kv=True)
    assert "add_bias_kv" in _one_sentence(err)
    with pytest.raises(ValueError) as err:
        DropInMultiheadAttention(E, H, add_zero_attn=True)
    assert "add_zero_attn" in _one_sentence(err)
    model = nn.Sequential(nn.Linear(E, E), nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(ValueError) as err:
        swap(model, "softmax")
    assert "'1'" in _one_sentence(err) and isinstance(model[1], nn.MultiheadAttention)
    with pytest.raises(ValueError) as err:
        swap(nn.Linear(2, 2), "softmax")
    _one_sentence(err)
    ours = DropInMultiheadAttention(E, H)
    x = torch.randn(L, B, E)
    with pytest.raises(ValueError) as err:
        ours(x, x, x, attn_mask=torch.full((L, L), 0.5))
    assert "0 and -inf" in _one_sentence(err)
    with pytest.raises(ValueError) as err:
        ours(x, x, x, is_causal=True)
    _one_sentence(err)
    with pytest.raises(ValueError) as err:
        ours(x, x, x, key_padding_mask=torch.zeros(B, L + 1, dtype=torch.bool))
    _one_sentence(err)


def test_swap_of_a_bare_module_returns_its_drop_in():
    mha = nn.MultiheadAttention(E, H)
    new = sharpattn.swap(mha, "softmax")
    assert isinstance(new, DropInMultiheadAttention)
    x = torch.randn(L, B, E)
    assert_close(new(x, x, x)[0], mha(x, x, x)[0], n=E)
