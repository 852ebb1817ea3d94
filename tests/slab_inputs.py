"""Inputs for the slab paths' tests (tests/paths/test_sparse_tiled.py, test_adaptive_tiled.py):
float64 q, k, v that require grad, and the masks that break slabs (a padding mask that leaves one
key, a per-row mask with an empty row)."""

from __future__ import annotations

import torch


def qkv(b=2, h=4, hkv=2, lq=5, lk=7, d=3, dv=4, dtype=torch.float64, gain=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = gain * torch.randn(b, h, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, dv, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def masks(kind, b, h, lq, lk, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind == "pad":
        m = torch.rand(b, 1, 1, lk, generator=g) > 0.3
        m[0, ..., :] = False  # batch 0 sees one key only
        m[0, ..., 2] = True
        return m
    if kind == "row":
        m = torch.rand(b, h, lq, lk, generator=g) > 0.4
        m[:, :, 1] = False  # an empty row
        return m
    return None
