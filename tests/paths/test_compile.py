"""``attend(..., check_finite=False)`` never synchronises with the device: ``torch.compile`` with
``fullgraph=True`` captures every method on every path in one graph (a host sync — ``.item()``,
``bool(tensor)``, ``.nonzero()``, Python branching on a tensor value — is a graph break, and
``fullgraph=True`` raises on the first), forward and backward, and the compiled result is the
eager one.

``backend="eager"`` runs dynamo's capture and then the captured graph eagerly: no C++ compile,
so every method and path fits in seconds. The methods are read from the registry at collection
time, so a method (or a fast path) registered later is covered by the same tests. One smoke test
compiles for real (inductor) when a C++ compiler is present.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from precision import assert_close
from sharpattn import normalizers as nz
from sharpattn.attention import MultiheadAttention, attend

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, HKV, LQ, LK, D = 2, 4, 2, 5, 7, 8  # GQA; causal with Lq < Lk (queries at the keys' end)
BLOCK = 2  # the chunked path runs three query blocks (2, 2, 1)


def _paths(method: str) -> list[str]:
    """The paths ``method`` allows: naive, chunked, and fused and auto where it has a fast path
    (without one, auto is the naive path at these sizes)."""
    return ["naive", "chunked"] + (["fused", "auto"] if nz.get(method).fused else [])


CASES = [
    pytest.param(method, impl, causal, id=f"{method}-{impl}-{'causal' if causal else 'full'}")
    for method in nz.available()
    for impl in _paths(method)
    for causal in ((True,) if method == "stick_breaking" else (False, True))  # causal only
    # auto is the fused path once `attend` has chosen it (a branch on the method's fast path,
    # the same for every method): its choice traced once per method, causal
    if impl != "auto" or causal
]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, LQ, D, generator=g)
    k = torch.randn(B, HKV, LK, D, generator=g)
    v = torch.randn(B, HKV, LK, D, generator=g)
    mask = torch.ones(B, 1, 1, LK, dtype=torch.bool)
    mask[1, ..., :2] = False  # left padding in batch 1
    return q, k, v, mask


def _params(method: str, seed: int = 1) -> dict:
    """Per-head tensor parameters ``[1, H, 1, 1]`` near their defaults for the learnable ones,
    as MultiheadAttention passes them (tensors take other branches than numbers)."""
    g = torch.Generator().manual_seed(seed)
    params = {
        p.name: float(p.default) + 0.1 * torch.rand(1, H, 1, 1, generator=g)
        for p in nz.get(method).learnable
    }
    if any(p.name == "n_iter" for p in nz.get(method).params):
        params["n_iter"] = 8  # bisection steps are unrolled in the graph: fewer trace faster
    return params


def _forward_backward(fn, q, k, v, mask, params):
    """Output and the gradients of a fixed projection of it w.r.t. q, k, v and the tensor
    parameters."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ps = {n: p.clone().requires_grad_() if torch.is_tensor(p) else p for n, p in params.items()}
    out = fn(*leaves, mask, ps)
    weight = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    inputs = [*leaves, *(p for p in ps.values() if torch.is_tensor(p))]
    grads = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads, strict=True)]
    return out.detach(), grads


def _broke(what: str, err: Exception) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    # the innermost line of ours in dynamo's "from user code" trace: where the graph broke
    ours = re.findall(r'File "([^"]*sharpattn[^"]*)", line (\d+)', text)
    where = f" at {ours[-1][0].split('sharpattn', 1)[-1].lstrip('/')}:{ours[-1][1]}" if ours else ""
    return (
        f"torch.compile(fullgraph=True) could not capture {what} with check_finite=False"
        f"{where}: {type(err).__name__}: {first} (a host sync or another graph break; "
        "torch._dynamo.explain(fn)(...) lists them all)"
    )


def _close(got, want, what):
    (out, grads), (ref_out, ref_grads) = got, want
    assert_close(out, ref_out, n=LK, msg=f"{what}: output")
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_close(g, r, n=LK * D, msg=f"{what}: gradient {i}")


def _compiled_equals_eager(run, what, q, k, v, mask, params):
    """``run`` compiled whole (forward and backward) equals ``run`` eager with every check on:
    skipping the checks changes no number."""
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="eager")
    try:
        got = _forward_backward(compiled, q, k, v, mask, params)
    except torch._dynamo.exc.TorchDynamoException as err:
        pytest.fail(_broke(what, err))
    want = _forward_backward(lambda *a: run(*a, check_finite=True), q, k, v, mask, params)
    _close(got, want, what)


def _attend_with(method, impl, causal):
    """``run(q, k, v, mask, params, check_finite=False)``: `attend` with ``method`` on ``impl``
    in query blocks of `BLOCK` rows, as the compile tests call it."""

    def run(q, k, v, mask, params, check_finite=False):
        return attend(
            q,
            k,
            v,
            method,
            mask=mask,
            causal=causal,
            impl=impl,
            block_size=BLOCK,
            check_finite=check_finite,
            **params,
        )

    return run


@pytest.mark.parametrize(("method", "impl", "causal"), CASES)
def test_attend_compiles_whole_and_matches_eager(method, impl, causal):
    q, k, v, mask = _inputs()
    params = _params(method)

    run = _attend_with(method, impl, causal)

    what = f"attend({method!r}, impl={impl!r}, causal={causal})"
    _compiled_equals_eager(run, what, q, k, v, mask, params)


#: the C++ tile loops each fast path calls on float32 CPU tiles without a mask but the causal
#: one (attention/cpu/native.py), forward and backward: the graph must call them, not leave them
LOOPS = {
    "adaptive": {"adaptive_forward", "tempered_backward"},
    **dict.fromkeys(("sigmoid", "relu"), {"elementwise_forward", "elementwise_backward"}),
    **dict.fromkeys(("power", "signed", "softpick"), {"normalised_forward", "normalised_backward"}),
    **dict.fromkeys(("sparsemax", "entmax15", "entmax", "asentmax"), {"sparse_prepare"}),
    "topk": {"topk_select"},
    "stick_breaking": {"stick_forward", "stick_backward"},
}


@pytest.mark.parametrize(
    ("method", "causal"),
    [
        pytest.param(m, c, id=f"{m}-{'causal' if c else 'full'}")
        for m in nz.available()
        if nz.get(m).fused
        for c in ((True,) if m == "stick_breaking" else (False, True))
    ],
)
def test_fast_paths_compile_whole_with_the_native_loops(method, causal):
    """Without a padding mask the fast paths run their C++ loops (operators with fake
    implementations, ``torch.ops.sharpattn``): captured in the graph, forward and backward,
    and the same numbers as eager."""
    from sharpattn.attention.cpu import native

    q, k, v, _ = _inputs()
    params = _params(method)
    seen: set[str] = set()

    def backend(gm, _inputs):
        for mod in gm.modules():  # the autograd Functions' bodies are submodules
            graph = getattr(mod, "graph", None)
            seen.update(str(n.target) for n in getattr(graph, "nodes", ()))
        return gm.forward

    def run(q, k, v, mask, params, check_finite=False):
        return attend(
            q, k, v, method, causal=causal, impl="fused", check_finite=check_finite, **params
        )

    torch._dynamo.reset()
    what = f"attend({method!r}, impl='fused', causal={causal}) without a mask"
    try:
        got = _forward_backward(
            torch.compile(run, fullgraph=True, backend=backend), q, k, v, None, params
        )
    except torch._dynamo.exc.TorchDynamoException as err:
        pytest.fail(_broke(what, err))
    want = _forward_backward(lambda *a: run(*a, check_finite=True), q, k, v, None, params)
    _close(got, want, what)
    if native.library() is not None and method in LOOPS:
        called = {name.split(".")[1] for name in seen if name.startswith("sharpattn.")}
        assert LOOPS[method] <= called, f"{what}: the graph calls {sorted(called)}"


@pytest.mark.parametrize("method", [m for m in nz.available() if nz.get(m).fused])
def test_fast_path_statistics_compile_whole(method):
    """``return_stats=True`` on each fast path (its own entropy and mass code) in one graph."""
    q, k, v, mask = _inputs()

    def run(q, k, v, mask, check_finite=False):
        out, stats = attend(
            q,
            k,
            v,
            method,
            mask=mask,
            causal=True,
            impl="fused",
            return_stats=True,
            check_finite=check_finite,
        )
        return out, stats.entropy, stats.mass

    torch._dynamo.reset()
    try:
        got = torch.compile(run, fullgraph=True, backend="eager")(q, k, v, mask)
    except torch._dynamo.exc.TorchDynamoException as err:
        pytest.fail(_broke(f"attend({method!r}, impl='fused', return_stats=True)", err))
    want = run(q, k, v, mask, check_finite=True)
    for name, g, w in zip(("output", "entropy", "mass"), got, want, strict=True):
        assert_close(g, w, n=LK, msg=f"attend({method!r}, fused) stats: {name}")


@pytest.mark.parametrize(
    ("method", "impl", "params"),
    [
        ("softmax", "fused", {"temperature": torch.tensor([0.5, 1.0, 2.0, 4.0]).view(1, H, 1, 1)}),
        ("softmax", "naive", {"temperature": torch.tensor([0.5, 1.0, 2.0, 4.0]).view(1, H, 1, 1)}),
        (
            "entmax",
            "chunked",
            {"alpha": torch.tensor([1.2, 1.5, 1.8, 2.0]).view(1, H, 1, 1), "n_iter": 8},
        ),
    ],
    ids=["softmax-fused-theta", "softmax-naive-theta", "entmax-chunked-alpha"],
)
def test_tensor_parameters_are_not_read_on_the_host(method, impl, params):
    """θ > 0 and α > 1 are checked only with check_finite=True (reading a tensor's values)."""
    q, k, v, mask = _inputs()

    def run(q, k, v, mask, params, check_finite=False):
        return attend(
            q,
            k,
            v,
            method,
            mask=mask,
            causal=True,
            impl=impl,
            block_size=BLOCK,
            check_finite=check_finite,
            **params,
        )

    what = f"attend({method!r}, impl={impl!r}) with tensor {', '.join(params)}"
    _compiled_equals_eager(run, what, q, k, v, mask, params)
    bad = {
        n: -p if torch.is_tensor(p) else p for n, p in params.items()
    }  # θ < 0, α < 1: still refused when checked
    with pytest.raises(
        ValueError, match=r"parameter (temperature|alpha) must be a (finite )?number (>|in) "
    ):
        run(q, k, v, mask, bad, check_finite=True)


NUMBER_PARAMS = {
    m: [p.name for p in nz.get(m).params if p.value_kind == "real" and p.default is not None]
    for m in nz.available()
}


@pytest.mark.parametrize("method", [m for m, names in NUMBER_PARAMS.items() if names])
def test_number_parameters_given_to_the_compiled_function_are_checked_in_the_graph(method):
    """Python numbers are validated whatever check_finite is; passed into the compiled function
    (from the second set of values on, torch.compile traces a float argument as a SymFloat) the
    check is no graph break."""
    q, k, v, mask = _inputs()
    names = NUMBER_PARAMS[method]
    values = [float(p.default) for p in nz.get(method).params if p.name in names]

    def run(q, k, v, *numbers):
        return attend(
            q,
            k,
            v,
            method,
            mask=mask,
            causal=True,
            check_finite=False,
            **dict(zip(names, numbers, strict=True)),
        )

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="eager")
    for numbers in (values, [x * 1.1 + 0.1 for x in values]):  # the second: SymFloats
        try:
            got = compiled(q, k, v, *numbers)
        except torch._dynamo.exc.TorchDynamoException as err:
            pytest.fail(_broke(f"attend({method!r}) with number arguments {names}", err))
        assert_close(got, run(q, k, v, *numbers), n=LK, msg=f"attend({method!r}) {numbers}")


@pytest.mark.parametrize("method", ["softmax", "adaptive", "sigmoid", "asentmax"])
def test_multihead_attention_compiles_whole(method):
    """MultiheadAttention (GQA, causal, padding; asentmax with its query-dependent β, γ), forward
    and backward through its parameters, equals eager."""
    torch.manual_seed(0)
    layer = MultiheadAttention(16, H, method, num_kv_heads=HKV, causal=True, check_finite=False)
    with torch.no_grad():  # query-dependent maps start at 0: make them count
        for proj in layer.normalizer_projections.values():
            proj.weight.normal_(0.0, 0.3)
    x = torch.randn(B, LK, 16)
    key_mask = torch.ones(B, LK, dtype=torch.bool)
    key_mask[1, :2] = False

    def step(fn):
        layer.zero_grad()
        out = fn(x, key_mask=key_mask)
        out.pow(2).sum().backward()
        return out.detach(), [
            torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in layer.parameters()
        ]

    torch._dynamo.reset()
    try:
        got = step(torch.compile(layer, fullgraph=True, backend="eager"))
    except torch._dynamo.exc.TorchDynamoException as err:
        pytest.fail(_broke(f"MultiheadAttention({method!r})", err))
    want = step(layer)
    assert_close(got[0], want[0], n=LK * 16, msg=f"MultiheadAttention({method!r}): output")
    grads = {name: r for (name, _), r in zip(layer.named_parameters(), want[1], strict=True)}
    for (name, _), g, r in zip(layer.named_parameters(), got[1], want[1], strict=True):
        # a bias's gradient sums the per-position terms that its weight's gradient sums times
        # inputs of order 1, so their size is its magnitude: for the key bias under a
        # shift-invariant map (softmax, entmax) that sum is 0 exactly, and only rounding is left
        weight = grads.get(name.removesuffix("bias") + "weight") if name.endswith("bias") else None
        mag = float(r.abs().max()) if weight is None else float(weight.abs().max())
        assert_close(
            g,
            r,
            n=B * LK * 16,
            magnitude=max(mag, float(r.abs().max())),
            msg=f"MultiheadAttention({method!r}): grad of {name}",
        )


@pytest.mark.parametrize("method", ["softmax", "asentmax"])
def test_tiny_llama_compiles_whole(method):
    """A Hugging Face Llama after ``hf.apply(model, method, check_finite=False)``: the whole
    forward (transformers' own code included, with a padding mask) is one graph."""
    pytest.importorskip("transformers")
    import tiny_hf
    from sharpattn import hf

    torch.manual_seed(0)
    model = tiny_hf.llama().eval()
    hf.apply(model, method, check_finite=False)
    ids = torch.randint(0, 97, (B, LK))
    attention_mask = torch.ones(B, LK, dtype=torch.long)
    attention_mask[1, :2] = 0

    def forward(ids, attention_mask):
        return model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = torch.compile(forward, fullgraph=True, backend="eager")(ids, attention_mask)
    except torch._dynamo.exc.TorchDynamoException as err:
        pytest.fail(_broke(f"tiny Llama with sharpattn:{method}", err))
    with torch.no_grad():
        want = forward(ids, attention_mask)
    assert_close(got, want, n=32 * LK, msg=f"tiny Llama with sharpattn:{method}")


def _cxx() -> str | None:
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


@pytest.mark.skipif(_cxx() is None, reason="inductor needs a C++ compiler")
def test_softmax_compiles_with_inductor():
    """One real compile (the default inductor backend) of the fused softmax path, forward."""
    q, k, v, mask = _inputs()

    def run(q, k, v, mask):
        return attend(q, k, v, "softmax", mask=mask, causal=True, check_finite=False)

    torch._dynamo.reset()
    got = torch.compile(run, fullgraph=True)(q, k, v, mask)
    assert_close(got, run(q, k, v, mask), n=LK, msg="inductor softmax")


@pytest.mark.skipif(_cxx() is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("method", ["softpick", "sparsemax"])
def test_native_loops_compile_with_inductor(method):
    """One real compile of a path whose C++ loops write their tiles in place (operators with
    declared mutations, functionalised by Inductor), forward and backward."""
    q, k, v, _ = _inputs()

    def run(q, k, v, mask, params, check_finite=False):
        return attend(q, k, v, method, causal=True, impl="fused", check_finite=check_finite)

    torch._dynamo.reset()
    got = _forward_backward(torch.compile(run, fullgraph=True), q, k, v, None, {})
    _close(got, _forward_backward(run, q, k, v, None, {}), f"inductor {method}")


# ---------------------------------------------------------------------------------------------
# A user's method of every family (its hooks plain module-level functions, as a plug-in's are)


def _grown_beta(n, gamma=0.5, **_):
    return 1.0 + gamma * torch.log(n.clamp_min(1.0))


def _entropy_beta(h, a=0.4, **_):
    return 1.0 + a * h


def _tanh_sink(n, strength=0.5, **_):
    return strength * torch.tanh(torch.log(n.clamp_min(1.0)))


def _softplus_f(s, r):
    return torch.nn.functional.softplus(s + r)


def _shift_row(n, bias=0.0, **_):
    return bias - torch.log(n.clamp_min(1.0))


def _softplus_u(s, m):
    return torch.nn.functional.softplus(s - m)


def _two(**_):
    return 2


def _alpha_125(**_):
    return 1.25


def _grown_theta(n, gamma=0.5, **_):
    return 1.0 + torch.nn.functional.softplus(gamma) * torch.log(n.clamp_min(1.0))


def _user_families():
    from sharpattn.normalizers import families as fam

    learn = {
        "gamma": nz.Param("gamma", 0.5, "γ", learnable=True),
        "a": nz.Param("a", 0.4, "a", learnable=True),
        "strength": nz.Param("strength", 0.5, "a", learnable=True),
        "bias": nz.Param("bias", 0.0, "b", learnable=True),
    }
    table = {
        "row_scaled": (fam.RowScaled(_grown_beta), ("gamma",)),
        "adaptive": (fam.Adaptive(_entropy_beta), ("a",)),
        "sink": (fam.Sink(_tanh_sink), ("strength",)),
        "elementwise": (fam.Elementwise(_softplus_f, _shift_row), ("bias",)),
        "row_normalised": (fam.RowNormalised(_softplus_u, ref=torch.relu), ()),
        "top_k": (fam.TopK(_two), ()),
        "sparse": (fam.Sparse(_alpha_125, scale=_grown_theta), ("gamma",)),
        "stick_breaking": (fam.StickBreaking(), ()),
    }
    return {
        name: nz.Normalizer(
            f"test_compile_{name}",
            family.weights,
            "-",
            "-",
            False,
            params=tuple(learn[p] for p in params),
            family=family,
        )
        for name, (family, params) in table.items()
    }


USER_FAMILIES = _user_families()


@pytest.mark.parametrize("impl", ["naive", "chunked", "fused"])
@pytest.mark.parametrize("family", list(USER_FAMILIES))
def test_a_user_method_of_every_family_compiles_whole(register_normalizer, family, impl):
    """A user's method of each family (learnable parameters as per-head tensors) compiles with
    ``fullgraph=True``, forward and backward, on every path, and equals eager: the generic tile
    runners differentiate a user's map with ``torch.func.vjp``, which dynamo traces."""
    method = register_normalizer(USER_FAMILIES[family])
    q, k, v, mask = _inputs()
    params = _params(method)
    causal = True  # stick-breaking is causal only; the others take the same mask

    run = _attend_with(method, impl, causal)

    _compiled_equals_eager(run, f"attend({method!r}, impl={impl!r})", q, k, v, mask, params)
