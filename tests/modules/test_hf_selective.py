"""sharpattn.hf.apply(model, "selective", ...) on tiny randomly initialised models (no downloads)."""

import inspect
import logging
import os

import numpy as np
import pytest
import torch
from scipy.special import erf
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import sharpattn  # noqa: E402
from precision import assert_close  # noqa: E402
from sharpattn.attention.selective import (  # noqa: E402
    SelectiveConfig,
    Temperature,
    selective_parameter_count,
)
from tiny_hf import gpt2 as _gpt2  # noqa: E402
from tiny_hf import llama as _llama  # noqa: E402
from tiny_hf import neox as _neox  # noqa: E402

hf = sharpattn.hf


BUILDERS = {"llama": _llama, "gpt2": _gpt2, "neox": _neox}
OPTIONS = [(t, s) for s in (False, True) for t in ("q", "v", "qv", "kqv")]

pytestmark = pytest.mark.numerical


def close_logits(got, ref, dtype=torch.float32):
    """Logits of the tiny models (width 32, MLP 64, 2 layers) computed two ways: chains of
    reductions no longer than 32·64 terms, each of the size of the logits."""
    assert_close(got, ref, dtype=dtype, n=32 * 64, magnitude=float(ref.float().abs().max()))


def _model(kind):
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    model.set_attn_implementation("eager")
    return model.eval()


def _inputs(batch=2, length=9):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second row
    return ids, mask


def _randomise(model, seed=3):
    """Temperatures far from 1, so that a test of them can fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.learnable_parameters(model):
            if name.endswith("beta"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 - 0.5)  # c ≈ 0.2 … 0.3
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


# ---------------------------------------------------------------- the formula, against NumPy


def _gelu(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _np_tau(temp: Temperature, n, x=None, proj=None):
    """τ = 1 + c·log n + tanh(f) in float64; n [B, L] (or broadcastable), returns [B, heads, L]."""
    c = np.exp(-np.exp(temp.beta.detach().double().numpy()))  # [heads]
    tau = 1 + c[None, :, None] * np.log(np.maximum(n, 1))[:, None, :]
    if temp.token == "mlp":
        w1, b1 = temp.fc1.weight.detach().double().numpy(), temp.fc1.bias.detach().double().numpy()
        w2, b2 = temp.fc2.weight.detach().double().numpy(), temp.fc2.bias.detach().double().numpy()
        f = _gelu(x @ w1.T + b1) @ w2.T + b2  # [B, L, heads]
        tau = tau + np.tanh(f).transpose(0, 2, 1)
    else:
        w = temp.w.detach().double().numpy()  # [heads, hd]
        tau = tau + np.tanh(np.einsum("bhld,hd->bhl", _gelu(proj), w))
    return tau


def _np_attention(q, k, v, allowed, scale):
    """softmax(q·kᵀ·scale) over allowed keys, GQA by repeating kv heads; [B, H, Lq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
    z = e.sum(-1, keepdims=True)
    p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    return p @ v


@pytest.mark.parametrize(
    "targets,sharing,lq",
    [("kqv", True, 3), ("kqv", False, 7), ("q", False, 3), ("qv", True, 7)],
)
def test_attention_function_matches_numpy(targets, sharing, lq):
    """The HF attention function with temperatures vs a float64 NumPy computation: GQA (4 query,
    2 kv heads), left padding, a cache (Lq = 3 < Lk = 7 keys) where the form allows it."""
    torch.manual_seed(0)
    b, h, hkv, d, lk, dm = 2, 4, 2, 8, 7, 16
    cfg = SelectiveConfig(targets=targets, sharing=sharing)
    module = nn.Module()
    temps = nn.ModuleDict(
        {t: Temperature(dm, h if t == "q" else hkv, d, cfg) for t in "kqv" if t in targets}
    )
    setattr(module, hf.SELECTIVE_ATTR, temps)
    module.is_causal = True
    with torch.no_grad():
        for name, p in temps.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if name.endswith("beta") else 0.7) - 0.3)
    x = torch.randn(b, lq, dm)  # the layer input of the queries (= all tokens without a cache)
    setattr(module, hf._X_ATTR, x)
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)
    real = torch.ones(b, lk, dtype=torch.bool)
    real[1, :2] = False  # left padding
    i = torch.arange(lq)[:, None] + (lk - lq)
    allowed = (torch.arange(lk)[None, :] <= i)[None, None] & real[:, None, None, :]
    out, _ = hf._make_attention("softmax")(module, q, k, v, allowed, scaling=0.3)

    qn, kn, vn = (t.double().numpy() for t in (q, k, v))
    al = allowed.numpy()
    n_q = al[:, 0].sum(-1)  # [B, Lq]: keys each query may see
    n_k = np.cumsum(al[:, 0].any(-2), -1)  # [B, Lk]: position among visible keys
    xn = x.double().numpy()
    if "q" in targets:
        qn = qn * _np_tau(temps["q"], n_q, x=xn, proj=qn)[..., None]
    if "k" in targets:
        kn = kn * _np_tau(temps["k"], n_k, x=xn, proj=kn)[..., None]
    if "v" in targets:
        vn = vn * _np_tau(temps["v"], n_k, x=xn, proj=vn)[..., None]
    ref = _np_attention(qn, kn, vn, al, 0.3).transpose(0, 2, 1, 3)  # (B, Lq, H, D)
    # float32 temperatures (an MLP of width dm) scale q/k/v; their relative error moves a logit
    # by ε·|s|, a weight by that times the weight; the output sums lk values of size max|v|
    smax = np.abs(qn).max() * np.abs(kn).max() * d * 0.3
    assert_close(
        out, ref, dtype=torch.float32, n=dm * d * lk, magnitude=np.abs(vn).max() * (1 + smax)
    )
    # and the temperatures matter here (so this test can fail)
    plain = _np_attention(*(t.double().numpy() for t in (q, k, v)), al, 0.3).transpose(0, 2, 1, 3)
    assert np.abs(plain - ref).max() > 1e-2


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("targets,sharing", OPTIONS)
def test_identity_at_initialisation(kind, targets, sharing):
    ids, mask = _inputs()
    model = _model(kind)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        hf.apply(model, "selective", targets=targets, sharing=sharing)
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    rel = (got[real] - ref[real]).abs().max() / ref[real].abs().max()
    assert rel < 1e-3, rel  # τ = 1 + 5.1e-6·log n here: measured about 1e-6
    assert model.config._attn_implementation == "sharpattn:softmax"
    assert model.config.sharpattn["selective"]["targets"] == targets


@pytest.mark.parametrize("sharing", [False, True])
def test_bfloat16_model(sharing):
    """A bf16 model keeps float32 temperatures; at init it computes what sharpattn:softmax does."""
    ids, mask = _inputs()
    model = _model("llama").to(torch.bfloat16)
    with torch.no_grad():
        ref = hf.apply(model, "softmax")(input_ids=ids, attention_mask=mask).logits
        hf.apply(model, "selective", targets="kqv", sharing=sharing)
        assert all(p.dtype == torch.float32 for _, p in hf.learnable_parameters(model))
        got = model(input_ids=ids, attention_mask=mask).logits
        _randomise(model)
        moved = model(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16 and torch.isfinite(moved).all()
    real = mask.bool()
    # at init τ − 1 ≈ 5.1e-6·log n is far below bf16's ε: the same computation up to rounding
    close_logits(got[real], ref[real], dtype=torch.bfloat16)
    assert (moved[real].float() - ref[real].float()).abs().max() > 1e-2


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_token_only_terms_are_exactly_the_identity(kind):
    ids, mask = _inputs()
    model = _model(kind)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        hf.apply(model, "selective", targets="kqv", terms="token")
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    close_logits(got[real], ref[real])


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("sharing", [False, True])
def test_gradients_reach_the_temperatures_and_training_moves_them(kind, sharing):
    ids, mask = _inputs()
    model = hf.apply(_model(kind), "selective", targets="qv", sharing=sharing)
    params = dict(hf.learnable_parameters(model))
    layers = model.config.num_hidden_layers
    per_target = 2 if sharing else 5  # w, beta | fc1.weight, fc1.bias, fc2.weight, fc2.bias, beta
    assert len(params) == layers * 2 * per_target
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if ".fc1." not in name:  # fc1 gets gradient once fc2 is non-zero (module docstring)
            assert p.grad.abs().max() > 0, name
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        opt.step()
    for name, p in params.items():
        assert not torch.equal(p, before[name]), name


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("targets,sharing", [("kqv", False), ("qv", True)])
def test_save_and_load_round_trip(kind, targets, sharing, tmp_path):
    ids, mask = _inputs()
    model = hf.apply(_model(kind), "selective", targets=targets, sharing=sharing, terms="both")
    _randomise(model)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        plain = _model(kind)(input_ids=ids, attention_mask=mask).logits
    assert (ref - plain).abs().max() > 1e-3  # the randomised temperatures change the model
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(tmp_path, model_class=type(model)).eval()
    assert loaded.config.sharpattn["selective"]["targets"] == targets
    assert loaded.config.sharpattn["selective"]["sharing"] is sharing
    saved = dict(hf.learnable_parameters(model))
    got = dict(hf.learnable_parameters(loaded))
    assert saved.keys() == got.keys()
    for name in saved:
        assert torch.equal(got[name], saved[name]), name
    with torch.no_grad():
        out = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(out, ref)  # the same weights, the same computation


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("targets,sharing", [("kqv", True), ("q", False)])
def test_kv_cache_gives_the_same_logits(kind, targets, sharing):
    """Positions n with a cache: the last logits of an incremental pass equal a full pass."""
    ids, mask = _inputs()
    model = hf.apply(_model(kind), "selective", targets=targets, sharing=sharing)
    _randomise(model)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits[:, -2:]
        first = model(input_ids=ids[:, :-2], attention_mask=mask[:, :-2], use_cache=True)
        # recent transformers name the cache `cache` and warn on `past_key_values`, its old name
        key = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        rest = model(input_ids=ids[:, -2:], attention_mask=mask, **{key: first[key]}).logits
        generated = model.generate(
            ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0
        )
    close_logits(rest, full)  # cached keys: another order of the same sums
    assert generated.shape == (2, ids.shape[1] + 3)


def test_mlp_value_temperature_with_a_cache_is_one_clear_error():
    ids, mask = _inputs()
    model = hf.apply(_model("llama"), "selective", targets="qv", sharing=False)
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    with torch.no_grad():  # without a cache it runs
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=2, do_sample=False, use_cache=False
        )
    assert out.shape == (2, ids.shape[1] + 2)


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("sharing", [False, True])
def test_parameter_overhead_matches_the_analytic_count(kind, sharing):
    model = _model(kind)
    base = sum(p.numel() for p in model.parameters())
    hf.apply(model, "selective", targets="kqv", sharing=sharing)
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    per_layer = selective_parameter_count(
        cfg.hidden_size,
        heads,
        num_kv_heads=kv,
        head_dim=cfg.hidden_size // heads,
        config=SelectiveConfig("kqv", sharing=sharing),
    )
    over = hf.parameter_overhead(model)
    assert over.added == cfg.num_hidden_layers * per_layer
    assert over.base == base
    assert over.fraction == over.added / base


def test_reapplying_another_method_removes_the_temperatures():
    ids, mask = _inputs()
    model = hf.apply(_model("gpt2"), "selective", targets="qv")
    _randomise(model)
    hf.apply(model, "softmax")
    assert hf.parameter_overhead(model).added == 0
    assert "selective" not in model.config.sharpattn
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        ref = _model("gpt2")(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    close_logits(got[real], ref[real])


def test_selective_over_another_normalizer():
    ids, mask = _inputs()
    model = _model("neox")
    with torch.no_grad():
        hf.apply(model, "adaptive")
        ref = model(input_ids=ids, attention_mask=mask).logits
        hf.apply(model, "selective", targets="qv", normalizer="adaptive", terms="token")
        got = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sharpattn:adaptive"
    real = mask.bool()
    close_logits(got[real], ref[real])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"targets": "x"}, "some of q, k, v"),
        ({"targets": "q", "token": "feature"}, "per-token features"),
        ({"targets": "q", "normalizer": "selective"}, "normalizer="),
        ({"targets": "q", "bogus": 1.0}, "no parameter"),
    ],
)
def test_mistakes_are_one_sentence(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf.apply(_model("gpt2"), "selective", **kwargs)


class _Records(logging.Handler):
    """The messages transformers logs (its root logger does not propagate to pytest's)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_load_report_leaves_out_sharpattn_tensors_only(tmp_path, capsys):
    """transformers lists every tensor it does not know as UNEXPECTED; sharpattn's own are loaded
    by from_pretrained, so the report leaves them out, while a tensor no one loads is reported."""
    from safetensors.torch import load_file, save_file

    model = hf.apply(_model("llama"), "selective", targets="qv")
    _randomise(model)
    model.save_pretrained(tmp_path)
    records, root = _Records(), logging.getLogger("transformers")
    root.addHandler(records)
    # the report is a warning: shown whatever level earlier code left transformers at
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    try:
        loaded = hf.from_pretrained(tmp_path, model_class=type(model))
        assert type(loaded) is type(model)  # the class itself, not the loading subclass
        clean = list(records.messages)
        (file,) = tmp_path.glob("*.safetensors")
        tensors = load_file(str(file))
        tensors["model.not_ours.weight"] = torch.ones(3)
        save_file(tensors, str(file), metadata={"format": "pt"})
        records.messages.clear()
        hf.from_pretrained(tmp_path, model_class=type(model))
        foreign = list(records.messages)
    finally:
        root.removeHandler(records)
        transformers.logging.set_verbosity(level)
    out = capsys.readouterr()
    printed = "\n".join([*clean, *foreign, out.out, out.err])
    assert "sharpattn" not in printed.replace(str(tmp_path), "")  # none of our tensors named
    assert not any("UNEXPECTED" in m for m in clean)  # nothing else to report
    report = "\n".join(foreign)
    assert "UNEXPECTED" in report and "model.not_ours.weight" in report
    for name, p in hf.learnable_parameters(model):  # and ours are still restored exactly
        assert torch.equal(dict(hf.learnable_parameters(loaded))[name], p), name
