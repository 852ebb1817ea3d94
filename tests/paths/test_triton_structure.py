"""Packed documents and windows on the Triton kernels: the pieces a structured call is cut into
(``attention/pieces.py``: sliced q, k, v, band blocks with a small boolean mask) run through the
kernels as any call does. On the CPU in Triton's interpreter, float32 and float16 (routed as
tests/paths/test_triton.py does: `devices.triton_ready` says yes for CPU tensors but float64);
with ``SHARPATTN_TEST_DEVICE=cuda`` the compiled kernels run."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE
from precision import assert_close
from structure import explicit_mask

pytest.importorskip("triton", reason="the Triton kernels need triton (the gpu or dev extra)")

from sharpattn import attend  # noqa: E402
from sharpattn import normalizers as nz  # noqa: E402
from sharpattn.attention import devices  # noqa: E402
from sharpattn.attention import triton as KERNELS  # noqa: E402
from sharpattn.attention.triton import template as TEMPLATE  # noqa: E402

if DEVICE.type == "cpu" and type(TEMPLATE._forward_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)",
        allow_module_level=True,
    )

#: one method of each kernel family with Triton kernels: an element-wise map, a row-normalised
#: one, the softmax kernel (sink), the sparse maps, top-k, stick-breaking
METHODS = [
    m
    for m in ("sigmoid", "softpick", "sink", "entmax15", "topk", "stick_breaking")
    if m in nz.available()
]
DTYPES = [torch.float32, torch.float16]


ENTRIES = (
    "attention",
    "softmax_attention",
    "entmax_attention",
    "topk_attention",
    "stick_attention",
)


@pytest.fixture
def on_triton(monkeypatch):
    """Route CPU tensors to the kernels; returns the list of kernel entry points called."""
    monkeypatch.setattr(devices, "triton_ready", lambda device, dtype: dtype != torch.float64)
    monkeypatch.setattr(TEMPLATE, "BLOCKS_16BIT", (16, 16))
    monkeypatch.setattr(TEMPLATE, "BLOCKS_FLOAT32", (16, 16))
    called = []
    for name in ENTRIES:
        real = getattr(KERNELS, name)

        def record(*args, _real=real, _name=name, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(KERNELS, name, record)
    return called


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_packed_and_windowed_calls_on_the_kernels_equal_the_explicit_mask(on_triton, method, dtype):
    g = torch.Generator().manual_seed(0)
    b, h, hkv, n, d = 1, 2, 1, 20, 8
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    ids = torch.tensor([0] * 7 + [1] * 1 + [2] * 12)
    for kw in ({"documents": ids}, {"window": (5, 0)}, {"documents": ids, "window": (3, 0)}):
        m = explicit_mask(n, n, b, causal=True, ids=kw.get("documents"), window=kw.get("window"))
        ref = attend(q, k, v, method, mask=m, causal=True, impl="naive")
        low = [t.to(DEVICE, dtype) for t in (q, k, v)]
        on_triton.clear()
        got = attend(*low, method, causal=True, impl="fused", **kw)
        assert on_triton, f"{method} {kw}: no Triton kernel ran"
        assert_close(got.cpu(), ref, dtype=dtype, n=n, magnitude=4.0, ulps=64, msg=f"{kw}")
