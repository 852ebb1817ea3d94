"""What the Triton decoding tests share (tests/paths/test_triton_decoding.py for the template's
maps, test_triton_decoding_rules.py for stick-breaking, top-k and the entmax family): the
cases' inputs, the route to the kernels with small blocks, forcing the split, and running a
method on the fast or the naive path with its gradients. The kernel modules come from here
too, imported after the skip.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``); a test module importing this one is skipped where triton is missing or
was imported without it.
"""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE

pytest.importorskip("triton", reason="the Triton kernels need triton (the gpu or dev extra)")

from sharpattn import normalizers as nz  # noqa: E402
from sharpattn.attention import attend, devices  # noqa: E402
from sharpattn.attention import triton as KERNELS  # noqa: E402, F401
from sharpattn.attention.dispatch.fast import path_of  # noqa: E402
from sharpattn.attention.masking import Masking  # noqa: E402
from sharpattn.attention.triton import sparse as SPARSE  # noqa: E402, F401
from sharpattn.attention.triton import stick as STICK  # noqa: E402, F401
from sharpattn.attention.triton import template as TEMPLATE  # noqa: E402
from sharpattn.attention.triton import topk as TOPK  # noqa: E402, F401

if DEVICE.type == "cpu" and type(TEMPLATE._forward_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)",
        allow_module_level=True,
    )

#: the interpreter's bfloat16 products are wrong: bfloat16 on a GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
BLOCKS = (16, 16)  # query rows, keys per block: a split per block

# name: (B, H, Hkv, Lq, Lk, D, Dv, mask, causal)
CASES = {
    "lq1": (1, 4, 2, 1, 70, 8, 5, None, False),  # GQA, Dv != D, a last block of 6 keys
    "lq3_causal_pad": (2, 4, 2, 3, 61, 8, 5, "pad", True),  # batch 1 all padding: empty rows
    "lq16_causal": (1, 2, 2, 16, 40, 16, 16, None, True),  # the last split: rows >= 8 only
    "lq16_rows": (1, 4, 2, 16, 50, 8, 5, "rows", True),  # row 4 empty
    "lq3_2d": (1, 2, 1, 3, 64, 8, 12, "2d", False),
    "lq3_hole": (1, 2, 2, 3, 64, 8, 5, "hole", False),  # keys 16-47 hidden: whole splits empty
    # 4 keys repeated: every score tied 16 times, 4 times in each split of 16 keys, so the top
    # k's ties at τ span splits and are taken in key order
    "lq3_ties": (1, 2, 2, 3, 64, 8, 5, "ties", False),
    # q, k and v as [B, L, H, D] memory seen as [B, H, L, D] (no unit stride along L)
    "lq3_layout": (1, 4, 2, 3, 64, 8, 8, "layout", True),
}
#: the per-head values of a method's tensor parameters (the first H of them)
TENSORS = {
    "alpha": [1.2, 2.0, 1.5, 2.4],
    "beta_pre": [0.3, -0.5, 1.2, 0.0],
    "bias": [0.3, -0.5, 1.2, 0.0],
}


def inputs(case: str, dtype: torch.dtype, seed: int = 0):
    """(q, k, v, mask, causal) of ``CASES[case]`` in ``dtype``, leaves requiring grad."""
    b, h, hkv, lq, lk, d, dv, kind, causal = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g)
    if kind == "layout":
        q, k = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k))
    if kind == "ties":
        k = k[:, :, :4].repeat(1, 1, lk // 4, 1)
    v = torch.randn(b, hkv, lk, dv, generator=g)
    if kind == "layout":
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    mask = None
    if kind == "pad":
        mask = torch.rand(b, 1, 1, lk, generator=g) < 0.7
        mask[1] = False
    elif kind == "rows":
        mask = torch.rand(b, h, lq, lk, generator=g) < 0.6
        mask[:, :, 4] = False
    elif kind == "2d":
        mask = torch.rand(lq, lk, generator=g) < 0.6
    elif kind == "hole":
        mask = torch.ones(1, 1, 1, lk, dtype=torch.bool)
        mask[..., 16:48] = False
    q, k, v = (t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v))
    if kind == "layout":
        assert all(t.stride(2) != t.shape[-1] for t in (q, k, v))
    return q, k, v, (mask if mask is None else mask.to(DEVICE)), causal


def on_triton(monkeypatch, modules) -> list[int]:
    """The fast paths take the Triton kernels for the CPU tensors (but float64), as in
    tests/paths/test_triton.py, with ``BLOCKS``; returns the list of the split counts of every
    `_split_forward` of ``modules`` that ran (each takes its split count last)."""
    monkeypatch.setattr(devices, "triton_ready", lambda device, dtype: dtype != torch.float64)
    monkeypatch.setattr(TEMPLATE, "BLOCKS_16BIT", BLOCKS)
    monkeypatch.setattr(TEMPLATE, "BLOCKS_FLOAT32", BLOCKS)
    splits: list[int] = []
    for module in modules:
        real = module._split_forward

        def recorded(*args, _real=real):
            splits.append(args[-1])
            return _real(*args)

        monkeypatch.setattr(module, "_split_forward", recorded)
    return splits


def force_split(monkeypatch, on: bool = True):
    """Small shapes split (every key block its own split, up to 64 programs), or nothing does."""
    monkeypatch.setattr(TEMPLATE, "SPLIT_MIN_LK", 32 if on else 10**9)
    monkeypatch.setattr(TEMPLATE, "SPLIT_MIN_BLOCKS", 1)
    monkeypatch.setattr(TEMPLATE, "SPLIT_PROGRAMS", 64)


def params_of(params: dict, h: int, dtype: torch.dtype) -> dict:
    """``params`` with each ``"tensor"`` value a per-head leaf in ``dtype`` (`TENSORS`)."""
    out = dict(params)
    for key, value in out.items():
        if value == "tensor":
            x = torch.tensor(TENSORS[key][:h], dtype=dtype, device=DEVICE)
            out[key] = x.view(1, h, 1, 1).requires_grad_()
    return out


def run(method, q, k, v, mask, causal, params, naive=False, blocks=BLOCKS):
    """(output, gradients of q, k, v and of the tensor parameters; zeros where the output does
    not depend on one, as hardmax's dq and dk) for a fixed output gradient: the fast path (the
    kernels; stick-breaking with ``blocks``) or the naive path."""
    if naive:
        out = attend(q, k, v, method, mask=mask, causal=causal, impl="naive", **params)
    else:
        masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
        scale = q.shape[-1] ** -0.5
        if method == "stick_breaking":
            params = dict(params, blocks=blocks)
        out, stats = path_of(nz.get(method))(q, k, v, masking, scale, False, **params)
        assert stats is None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    leaves = [q, k, v] + [x for x in params.values() if torch.is_tensor(x)]
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads, strict=True)]
    return out.detach(), grads


def copies(dtype, q, k, v, params):
    """Fresh leaves of q, k, v in ``dtype`` and of the tensor parameters (float64 with a
    float64 ``dtype``, else their own)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    own = {
        n: x.detach().to(dtype if dtype == torch.float64 else x.dtype).requires_grad_()
        if torch.is_tensor(x)
        else x
        for n, x in params.items()
    }
    return leaves, own


def visible(mask, causal, q, k) -> torch.Tensor:
    """[B, H, Lq]: whether each query row sees a key."""
    masking = Masking.build(mask, causal, q.shape[2], k.shape[2], q.device)
    n = masking.visible_keys().expand(q.shape[0], q.shape[1], q.shape[2], 1)
    return n[..., 0] > 0
