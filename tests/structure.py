"""The dense mask of `attend`'s structure keywords, built from their definitions (for the suites
that hold the structure against an explicit mask: tests/paths/test_structure.py and the
adversarial suite)."""

from __future__ import annotations

import torch


def explicit_mask(lq, lk, b, *, causal=False, ids=None, window=None, lengths=None):
    """The dense mask of the structure keywords, from `attend`'s definitions."""
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)
    p = i + (lk - lq)
    m = torch.ones(b, 1, lq, lk, dtype=torch.bool)
    if causal:
        m &= j <= p
    if window is not None:
        left, right = window
        if left is not None:
            m &= j >= p - left
        if right is not None:
            m &= j <= p + right
    if lengths is not None:
        if lengths.dim() == 1:
            lengths = torch.stack([torch.zeros_like(lengths), lengths], -1)
        m &= (j >= lengths[:, 0, None, None, None]) & (j < lengths[:, 1, None, None, None])
    if ids is not None and lk > 0:
        ids = ids.expand(b, lk)
        own = ids[:, p[:, 0].clamp(0, max(lk - 1, 0))]  # (B, Lq): the query's document
        m &= ((own[:, :, None] == ids[:, None, :]) & (p >= 0)).unsqueeze(1)
    return m
