"""``attend(..., check_finite=False)`` never makes the host wait for the device: every registered
method on every path (auto: the fast path, Triton on CUDA; chunked; naive), forward and
backward, learnable per-head parameters as tensors, and `MultiheadAttention`.

* On a GPU (``SHARPATTN_TEST_DEVICE=cuda``): ``torch.cuda.set_sync_debug_mode("error")`` around
  each call after one warm-up call (the first may legitimately synchronise: lazy
  initialisation, Triton's compiler), bfloat16 and float32.
* On the CPU: `host_sync.NoHostSync`, a ``TorchFunctionMode`` that refuses what would
  synchronise on CUDA (host reads, blocking host-device copies, host data put on a device) —
  on the CPU's own paths, and on the CUDA branches (the Triton kernels in Triton's interpreter,
  torch's SDPA instead of the CPU flash kernel, no C++ loops) with ``cuda_like`` also refusing
  host tensors that would meet device tensors. See tests/host_sync.py for what it can and
  cannot see.

The rule for a Python number: pass it as a kernel argument (a Triton scalar), keep it a Python
number in arithmetic (``t * 0.5``), or make it a tensor with ``torch.full(shape, x, dtype=,
device=)`` (a fill kernel); never ``torch.as_tensor`` / ``torch.tensor`` to a device.
"""

from __future__ import annotations

import contextlib
import functools
import types

import pytest
import torch

from devices import DEVICE
from host_sync import HostSyncError, NoHostSync, backward
from sharpattn import normalizers as nz
from sharpattn.attention import MultiheadAttention, attend, devices
from sharpattn.attention.cpu import fused
from sharpattn.normalizers.families import RowScaled

METHODS = nz.available()
IMPLS = ("auto", "chunked", "naive")
#: per-head values of the learnable parameters, near their defaults (first two heads used)
PER_HEAD = {
    "s": (0.3, 0.6),
    "c": (0.2, 0.5),
    "bias": (0.5, -0.5),
    "bias_log_n": (0.3, -0.2),
    "beta_pre": (0.3, -0.5),
    "gamma_pre": (0.2, -0.3),
}
#: numbers other than the defaults where a number takes another branch than the default
NUMBERS = {
    "softmax": {"temperature": 0.5},
    "sink": {"bias": 0.5, "bias_log_n": 0.25},
    "sigmoid": {"bias": 0.5},
    "relu": {"p": 2.0},
    "power": {"p": 2.0},
    "entmax": {"alpha": 1.3},
    "asentmax": {"beta_pre": 0.3, "gamma_pre": -0.5},
    "stick_breaking": {"shift": 0.5, "shift_log_position": -1.0},
    "ssmax": {"s": 0.6},
    "length_scaled": {"c": 0.5},
    "topk": {"top_k": 3},
}


def _causal(method: str) -> bool:
    return method == "stick_breaking"  # causal only


def _params(method: str, kind: str, h: int, dtype, device) -> dict:
    """``kind``: "default" (no parameters), "numbers" (`NUMBERS`), "tensors" (every learnable
    parameter per head ``[1, H, 1, 1]``, requiring grad, as MultiheadAttention passes them)."""
    if kind == "numbers":
        return dict(NUMBERS.get(method, {}))
    if kind == "default":
        return {}
    params = {}
    for p in nz.get(method).learnable:
        values = (PER_HEAD[p.name] * h)[:h]
        params[p.name] = torch.tensor(values, dtype=dtype).view(1, h, 1, 1).to(device)
        params[p.name].requires_grad_()
    return params


def _kinds(method: str) -> list[str]:
    kinds = ["default"]
    if method in NUMBERS:
        kinds.append("numbers")
    if nz.get(method).learnable:
        kinds.append("tensors")
    return kinds


def _inputs(b, h, n, d, dtype, device, seed=0, masked=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    mask = None
    if masked:  # padding: the last keys of batch 0 hidden
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
        mask[0, ..., n - 3 :] = False
        mask = mask.to(device)
    return q, k, v, mask


def _run(method, impl, q, k, v, mask, causal, params):
    """attend forward and backward (to q, k, v and the tensor parameters)."""
    out = attend(q, k, v, method, mask=mask, causal=causal, impl=impl, check_finite=False, **params)
    leaves = [q, k, v, *(p for p in params.values() if torch.is_tensor(p))]
    loss = (out.float() * 0.5).sum()
    return backward(loss, leaves)


# ---------------------------------------------------------------------------------------------
# On the GPU: CUDA's own sync detector


cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="set SHARPATTN_TEST_DEVICE=cuda to run")


@contextlib.contextmanager
def _sync_errors():
    """``torch.cuda.set_sync_debug_mode("error")`` for the block, the previous mode restored."""
    torch.cuda.synchronize()  # the warm-up's work done: nothing pending to wait for
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", METHODS)
def test_no_host_sync_on_cuda(method, impl, dtype):
    """B 1, H 2, n 64, D 16; no mask (causal for stick-breaking), and causal with padding; every
    kind of parameter; one warm-up call, then forward and backward under the sync detector."""
    for kind in _kinds(method):
        params = _params(method, kind, 2, dtype, DEVICE)
        for masked in (False, True):
            q, k, v, mask = _inputs(1, 2, 64, 16, dtype, DEVICE, masked=masked)
            causal = _causal(method) or masked
            _run(method, impl, q, k, v, mask, causal, params)  # warm-up: may synchronise
            try:
                with _sync_errors():
                    _run(method, impl, q, k, v, mask, causal, params)
            except RuntimeError as err:
                raise AssertionError(f"{method} {impl} {kind} masked={masked}: {err}") from err


#: MultiheadAttention's options to run (each with a padding mask)
LAYERS = {
    "plain": {},
    "alibi": {"alibi": "alibi"},
    "rotary_gate": {"rotary": True, "gate": "headwise"},
    "selective": {"selective": "qv"},
}
LAYER_METHODS = ("softmax", "sink", "sigmoid", "asentmax", "stick_breaking", "entmax15")


def _layer_step(method, options, dtype, device):
    """``step()``: a causal layer's forward (padding in batch 1) and backward through every
    parameter."""
    torch.manual_seed(0)
    layer = MultiheadAttention(16, 2, method, causal=True, check_finite=False, **options)
    layer = layer.to(device, dtype)
    x = torch.randn(2, 24, 16).to(device, dtype)
    key_mask = torch.ones(2, 24, dtype=torch.bool)
    key_mask[1, :3] = False
    key_mask = key_mask.to(device)
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        out = layer(x, key_mask=key_mask)
        return backward((out.float() * 0.5).sum(), params)

    return step


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("options", LAYERS)
@pytest.mark.parametrize("method", LAYER_METHODS)
def test_multihead_attention_no_host_sync_on_cuda(method, options, dtype):
    step = _layer_step(method, LAYERS[options], dtype, DEVICE)
    step()  # warm-up: may synchronise
    try:
        with _sync_errors():
            step()
    except RuntimeError as err:
        raise AssertionError(f"MultiheadAttention({method!r}, {options}): {err}") from err


# ---------------------------------------------------------------------------------------------
# On the CPU: NoHostSync, on the CPU's paths and on the CUDA branches


cpu = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's guard (on a GPU: the tests above)")


def _guarded(fn):
    """``fn()`` once unguarded (warm-up: the C++ loops' build, lazy imports), then under
    `NoHostSync`."""
    fn()
    with NoHostSync():
        return fn()


@cpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", METHODS)
def test_no_host_sync_on_the_cpu_paths(method, impl):
    """Every method, path and kind of parameter, float32, causal and not, a padding mask or
    none (the CPU's own fast paths: the flash kernel, the C++ loops)."""
    for kind in _kinds(method):
        params = _params(method, kind, 2, torch.float32, "cpu")
        for masked, causal in ((False, True), (True, _causal(method))):
            q, k, v, mask = _inputs(1, 2, 24, 8, torch.float32, "cpu", masked=masked)
            try:
                _guarded(functools.partial(_run, method, impl, q, k, v, mask, causal, params))
            except HostSyncError as err:
                raise AssertionError(f"{method} {impl} {kind} masked={masked}: {err}") from err


@cpu
@pytest.mark.parametrize("grad", [False, True], ids=["alpha", "learnable-alpha"])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_tensor_alpha_is_not_read_on_the_cpu_paths(impl, grad):
    """entmax's α per head (not a learnable Param, so not among the kinds above), at the ends of
    its range [1.01, 2.5]: with check_finite=False neither its range nor its path (tiles for
    any tensor, query blocks for one that requires grad) is decided by reading it."""
    alpha = torch.tensor([1.01, 2.5]).view(1, 2, 1, 1).requires_grad_(grad)
    q, k, v, _ = _inputs(1, 2, 24, 8, torch.float32, "cpu")

    def run():
        out = attend(q, k, v, "entmax", causal=True, impl=impl, check_finite=False, alpha=alpha)
        return backward(out.sum(), [q, k, v, alpha] if grad else [q, k, v])

    try:
        _guarded(run)
    except HostSyncError as err:
        raise AssertionError(f"entmax {impl} tensor alpha: {err}") from err


@pytest.fixture
def cuda_branches(monkeypatch):
    """The CUDA branches on CPU tensors: the Triton kernels (in Triton's interpreter, small
    blocks), torch's SDPA where CUDA has no CPU flash kernel, no C++ loops; the guard paused
    while the interpreter runs a kernel (it copies tensors to NumPy and back)."""
    pytest.importorskip("triton")
    from sharpattn.attention.cpu import native
    from sharpattn.attention.triton import template as kernels

    if type(kernels._forward_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    from triton.runtime.interpreter import InterpretedFunction

    def ready(device, dtype):
        return dtype in (torch.float32, torch.float16)

    monkeypatch.setattr(devices, "triton_ready", ready)  # the one readiness check
    monkeypatch.setattr(kernels, "BLOCKS_16BIT", (16, 32))
    monkeypatch.setattr(kernels, "BLOCKS_FLOAT32", (16, 32))
    monkeypatch.setattr(fused, "flash_available", lambda q, v: False)
    monkeypatch.setattr(native, "wanted", lambda device, dtype: False)
    state = types.SimpleNamespace(guards=[], launches=[])
    run = InterpretedFunction.run

    def paused_run(self, *args, **kwargs):
        state.launches.append(self.fn.__name__)
        with contextlib.ExitStack() as stack:
            for guard in state.guards:
                stack.enter_context(guard.pause())
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", paused_run)
    return state


@cpu
@pytest.mark.parametrize("method", METHODS)
def test_no_host_sync_on_the_cuda_branches(method, cuda_branches):
    """The fast path of every method on the branches a CUDA tensor takes (Triton kernels in the
    interpreter; the softmax family's query scaling: SDPA), every kind of parameter, causal with
    a padding mask and neither (stick-breaking: causal), float32."""
    for kind in _kinds(method):
        params = _params(method, kind, 2, torch.float32, "cpu")
        for masked, causal in ((True, True), (False, _causal(method))):
            q, k, v, mask = _inputs(1, 2, 20, 8, torch.float32, "cpu", masked=masked)
            fn = functools.partial(_run, method, "auto", q, k, v, mask, causal, params)
            fn()  # warm-up
            guard = NoHostSync(cuda_like=True)
            cuda_branches.guards.append(guard)
            try:
                with guard:
                    fn()
            except HostSyncError as err:
                what = f"{method} auto (CUDA branches) {kind} masked={masked}"
                raise AssertionError(f"{what}: {err}") from err
            finally:
                cuda_branches.guards.remove(guard)
    if not isinstance(nz.get(method).family, RowScaled):  # the others: Triton's
        assert cuda_branches.launches, f"{method}: no Triton kernel ran"


@cpu
@pytest.mark.parametrize("options", LAYERS)
@pytest.mark.parametrize("method", LAYER_METHODS)
def test_multihead_attention_no_host_sync_on_the_cpu(method, options):
    step = _layer_step(method, LAYERS[options], torch.float32, "cpu")
    try:
        _guarded(step)
    except HostSyncError as err:
        raise AssertionError(f"MultiheadAttention({method!r}, {options}): {err}") from err


@cpu
@pytest.mark.parametrize("options", LAYERS)
def test_multihead_attention_no_host_sync_on_the_cuda_branches(options, cuda_branches):
    """MultiheadAttention on the CUDA branches (sigmoid: a Triton kernel with a learnable bias)."""
    step = _layer_step("sigmoid", LAYERS[options], torch.float32, "cpu")
    step()  # warm-up
    guard = NoHostSync(cuda_like=True)
    cuda_branches.guards.append(guard)
    try:
        with guard:
            step()
    except HostSyncError as err:
        raise AssertionError(f"MultiheadAttention('sigmoid', {options}): {err}") from err
    finally:
        cuda_branches.guards.remove(guard)
    assert cuda_branches.launches, "no Triton kernel ran"


@cpu
def test_the_guard_refuses_what_synchronises():
    """The guard itself: each refused call raises, the allowed ones do not."""
    t = torch.randn(3)
    refused = [
        lambda: t.sum().item(),
        lambda: bool(t[0] > 0),
        lambda: float(t[0]),
        lambda: t.nonzero(),
        lambda: t[t > 0],
        lambda: t.tolist(),
        lambda: torch.as_tensor(0.5, device=t.device),
        lambda: torch.tensor([1.0, 2.0], device=t.device),
        lambda: torch.tensor([1.0]).to(t.device),
        lambda: torch.full((2,), t[0]),
        lambda: t.cpu(),
        lambda: t.to("cpu"),
        lambda: torch.where(t > 0),
        lambda: t.repeat_interleave(torch.tensor([1, 2, 0])),
        lambda: t.masked_fill(t > 0, t[0]),
    ]
    for i, fn in enumerate(refused):
        with pytest.raises(HostSyncError), NoHostSync():
            fn()
            pytest.fail(f"refused[{i}] passed")
    with NoHostSync():  # allowed
        torch.full((2,), 0.5, device=t.device)
        t * 0.5
        torch.tensor([1.0, 2.0])  # stays on the host
        torch.tensor([1.0]).to(t.device, non_blocking=True)
        torch.where(t > 0, t, 0.0)
        t.masked_fill(t > 0, 0.5)
    with pytest.raises(HostSyncError), NoHostSync(cuda_like=True):
        t + torch.zeros(3)  # a host tensor meets a device one
    with NoHostSync(cuda_like=True):
        t + torch.tensor(2.0)  # a 0-dim CPU scalar: a kernel argument on CUDA
