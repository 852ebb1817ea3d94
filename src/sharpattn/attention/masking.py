"""Which keys each query sees, without materialising an ``[Lq, Lk]`` matrix unless asked to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Masking:
    """A user mask and the causal flag, kept apart so fused paths never build the causal matrix.

    ``mask``: boolean, 4-d, broadcastable to ``[B, H, Lq, Lk]`` (True = may attend) or None.
    ``causal``: query i sees keys j <= i + (Lk − Lq) (bottom-right aligned, as ``causal_mask``).
    """

    mask: Tensor | None
    causal: bool
    lq: int
    lk: int
    device: torch.device

    @classmethod
    def build(cls, mask: Tensor | None, causal: bool, lq: int, lk: int, device) -> Masking:
        if mask is not None and mask.dim() < 4:
            mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        return cls(mask, bool(causal), lq, lk, torch.device(device))

    @property
    def offset(self) -> int:
        """Lk − Lq: how many more keys than queries (the causal diagonal's shift)."""
        return self.lk - self.lq

    @property
    def per_row(self) -> bool:
        """True when the user mask differs between queries (its query dimension is not 1)."""
        return self.mask is not None and self.mask.shape[-2] != 1

    def rows(self, r0: int, r1: int) -> Tensor | None:
        """The dense boolean mask of query rows [r0, r1): ``[B|1, H|1, r1−r0 | 1, Lk]``."""
        m = self.mask
        if m is not None and self.per_row:
            m = m[..., r0:r1, :]
        if self.causal:
            i = torch.arange(r0, r1, device=self.device).unsqueeze(-1)
            c = torch.arange(self.lk, device=self.device) <= i + self.offset  # (r1−r0, Lk)
            m = c.view(1, 1, r1 - r0, self.lk) if m is None else m & c
        return m

    def dense(self) -> Tensor | None:
        """The whole combined mask (``[.., Lq, Lk]`` when causal or per-row): O(Lq·Lk) memory."""
        return self.rows(0, self.lq)

    def visible_keys(self, block: int = 1024, dtype: torch.dtype = torch.float32) -> Tensor:
        """n_i, the number of keys query i may attend to, as ``dtype`` ``[B|1, H|1, Lq|1, 1]``
        (counts are exact in float32 up to 2^24 keys; pass float64 for float64 maths).

        Computed without an ``[Lq, Lk]`` matrix: a count for padding masks, the position for causal
        masks, a cumulative count of the padding mask read at the causal edge for both. A per-row
        user mask is counted block by block (O(block·Lk) memory).
        """
        lq, lk, dev = self.lq, self.lk, self.device
        if lk == 0:
            return torch.zeros((1, 1, 1, 1), dtype=dtype, device=dev)
        if self.mask is None:
            if not self.causal:
                return torch.full((1, 1, 1, 1), float(lk), dtype=dtype, device=dev)
            last = torch.arange(lq, device=dev) + self.offset  # last visible key index
            return (last + 1).clamp(0, lk).to(dtype).view(1, 1, lq, 1)
        if not self.per_row:
            if not self.causal:
                return self.mask.sum(-1, keepdim=True, dtype=dtype)
            count = self.mask.cumsum(-1, dtype=dtype)  # (B|1, H|1, 1, Lk)
            last = torch.arange(lq, device=dev) + self.offset
            n = count[..., 0, :].index_select(-1, last.clamp(0, lk - 1))  # (B|1, H|1, Lq)
            return torch.where(last >= 0, n, 0.0).unsqueeze(-1)
        parts = [
            self.rows(r0, min(r0 + block, lq)).sum(-1, keepdim=True, dtype=dtype)
            for r0 in range(0, lq, block)
        ]
        if not parts:  # Lq = 0
            return torch.zeros((*self.mask.shape[:-2], 0, 1), dtype=dtype, device=dev)
        return torch.cat(parts, dim=-2)
