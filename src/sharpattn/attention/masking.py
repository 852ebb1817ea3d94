"""Which keys each query sees, without materialising an ``[Lq, Lk]`` matrix unless asked to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..normalizers._contract import causal_rows, visible_keys

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

    def rows(self, r0: int, r1: int, key_end: int | None = None) -> Tensor | None:
        """The dense boolean mask of query rows [r0, r1) and keys [0, key_end) (default: every
        key): ``[B|1, H|1, r1−r0 | 1, key_end | 1]``."""
        m = self.mask
        key_end = self.lk if key_end is None else key_end
        if m is not None:
            if self.per_row:
                m = m[..., r0:r1, :]
            if m.shape[-1] != 1:
                m = m[..., :key_end]
        if self.causal:
            c = causal_rows(r0, r1, self.lq, self.lk, self.device)[:, :key_end]
            c = c.view(1, 1, r1 - r0, key_end)
            m = c if m is None else m & c
        return m

    def key_end(self, r1: int) -> int:
        """Keys [0, key_end) hold every key that query rows before r1 may see: with ``causal``,
        the last row's causal edge (at least one key, so no row is empty of keys unless Lk
        is); otherwise Lk."""
        if not self.causal:
            return self.lk
        return min(self.lk, max(1, r1 + self.offset))

    def dense(self) -> Tensor | None:
        """The whole combined mask (``[.., Lq, Lk]`` when causal or per-row): O(Lq·Lk) memory."""
        return self.rows(0, self.lq)

    def visible_keys(self, block: int = 1024, dtype: torch.dtype = torch.float32) -> Tensor:
        """n_i, the number of keys query i may attend to, as ``dtype`` ``[B|1, H|1, Lq|1, 1]``,
        without an ``[Lq, Lk]`` matrix (a per-row mask with ``causal`` is counted ``block`` rows
        at a time): `sharpattn.normalizers._contract.visible_keys`, where every n is
        counted."""
        return visible_keys(
            self.mask,
            self.lq,
            self.lk,
            causal=self.causal,
            dtype=dtype,
            block=block,
            device=self.device,
        )
