"""Selective attention (Zhang et al., NeurIPS 2024) against independent NumPy float64 formulas."""

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.special import erf

import reference as ref
from precision import assert_close
from sharpattn import MultiheadAttention
from sharpattn.attention import SelectiveConfig, parameter_overhead, selective_attend
from sharpattn.attention import selective as sel

# ---------------------------------------------------------------- NumPy transcriptions

pytestmark = pytest.mark.numerical


def np_gelu(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def np_coefficient(theta, param):
    theta = np.asarray(theta, dtype=np.float64)
    return 1 / (1 + np.exp(-theta)) if param == "sigmoid" else np.exp(-np.exp(theta))


def np_visible_keys(lq, lk, mask=None, causal=False):
    """n for each query: allowed keys counted one by one. Returns [B', H', Lq]."""
    m = np.ones((1, 1, lq, lk), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    m = np.broadcast_to(m, m.shape[:2] + (lq, lk)).copy()
    for i in range(lq):
        for j in range(lk):
            if causal and j > i + lk - lq:
                m[..., i, j] = False
    return m.sum(-1).astype(np.float64)


def np_tau(n, coefficient=None, tok=None):
    """τ = τ_tok + 1 + c·log n (n < 1 counts as 1); coefficient [heads] or None."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1)
    pos = 1 + (0 if coefficient is None else np.asarray(coefficient)[None, :, None] * np.log(n))
    return pos + (0 if tok is None else tok)


def np_mha_selective(m: MultiheadAttention, x, key_mask=None, causal=False):
    """A whole selective MultiheadAttention layer in float64 NumPy (self-attention)."""
    p = {k: v.detach().numpy().astype(np.float64) for k, v in m.state_dict().items()}
    x = x.detach().numpy().astype(np.float64)
    b, L, _ = x.shape
    h, hkv, hd = m.num_heads, m.num_kv_heads, m.head_dim

    def heads(t, n_heads):  # [B, L, n·hd] -> [B, n, L, hd]
        return t.reshape(b, L, n_heads, hd).transpose(0, 2, 1, 3)

    proj = {
        "q": heads(x @ p["q_proj.weight"].T + p["q_proj.bias"], h),
        "k": heads(x @ p["k_proj.weight"].T + p["k_proj.bias"], hkv),
        "v": heads(x @ p["v_proj.weight"].T + p["v_proj.bias"], hkv),
    }
    allowed = np.ones((b, 1, L, L), dtype=bool)
    if key_mask is not None:
        allowed &= key_mask.numpy()[:, None, None, :]
    if causal:
        allowed &= np.tril(np.ones((L, L), dtype=bool))
    n_query = allowed.sum(-1)  # [B, 1, L]
    n_key = np.arange(1, L + 1, dtype=np.float64)[None, None, :]
    if key_mask is not None:
        n_key = np.cumsum(key_mask.numpy(), -1)[:, None, :].astype(np.float64)
    for t in m.selective:
        pre = f"selective.{t}."
        tok = None
        if pre + "fc1.weight" in p:
            hid = np_gelu(x @ p[pre + "fc1.weight"].T + p[pre + "fc1.bias"])
            tok = np.tanh(hid @ p[pre + "fc2.weight"].T + p[pre + "fc2.bias"]).transpose(0, 2, 1)
        elif pre + "w" in p:
            tok = np.tanh(np.einsum("bhld,hd->bhl", np_gelu(proj[t]), p[pre + "w"]))
        c = np_coefficient(p[pre + "beta"], "exp") if pre + "beta" in p else None
        tau = np_tau(n_query if t == "q" else n_key, c, tok)
        proj[t] = proj[t] * tau[..., None]
    out = ref.attention(proj["q"], proj["k"], proj["v"], ref.softmax, mask=allowed)
    out = out.transpose(0, 2, 1, 3).reshape(b, L, h * hd)
    return out @ p["out_proj.weight"].T + p["out_proj.bias"]


def randomize_temperatures(m: MultiheadAttention, seed=0):
    """Move every temperature parameter off its (identity) initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in m.selective.named_parameters():
            if name.endswith(("beta", "alpha")):
                prm.copy_(torch.rand(prm.shape, generator=g, dtype=prm.dtype) * 2 - 1)
            else:
                prm.copy_(torch.randn(prm.shape, generator=g, dtype=prm.dtype))


# ---------------------------------------------------------------- the formulas


@pytest.mark.parametrize(
    "lq, lk, causal, masked",
    [
        (5, 5, False, False),
        (5, 5, True, False),
        (3, 7, True, False),
        (6, 3, True, False),
        (4, 6, False, True),
        (3, 7, True, True),
        (1, 1, True, False),
    ],
)
def test_query_positions_count_visible_keys(lq, lk, causal, masked):
    mask = None
    if masked:
        g = torch.Generator().manual_seed(lq * 10 + lk)
        mask = torch.rand(2, 1, lq, lk, generator=g) > 0.4
        mask[0, 0, 0] = False  # an empty row
    n = sel.query_positions(lq, lk, mask=mask, causal=causal)
    expect = np_visible_keys(lq, lk, None if mask is None else mask.numpy(), causal)
    np.testing.assert_array_equal(np.broadcast_to(n.numpy(), expect.shape), expect)
    if causal and not masked and lq <= lk:  # self-attention with a cache: n = 1-based position
        np.testing.assert_array_equal(n[0, 0].numpy(), np.arange(lk - lq + 1, lk + 1))


def test_key_positions_skip_padding():
    assert sel.key_positions(4).flatten().tolist() == [1, 2, 3, 4]
    km = torch.tensor([[False, False, True, True, True], [True, True, True, True, False]])
    n = sel.key_positions(5, key_mask=km)
    assert n.shape == (2, 1, 5)
    np.testing.assert_array_equal(n[:, 0].numpy(), np.cumsum(km.numpy(), -1))


@pytest.mark.parametrize("param", ["exp", "sigmoid"])
def test_position_temperature_matches_numpy(param):
    theta = torch.tensor([-3.0, -0.5, 0.0, 1.5, 2.5], dtype=torch.float64)
    c = sel.position_coefficient(theta, param)
    assert_close(c, np_coefficient(theta.numpy(), param))
    n = torch.tensor([0.0, 1.0, 2.0, 7.0, 4096.0], dtype=torch.float64).view(1, 1, 5)
    tau = sel.position_temperature(n, c.view(1, 5, 1))
    assert_close(tau, np_tau(n.numpy(), c.numpy()))
    # the parameter that gives the initial coefficient, both parameterisations, both c₀'s
    for c0 in (sel.DEFAULT_C0, sel.AUTHORS_C0):
        t0 = torch.tensor(sel.initial_theta(param, c0), dtype=torch.float64)
        # θ = log(c₀) or logit(c₀) and back: a log/exp round trip amplifies rounding by |log c₀| ≤ e²
        assert_close(
            sel.position_coefficient(t0, param), c0, dtype=torch.float64, ulps=8 * math.exp(2)
        )
    assert sel.AUTHORS_C0 == math.exp(-math.exp(2))  # the authors' β = 2
    with pytest.raises(ValueError, match="position_param"):
        sel.position_coefficient(theta, "softplus")


def test_token_temperatures_match_numpy():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 6, generator=g, dtype=torch.float64) * 3
    w1, b1 = torch.randn(4, 6, generator=g).double(), torch.randn(4, generator=g).double()
    w2, b2 = torch.randn(3, 4, generator=g).double(), torch.randn(3, generator=g).double()
    tok = sel.token_temperature_mlp(x, w1, b1, w2, b2)
    hid = np_gelu(x.numpy() @ w1.numpy().T + b1.numpy())
    expect = np.tanh(hid @ w2.numpy().T + b2.numpy()).transpose(0, 2, 1)
    assert tok.shape == (2, 3, 5)
    assert_close(tok, expect, n=6 + 4, magnitude=1.0)  # tanh of two chained reductions

    proj = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    expect = np.tanh(np.einsum("bhld,hd->bhl", np_gelu(proj.numpy()), w.numpy()))
    assert_close(sel.token_temperature_shared(proj, w), expect, n=4, magnitude=1.0)

    phi = torch.randn(2, 5, generator=g, dtype=torch.float64)
    gamma = torch.randn(3, 1, generator=g, dtype=torch.float64)
    expect = np.tanh(gamma.numpy()[None, :, 0, None] * phi.numpy()[:, None, :])
    assert_close(sel.token_temperature_feature(phi, gamma), expect, magnitude=1.0)
    big = torch.full((1, 5, 1), 1e4, dtype=torch.float64)  # saturates at ±1, never NaN
    out = sel.token_temperature_feature(big, torch.tensor([[1.0], [-1.0], [0.0]]).double())
    assert out[0, :, 0].tolist() == [1.0, -1.0, 0.0]


def test_exp_activation_is_uncapped_and_identity_at_init():
    """activation="exp": τ_tok = e^f − 1, so with terms="token" τ = e^f (any positive value, the
    graph task's unrestricted per-group scale); τ = 1 at f = 0; "tanh" stays below 2."""
    g = torch.Generator().manual_seed(3)
    phi = torch.randn(2, 5, 3, generator=g, dtype=torch.float64) * 4
    gamma = torch.randn(2, 3, generator=g, dtype=torch.float64)
    f = np.einsum("blf,hf->bhl", phi.numpy(), gamma.numpy())
    got = sel.token_temperature_feature(phi, gamma, "exp")
    # expm1 of a 3-term dot product: relative error of the sum times |f| (up to ~30 here)
    assert_close(got, np.expm1(f), n=3, magnitude=float(np.abs(f).max()) * float(np.exp(f).max()))
    cfg = SelectiveConfig("q", token="feature", num_features=3, terms="token", activation="exp")
    t = sel.Temperature(4, 2, 2, cfg, dtype=torch.float64)
    n = torch.ones(1, 1, 1, dtype=torch.float64)
    assert torch.equal(t(n, features=phi), torch.ones(2, 2, 5, dtype=torch.float64))  # γ = 0
    with torch.no_grad():
        t.gamma.copy_(gamma)
    tau = t(n, features=phi).detach()
    assert_close(tau, np.exp(f), n=3, magnitude=float(np.abs(f).max()) * float(np.exp(f).max()))
    assert float(tau.max()) > 2 and float(tau.min()) > 0  # beyond tanh's cap, still positive
    with torch.no_grad():  # the capped form: τ = 1 + tanh(f) < 2 whatever f
        capped = sel.Temperature(
            4,
            2,
            2,
            SelectiveConfig("q", token="feature", num_features=3, terms="token"),
            dtype=torch.float64,
        )
        capped.gamma.copy_(gamma * 100)
    assert float(capped(n, features=phi).detach().max()) <= 2.0
    with pytest.raises(ValueError, match="activation must be one of"):
        SelectiveConfig("q", activation="relu")


def test_graph_task_default_is_the_uncapped_scale(tmp_path):
    """GraphConfig's default query temperature is e^γ per group (1 at initialisation); the capped
    1 + tanh(γ) form stays available; the two are different run configurations."""
    from dataclasses import asdict, replace

    from sharpattn.experiments import selective as exp
    from sharpattn.experiments import selective_graph as graph
    from sharpattn.lab.runner import RunFolder

    assert graph.GraphConfig().query_activation == "exp"
    model = graph.GraphEnsemble(8, 8, [("selective", 0)], activation="exp")
    with torch.no_grad():
        model.tau_group.gamma.copy_(torch.tensor([[6.0, 3.0, 1.0, 0.0]]))
    seqs = graph.canonical_sequences(8).unsqueeze(1)
    tau = model.query_temperature(seqs, torch.zeros(8, 1, 1, 8))[:, 0, 0]
    groups = [model.groups.index(int(c)) for c in (graph.graph_transition(8) > 0).sum(-1)]
    assert_close(tau, np.exp([[6.0, 3.0, 1.0, 0.0][g] for g in groups]), dtype=torch.float32)
    capped = graph.GraphEnsemble(8, 8, [("selective", 0)], activation="tanh")
    with torch.no_grad():
        capped.tau_group.gamma.copy_(torch.tensor([[6.0, 3.0, 1.0, 0.0]]))
    assert float(capped.query_temperature(seqs, torch.zeros(8, 1, 1, 8)).detach().max()) < 2
    cfg = exp.ReproduceConfig(tasks=("graph",))
    RunFolder(tmp_path / "r", "reproduce selective", asdict(cfg), identity=exp._identity(cfg))
    other = replace(cfg, graph=replace(cfg.graph, query_activation="tanh"))
    with pytest.raises(ValueError):
        RunFolder(
            tmp_path / "r", "reproduce selective", asdict(other), identity=exp._identity(other)
        )


@pytest.mark.parametrize("impl", ["auto", "naive"])
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(causal=True, lq=3, lk=7),
        dict(causal=True, lq=6, lk=3),
        dict(hkv=2, mask=True),
        dict(hkv=1, causal=True, lq=4, lk=9, mask=True),
        dict(huge=True),
    ],
)
def test_selective_attend_matches_numpy(case, impl):
    case = dict(case)
    causal, masked, huge = case.pop("causal", False), case.pop("mask", False), case.pop("huge", 0)
    b, h, hkv, lq, lk, d = 2, 4, case.get("hkv", 4), case.get("lq", 5), case.get("lk", 6), 3
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(b, n, L, d, generator=g, dtype=torch.float64)
        for n, L in ((h, lq), (hkv, lk), (hkv, lk))
    )
    if huge:
        q = q * 1e4  # logits ~ ±1e4: scaling by τ must stay finite
    tq = torch.rand(b, h, lq, generator=g, dtype=torch.float64) * 3 - 0.5  # may be negative
    tk = torch.rand(b, hkv, lk, generator=g, dtype=torch.float64) + 0.5
    tv = torch.rand(b, hkv, lk, generator=g, dtype=torch.float64) * 2
    mask = None
    if masked:
        mask = torch.rand(b, 1, lq, lk, generator=g) > 0.3
        mask[0, 0, 1] = False  # an empty row -> zero output, not NaN
    out = selective_attend(
        q, k, v, tau_q=tq, tau_k=tk, tau_v=tv, mask=mask, causal=causal, impl=impl
    )
    expect = ref.attention(
        q.numpy() * tq.numpy()[..., None],
        k.numpy() * tk.numpy()[..., None],
        v.numpy() * tv.numpy()[..., None],
        ref.softmax,
        mask=None if mask is None else mask.numpy(),
        causal=causal,
    )
    assert torch.isfinite(out).all()
    # a weight's error is its logit's error (≈ ε·|s|, |s| up to 1e4 in the huge case) times the
    # weight; the output sums lk weighted values of size max|τ_v v|, the logits d-term products
    vv = (v * tv[..., None]).abs().max().item()
    smax = (q * tq[..., None]).abs().max().item() * (k * tk[..., None]).abs().max().item() * d
    assert_close(out, expect, n=lk * d, magnitude=vv * (1 + smax))


# ---------------------------------------------------------------- MultiheadAttention


@pytest.mark.parametrize(
    "selective, sharing, kv_heads",
    [("q", False, 4), ("v", True, 4), ("qv", False, 2), ("kqv", True, 2), ("kqv", False, 1)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_mha_selective_matches_numpy(selective, sharing, kv_heads, causal):
    torch.manual_seed(0)
    m = MultiheadAttention(
        12, 4, num_kv_heads=kv_heads, selective=selective, sharing=sharing, dtype=torch.float64
    )
    randomize_temperatures(m)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    km = torch.ones(2, 7, dtype=torch.bool)
    km[1, :2] = False  # left padding: positions count real tokens only
    out = m(x, key_mask=km, causal=causal)
    expect = np_mha_selective(m, x, key_mask=km, causal=causal)
    # projections (width 12), the attention sum (7 keys) and the output projection, chained
    assert_close(out, expect, n=12 * 7 * 12)


def test_mha_cross_attention_with_a_cache_uses_visible_keys():
    """Lq = 3 queries over Lk = 7 cached keys, causal: the queries see 5, 6, 7 keys, so
    τ_q = 1 + c·log(5, 6, 7); keys/values sit at positions 1..7."""
    torch.manual_seed(0)
    cfg = SelectiveConfig("kqv", terms="position", position_param="sigmoid")
    m = MultiheadAttention(8, 2, selective=cfg, dtype=torch.float64)
    randomize_temperatures(m)
    xq, xkv = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 7, 8, dtype=torch.float64)
    out = m(xq, xkv, causal=True)

    def c(t):
        return np_coefficient(m.selective[t].alpha.detach().numpy(), "sigmoid")

    tq = np_tau(np.array([5.0, 6.0, 7.0])[None, None], c("q"))
    tk, tv = (np_tau(np.arange(1.0, 8.0)[None, None], c(t)) for t in "kv")

    def heads(x, proj):
        return proj(x).view(2, x.shape[1], 2, 4).transpose(1, 2).detach().numpy()

    q, k, v = heads(xq, m.q_proj), heads(xkv, m.k_proj), heads(xkv, m.v_proj)
    expect = ref.attention(
        q * tq[..., None], k * tk[..., None], v * tv[..., None], ref.softmax, causal=True
    )
    expect = expect.transpose(0, 2, 1, 3).reshape(2, 3, 8)
    expect = expect @ m.out_proj.weight.detach().numpy().T + m.out_proj.bias.detach().numpy()
    assert_close(out, expect, n=8 * 7 * 8)  # three chained reductions, as above


def test_selective_attend_gradcheck():
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 2, L, 3, generator=g, dtype=torch.float64, requires_grad=True)
        for L in (3, 4, 4)
    )
    tq = torch.rand(1, 2, 3, generator=g, dtype=torch.float64).add(0.5).requires_grad_()
    tv = torch.rand(1, 2, 4, generator=g, dtype=torch.float64).add(0.5).requires_grad_()
    mask = torch.tensor([[True, False, True, True]])
    assert torch.autograd.gradcheck(
        lambda q, k, v, tq, tv: selective_attend(
            q, k, v, tau_q=tq, tau_v=tv, mask=mask, causal=True
        ),
        (q, k, v, tq, tv),
    )


@pytest.mark.parametrize("selective", ["q", "v", "qv", "kqv"])
@pytest.mark.parametrize("sharing", [False, True])
def test_mha_selective_is_identity_at_init(selective, sharing):
    torch.manual_seed(0)
    base = MultiheadAttention(32, 4, num_kv_heads=2, causal=True)
    m = MultiheadAttention(32, 4, num_kv_heads=2, causal=True, selective=selective, sharing=sharing)
    missing, unexpected = m.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("selective.") for k in missing)
    x = torch.randn(2, 1024, 32)
    a, b = base(x), m(x)
    rel = ((a - b).norm() / a.norm()).item()
    # the contract (a model quantity, not rounding): within 1e-3; in fact τ − 1 <= 5.1e-6·log 1024
    assert rel < 1e-3
    assert rel < 1e-4
    # tokens-only: exactly the unpatched layer
    exact = MultiheadAttention(
        32,
        4,
        num_kv_heads=2,
        causal=True,
        selective=SelectiveConfig(selective, sharing, terms="token"),
    )
    exact.load_state_dict(base.state_dict(), strict=False)
    assert torch.equal(exact(x), a)  # tokens-only temperatures are exactly 1 at init


def test_initial_temperatures_are_one_plus_c0_log_n():
    for c0 in (sel.DEFAULT_C0, sel.AUTHORS_C0):
        for param in ("exp", "sigmoid"):
            cfg = SelectiveConfig("q", position_param=param, position_init=c0)
            t = sel.Temperature(8, 2, 4, cfg, dtype=torch.float64)
            n = sel.query_positions(5, 9, causal=True)
            tau = t(n, x=torch.randn(3, 5, 8, dtype=torch.float64))
            expect = 1 + c0 * np.log(np.arange(5, 10, dtype=np.float64))
            assert_close(tau, np.broadcast_to(expect, (3, 2, 5)))


@pytest.mark.parametrize(
    "config",
    [
        SelectiveConfig("qv"),
        SelectiveConfig("kqv", sharing=True),
        SelectiveConfig("qv", token="feature", num_features=2),
        SelectiveConfig("q", terms="position", position_param="sigmoid"),
    ],
)
def test_gradients_reach_temperatures_and_state_dict_round_trips(config, tmp_path):
    torch.manual_seed(0)
    m = MultiheadAttention(16, 4, num_kv_heads=2, causal=True, selective=config)
    x = torch.randn(2, 9, 16)
    feats = torch.randn(2, 9, 2) if config.token_form == "feature" else None
    loss = m(x, token_features=feats).pow(2).mean()
    loss.backward()
    for name, p in m.selective.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if not name.endswith(("fc1.weight", "fc1.bias")):  # fc1 is behind a zero output layer
            assert p.grad.abs().sum() > 0, name
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad()
    m(x, token_features=feats).pow(2).mean().backward()
    for name, p in m.selective.named_parameters():
        assert p.grad.abs().sum() > 0, name  # after one step every parameter learns

    save_file(m.state_dict(), tmp_path / "m.safetensors")
    again = MultiheadAttention(16, 4, num_kv_heads=2, causal=True, selective=config)
    again.load_state_dict(load_file(tmp_path / "m.safetensors"))
    assert torch.equal(again(x, token_features=feats), m(x, token_features=feats))
    assert any(k.startswith("selective.") for k in m.state_dict())


def test_bf16_and_errors():
    torch.manual_seed(0)
    m = MultiheadAttention(16, 4, causal=True, selective="qv")
    randomize_temperatures(m)
    x = torch.randn(2, 8, 16)
    out32 = m(x)
    m16 = MultiheadAttention(16, 4, causal=True, selective="qv", dtype=torch.bfloat16)
    m16.load_state_dict({k: v.bfloat16() for k, v in m.state_dict().items()})
    out16 = m16(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    # bfloat16 model vs float32: projections (16), the attention sum (8 keys), output projection
    assert_close(out16, out32, n=16 * 8, ulps=16)  # 16: bf16 rounds weights and inputs too

    with pytest.raises(ValueError, match="q, k, v"):
        MultiheadAttention(16, 4, selective="qx")
    with pytest.raises(ValueError, match="sharing"):
        MultiheadAttention(16, 4, sharing=True)
    with pytest.raises(ValueError, match="terms"):
        SelectiveConfig("q", terms="all")
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        SelectiveConfig("q", position_init=0.0)
    feat = MultiheadAttention(16, 4, selective=SelectiveConfig("q", token="feature"))
    with pytest.raises(ValueError, match="token_features"):
        feat(x)


# ---------------------------------------------------------------- parameter overhead


@pytest.mark.parametrize(
    "config",
    [
        SelectiveConfig("q"),
        SelectiveConfig("qv", hidden=5),
        SelectiveConfig("kqv", sharing=True),
        SelectiveConfig("v", token="feature", num_features=3),
        SelectiveConfig("qv", terms="token"),
        SelectiveConfig("kqv", terms="position"),
    ],
)
def test_parameter_count_matches_the_module(config):
    m = MultiheadAttention(24, 6, num_kv_heads=2, selective=config)
    count = sel.selective_parameter_count(24, 6, num_kv_heads=2, config=config)
    ov = parameter_overhead(m)
    assert ov.added == count
    assert ov.base == sum(p.numel() for p in MultiheadAttention(24, 6, num_kv_heads=2).parameters())


def test_paper_scale_overhead():
    """GPT-2 small / Pythia-160m geometry: base SSA on q and v ≈ 5%, weight sharing < 0.5%,
    feature-based < 0.01% (Sec. 3, App. B.2)."""
    from sharpattn.experiments.selective import paper_scale_overhead

    rows = {(r["model"], r["variant"]): r for r in paper_scale_overhead()}
    assert rows[("GPT-2 small", "base")]["base_parameters"] == 124_439_808
    assert rows[("Pythia-160m", "base")]["base_parameters"] == 162_322_944
    for model in ("GPT-2 small", "Pythia-160m"):
        assert 0.03 < rows[(model, "base")]["fraction"] < 0.07
        assert rows[(model, "weight sharing")]["fraction"] < 0.005
        assert rows[(model, "feature-based")]["fraction"] < 1e-4


# ---------------------------------------------------------------- the reproduction's pieces


def test_graph_task_data():
    from sharpattn.experiments import selective_graph as exp

    p = exp.graph_transition()
    assert sorted((p > 0).sum(-1).tolist(), reverse=True) == [4, 3, 3, 3, 2, 2, 2, 1]
    assert_close(p.sum(-1), torch.ones(8, dtype=torch.float64), n=8)
    seqs, y = exp.graph_batch(20000, 2, p, torch.Generator().manual_seed(0))
    assert torch.equal(seqs.sort(-1).values, torch.arange(8).expand_as(seqs))  # each token once
    last = seqs[..., -1]
    assert bool((p[last, y] > 0).all())  # targets only among the query and its neighbours
    for q in (0, 4, 7):  # empirical next-token frequencies follow P*'s row
        freq = torch.bincount(y[last == q], minlength=8).double()
        # sampling error, not rounding: ~2,500 draws per query give a standard error ≤ 0.01
        np.testing.assert_allclose((freq / freq.sum()).numpy(), p[q].numpy(), atol=0.03)


def test_denoise_data_and_estimators():
    from sharpattn.experiments import selective_denoise as exp

    sigmas = torch.tensor([0.1, 0.5])
    x, y, signal = exp.denoise_batch(4000, 8, 16, sigmas, torch.Generator().manual_seed(0))
    assert x.shape == (4000, 2, 16, 8) and bool(signal[..., -1].all())
    assert abs(signal[..., :-1].float().mean().item() - 0.25) < 0.01
    noise = x - signal.unsqueeze(-1) * y.unsqueeze(2)
    # sampling error of a std over 4000·16·8 draws (relative SE ≈ 0.002), not rounding
    np.testing.assert_allclose(noise.std(dim=(0, 2, 3)).numpy(), [0.1, 0.5], rtol=0.02)
    # the loss and the Bayes (oracle) mean against NumPy
    xs, ys, ss = x[:50, 0].double().numpy(), y[:50, 0].double().numpy(), signal[:50, 0].numpy()
    bayes = np.stack([xs[i][ss[i]].mean(0) for i in range(50)])
    expect = ((ys - bayes / np.linalg.norm(bayes, axis=-1, keepdims=True)) ** 2).sum(-1)
    got = exp.denoise_loss(torch.from_numpy(bayes), torch.from_numpy(ys))
    assert_close(got, expect, n=8, magnitude=4.0)  # squared distances of unit-size vectors
    t = exp.threshold_temperature(torch.tensor([[0.49, 0.1], [0.5, -3.0]]).view(1, 2, 2))
    assert t.tolist() == [[0.0, 1.0]]


def _one_head_ensembles():
    from sharpattn.experiments import selective_denoise as dn
    from sharpattn.experiments import selective_graph as graph

    return {
        "graph": graph.GraphEnsemble(8, 8, [(v, s) for v in graph.GRAPH_VARIANTS for s in (3, 4)]),
        "denoise": dn.DenoiseEnsemble(8, [(v, 5) for v in dn.DENOISE_VARIANTS]),
    }


@pytest.mark.parametrize("task", ["graph", "denoise"])
def test_one_head_ensembles_start_and_project_as_before(task):
    """The ensembles' linear maps are models.ensemble.StackedLinear: member i starts from exactly
    the draws of before (x·W layout [d_in, d_out] from its own generator, transposed), and a
    member-wise projection is the einsum of before to float32 rounding."""
    from sharpattn.experiments import selective_common as common
    from sharpattn.lab.runner import generator

    model = _one_head_ensembles()[task]
    layers = {"q": (0, 3), "k": (1, 4), "v": (2, 5)} | (
        {"classifier": (8, 9)} if task == "graph" else {}
    )
    for name, (wi, bi) in layers.items():
        layer = getattr(model, name)
        d_out, d_in = layer.weight.shape[1:]
        bound = 1 / math.sqrt(d_in)
        for i, (_, seed) in enumerate(model.members):
            key = (seed, model.task, common.INIT)
            w = (torch.rand(d_in, d_out, generator=generator(*key, wi)) * 2 - 1) * bound
            b = (torch.rand(d_out, generator=generator(*key, bi)) * 2 - 1) * bound
            assert torch.equal(layer.weight[i], w.T) and torch.equal(layer.bias[i, 0], b)
        for shape in ((5, len(model.members), 7, d_in), (5, len(model.members), d_in)):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
            before = torch.einsum("be...d,edf->be...f", x, layer.weight.transpose(1, 2))
            before = before + layer.bias.view(len(model.members), *([1] * (x.dim() - 3)), d_out)
            assert_close(common.memberwise(layer, x), before, n=d_in)  # a d_in-term dot product


@pytest.mark.parametrize("task", ["graph", "denoise"])
def test_checkpoints_of_the_layout_before_still_load(task, tmp_path):
    """Run folders written before the ensembles were StackedLinear (wq, wk, wv [E, d_in, d],
    bq, bk, bv [E, d], the graph readout wc, bc; Adam's state in that parameter order) load,
    finished weights and mid-run checkpoints alike, into the same values."""
    import copy

    from torch import nn

    from sharpattn.lab.checkpoint import load_checkpoint, save_checkpoint

    new = _one_head_ensembles()[task]
    linear = {"q": "q", "k": "k", "v": "v", "c": "classifier"}
    order = ["wq", "wk", "wv", "bq", "bk", "bv"]  # the parameter order of before
    order += ["embed", "wc", "bc", "tau_group", "tau_shared"] if task == "graph" else []
    order += ["tau_shared", "tau_feature"] if task == "denoise" else []

    old = nn.Module()  # the layout of before, transcribed
    for name in order:
        if name[0] in "wb" and name[1] in linear:
            layer = getattr(new, linear[name[1]])
            value = layer.weight.transpose(1, 2) if name[0] == "w" else layer.bias[:, 0]
            setattr(old, name, nn.Parameter(value.detach().clone()))
        elif isinstance(getattr(new, name), nn.Parameter):
            setattr(old, name, nn.Parameter(getattr(new, name).detach().clone()))
        else:
            setattr(old, name, copy.deepcopy(getattr(new, name)))
    for name, buf in new.named_buffers(recurse=False):
        old.register_buffer(name, buf.clone())
    adam = torch.optim.Adam(old.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in old.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        adam.step()
    save_checkpoint(
        tmp_path / "old.safetensors", model=old, optimizer=adam, state={"step": 2, "seconds": 0.0}
    )

    fresh = _one_head_ensembles()[task]
    fresh_adam = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    state = load_checkpoint(tmp_path / "old.safetensors", model=fresh, optimizer=fresh_adam)
    assert state["step"] == 2

    def params(model, name):  # what an old name stands for in ``model``, and its old layout
        if model is fresh and name[0] in "wb" and name[1] in linear:
            layer = getattr(model, linear[name[1]])
            if name[0] == "w":
                return [layer.weight], lambda t: t.transpose(1, 2)
            return [layer.bias], lambda t: t[:, 0]
        part = getattr(model, name)
        return (list(part.parameters()) if isinstance(part, nn.Module) else [part]), lambda t: t

    for name in order:
        (now, as_before), (then, _) = params(fresh, name), params(old, name)
        for p_new, p_old in zip(now, then, strict=True):
            assert torch.equal(as_before(p_new.detach()), p_old.detach()), name
            for moment in ("exp_avg", "exp_avg_sq"):
                got, want = fresh_adam.state[p_new][moment], adam.state[p_old][moment]
                assert torch.equal(as_before(got), want), (name, moment)
    save_checkpoint(
        tmp_path / "new.safetensors",
        model=fresh,
        optimizer=fresh_adam,
        state={"step": 2, "seconds": 0.0},
    )
    again = _one_head_ensembles()[task]
    load_checkpoint(tmp_path / "new.safetensors", model=again)  # this layout: passes unchanged
    assert all(
        torch.equal(a, b)
        for a, b in zip(again.state_dict().values(), fresh.state_dict().values(), strict=True)
    )


def test_ensemble_members_train_independently(tmp_path):
    """Training members together gives each exactly the run it would have alone."""
    from sharpattn.experiments import selective_denoise as dn
    from sharpattn.experiments import selective_graph as graph

    cfg = graph.GraphConfig(steps=4, batch=16, lr=1e-2)
    together = graph.graph_train(tmp_path / "together", cfg, [0, 1])
    alone = graph.graph_train(
        tmp_path / "alone",
        graph.GraphConfig(steps=4, batch=16, lr=1e-2, variants=("selective",)),
        [0, 1],
    )
    pick = [r for r in together if r["variant"] == "selective"]
    for a, b in zip(pick, alone, strict=True):
        assert a["seed"] == b["seed"]
        # members trained in one batched computation vs alone: 4 float32 training steps whose
        # rounding differences (batched vs single matmuls) pass through the optimiser
        assert_close(a["cross_entropy"], b["cross_entropy"], dtype=torch.float32, n=4 * 16, ulps=64)
        assert a["tau_by_group"].keys() == b["tau_by_group"].keys()
        ta, tb = (list(r["tau_by_group"].values()) for r in (a, b))
        assert_close(ta, tb, dtype=torch.float32, n=4 * 16, ulps=64)
    dc = dn.DenoiseConfig(steps=3, batch=8, sigmas=(0.2,), eval_samples=64, lr=1e-2)
    both = dn.denoise_train(tmp_path / "both", dc, [0])
    one = dn.denoise_train(
        tmp_path / "one",
        dn.DenoiseConfig(**{**dc.__dict__, "variants": ("selective (learned: feature)",)}),
        [0],
    )
    key = "selective (learned: feature)"
    assert_close(both[0][key], one[0][key], dtype=torch.float32, n=3 * 8, ulps=64)  # as above


def test_reproduce_selective_cli(tmp_path, capsys):
    from sharpattn.cli import main

    out = tmp_path / "sel"
    argv = ["reproduce", "selective", "--quick", "--steps", "3", "--seeds", "2"]
    argv += ["--lm-variants", "vanilla,qv:both"]
    assert main(argv + ["--sigmas", "0.1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0.751" in printed and "1.390" in printed  # the paper's numbers beside ours
    assert "ours, not the paper's" in printed and "26.514" in printed  # the LM part (3 steps)
    names = ("config.json", "metrics.json", "report.md", "graph_classifier.png", "denoise.png")
    for name in names + ("lm.png",):
        assert (out / name).stat().st_size > 0
    assert main(argv + ["--sigmas", "0,x", "--out", str(out)]) == 2
    assert "sigmas" in capsys.readouterr().err


def test_selective_verdicts_are_the_paired_seed_statistics():
    """`compare`'s change, interval, detectable change and verdict against vanilla, recomputed
    from the seeds by scipy (paired t), and the verdict table that shows them."""
    from scipy import stats as sps

    from sharpattn.experiments import selective_common as common
    from sharpattn.lab.stats import detectable_at_power

    vanilla = [[0.50, 1.0], [0.46, 1.2], [0.47, 0.9], [0.52, 1.1]]
    selective = [[0.36, 1.1], [0.35, 1.0], [0.33, 1.2], [0.40, 1.3]]  # spikier; no claim on 2
    cols = common.compare(selective, vanilla, [common.FIG2_CLAIMS["spikiness"], None])
    d = np.array(selective)[:, 0] - np.array(vanilla)[:, 0]
    half = sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    c = cols[0]
    assert c.change == pytest.approx(d.mean()) and c.p == pytest.approx(
        sps.ttest_rel(np.array(selective)[:, 0], np.array(vanilla)[:, 0]).pvalue
    )
    assert (c.low, c.high) == pytest.approx((d.mean() - half, d.mean() + half))
    assert c.detectable == pytest.approx(detectable_at_power(d.std(ddof=1), 4, 0.05))
    assert c.verdict == "reproduced" and c.paper == "0.39 → 0.26"
    assert cols[1].verdict == "–" and cols[1].paper == "–"  # the paper claims nothing there
    # the other direction is contradicted
    assert common.compare(vanilla, selective, [common.FIG2_CLAIMS["spikiness"], None])[
        0
    ].verdict == ("contradicted")
    rows = [{"variant": "vanilla"}, {"variant": "group τ_q"}]
    common.store(rows[1], "spikiness", c)
    md = common.verdict_markdown(rows, {"spikiness": "spikiness", "qk_norm": "‖W‖"})
    assert f"| group τ_q | spikiness | {d.mean():.3g} |" in md and "| reproduced |" in md
    assert "vanilla |" not in md.split("\n\n")[1].split("\n", 2)[2]  # vanilla is the baseline
    # a second claim on the page: the page's claims are one family, Holm-corrected
    weak = [[0.49, 1.0], [0.43, 1.2], [0.47, 0.9], [0.50, 1.1]]
    rows.append({"variant": "weak"})
    common.store(
        rows[2],
        "spikiness",
        common.compare(weak, vanilla, [common.FIG2_CLAIMS["spikiness"], None])[0],
    )
    p = [
        sps.ttest_rel(np.array(x)[:, 0], np.array(vanilla)[:, 0]).pvalue for x in (selective, weak)
    ]
    small, large = sorted(p)
    want = {small: 2 * small, large: max(2 * small, large)}
    md = common.verdict_markdown(rows, {"spikiness": "spikiness", "qk_norm": "‖W‖"})
    assert "p, Holm over 2" in md and "α/m = 0.05/2" in md
    for r, pv in zip(rows[1:], p, strict=True):
        assert r["spikiness_holm"] == pytest.approx(min(1.0, want[pv]))
