"""Which keys each query sees, without materialising an ``[Lq, Lk]`` matrix unless asked to.

Besides a boolean mask and the causal flag, a call may say which keys each query sees as
*structure* (`Structure`): packed documents, a sliding window and padding given as lengths. Each
of them lets query i see one interval of keys, so together they are one interval per row,
``[lo_i, hi_i)`` (`Structure.bounds`): O(Lq) numbers, never an ``[Lq, Lk]`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..normalizers._contract import causal_rows, visible_keys

Tensor = torch.Tensor

_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class Structure:
    """Keys a query may see, as one interval per row: packed documents, a window, padding.

    Positions: query i of Lq over Lk keys sits at key position p_i = i + Lk − Lq (aligned to the
    end of the keys, as ``causal``). Query i sees key j only if

    * ``documents``: j is in the document of key p_i (a query before the first key, p_i < 0,
      is in none and sees nothing);
    * ``window`` = (left, right): p_i − left <= j <= p_i + right (None: no limit on that side);
    * padding: first_b <= j < end_b, the valid keys of batch row b.

    ``doc_start``/``doc_end`` ``[1|B, Lk]`` int64: the first key and one past the last key of
    key j's document; ``key_start``/``key_end`` ``[B]`` int64 or None.
    """

    doc_start: Tensor | None = None
    doc_end: Tensor | None = None
    window: tuple[int | None, int | None] | None = None
    key_start: Tensor | None = None
    key_end: Tensor | None = None

    @classmethod
    def build(cls, documents, cu_seqlens, window, lengths, b: int, lk: int):
        """The structure of an `attend` call from its keywords (None when it has none), each
        refused in one sentence when it is not what `attend` documents. Document ids,
        ``cu_seqlens`` and lengths are read on the host and kept there (O(Lk) integers: they
        decide how a call is cut into pieces)."""
        if documents is not None and cu_seqlens is not None:
            raise ValueError(
                "give documents (per-key document ids) or cu_seqlens (cumulative lengths), not both."
            )
        if cu_seqlens is not None:
            documents = _ids_of_cu_seqlens(cu_seqlens, lk)
        doc_start = doc_end = key_start = key_end = None
        if documents is not None:
            doc_start, doc_end = _document_runs(documents, b, lk)
        window = _check_window(window)
        if lengths is not None:
            key_start, key_end = _padding(lengths, b, lk)
        if doc_start is None and window is None and key_start is None:
            return None
        return cls(doc_start, doc_end, window, key_start, key_end)

    def bounds(self, r0: int, r1: int, lq: int, lk: int, causal: bool) -> tuple[Tensor, Tensor]:
        """(lo, hi), each int64 ``[1|B, r1 − r0]`` on the host: query row i of ``r0:r1`` sees
        keys ``lo_i <= j < hi_i`` (with ``causal`` too: j <= p_i); hi >= lo (an empty row has
        hi == lo)."""
        p = torch.arange(r0, r1) + (lk - lq)  # the key position of each row
        lo = torch.zeros(1, r1 - r0, dtype=torch.int64)
        hi = torch.full((1, r1 - r0), lk, dtype=torch.int64)
        if causal:
            hi = torch.minimum(hi, p + 1)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                lo = torch.maximum(lo, p - left)
            if right is not None:
                hi = torch.minimum(hi, p + right + 1)
        if self.doc_start is not None:
            at = p.clamp(0, max(lk - 1, 0))
            if lk > 0:
                lo = torch.maximum(lo, self.doc_start[:, at])
                hi = torch.minimum(hi, self.doc_end[:, at])
            hi = torch.where(p >= 0, hi, 0)  # a query before the first key has no document
        if self.key_start is not None:
            lo = torch.maximum(lo, self.key_start[:, None])
            hi = torch.minimum(hi, self.key_end[:, None])
        lo = lo.clamp(0, lk)
        return lo, torch.maximum(hi, lo)


def _as_integers(t, what: str) -> Tensor:
    if not torch.is_tensor(t):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"{what} must be a tensor of integers, got {type(t).__name__}."
            ) from None
    if t.dtype not in _INTEGERS:
        raise ValueError(f"{what} must hold integers, got {t.dtype}.")
    return t.detach().to("cpu", torch.int64)


def _ids_of_cu_seqlens(cu, lk: int) -> Tensor:
    """flash-attention's cumulative sequence lengths ``[D + 1]`` (0 first, Lk last, never
    decreasing) as per-key document ids ``[Lk]``."""
    cu = _as_integers(cu, "cu_seqlens")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-d [documents + 1], got shape {tuple(cu.shape)}.")
    if int(cu[0]) != 0 or int(cu[-1]) != lk or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at Lk = {lk} (the keys), got "
            f"{cu.tolist()[:8]}{' ...' if cu.numel() > 8 else ''}."
        )
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())


def _document_runs(documents, b: int, lk: int) -> tuple[Tensor, Tensor]:
    """(first key, one past the last key) of each key's document, ``[1|B, Lk]``, from per-key
    ids ``[Lk]`` or ``[1|B, Lk]`` in which each document is one run of equal ids."""
    ids = _as_integers(documents, "documents")
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[-1] != lk or ids.shape[0] not in (1, b):
        raise ValueError(
            f"documents must hold one id per key, [Lk] or [B, Lk] = [{b}, {lk}], got shape "
            f"{tuple(ids.shape)}."
        )
    j = torch.arange(lk).expand_as(ids)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]  # key j starts a run
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]  # key j ends a run
    runs = new.sum(-1)
    for row, count in zip(ids, runs.tolist(), strict=True):
        if torch.unique(row).numel() != count:
            raise ValueError(
                "documents must give each document one contiguous run of keys (packed "
                "sequences); an id appears in two runs."
            )
    start = torch.where(new, j, 0).cummax(-1).values
    end = torch.where(last, j + 1, lk).flip(-1).cummin(-1).values.flip(-1)
    return start, end


def _check_window(window):
    if window is None:
        return None
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    if ok:
        for side in window:
            if side is None:
                continue
            if isinstance(side, bool) or not isinstance(side, int) or side < 0:
                ok = False
    if not ok:
        raise ValueError(
            "window must be (left, right): how many keys before and after the query's position it "
            f"sees, each an integer >= 0 or None (no limit), got {window!r}."
        )
    return None if window[0] is None and window[1] is None else (window[0], window[1])


def _padding(lengths, b: int, lk: int) -> tuple[Tensor, Tensor]:
    t = _as_integers(lengths, "lengths")
    if t.dim() == 1 and t.shape[0] == b:
        start, end = torch.zeros_like(t), t
    elif t.dim() == 2 and t.shape == (b, 2):
        start, end = t[:, 0], t[:, 1]
    else:
        raise ValueError(
            f"lengths must be [B] = [{b}] (batch row b's valid keys are the first lengths[b]) or "
            f"[B, 2] (its first valid key and one past its last), got shape {tuple(t.shape)}."
        )
    if bool(((start < 0) | (end < start) | (end > lk)).any()):
        raise ValueError(
            f"lengths must keep 0 <= first <= end <= Lk = {lk} keys in every batch row."
        )
    return start.contiguous(), end.contiguous()


@dataclass(frozen=True)
class Masking:
    """A user mask, the causal flag and the structure, kept apart so fast paths never build the
    ``[Lq, Lk]`` matrix.

    ``mask``: boolean, 4-d, broadcastable to ``[B, H, Lq, Lk]`` (True = may attend) or None.
    ``causal``: query i sees keys j <= i + (Lk − Lq) (bottom-right aligned, as ``causal_mask``).
    ``structure``: documents, window and padding (`Structure`) or None; the fast paths see
    pieces of a call without it (`sharpattn.attention.pieces`).
    """

    mask: Tensor | None
    causal: bool
    lq: int
    lk: int
    device: torch.device
    structure: Structure | None = None

    @classmethod
    def build(
        cls,
        mask: Tensor | None,
        causal: bool,
        lq: int,
        lk: int,
        device,
        structure: Structure | None = None,
    ) -> Masking:
        if mask is not None and mask.dim() < 4:
            mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if causal and lq == 1 and lk >= 1:
            # one query at the last key sees every key: no causal mask to build (a decoding step)
            causal = False
        return cls(mask, bool(causal), lq, lk, torch.device(device), structure)

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
        if self.structure is not None:
            lo, hi = self.structure.bounds(r0, r1, self.lq, self.lk, self.causal)
            lo, hi = lo.to(self.device), hi.to(self.device)
            j = torch.arange(key_end, device=self.device)
            s = (j >= lo.unsqueeze(-1)) & (j < hi.unsqueeze(-1))  # (1|B, r, key_end)
            s = s.unsqueeze(1)
            m = s if m is None else m & s
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
        without an ``[Lq, Lk]`` matrix (a per-row mask with ``causal`` or structure is counted
        ``block`` rows at a time): `sharpattn.normalizers._contract.visible_keys`, where every
        n is counted, or the structure's intervals."""
        if self.structure is not None:
            if self.mask is None:
                lo, hi = self.structure.bounds(0, self.lq, self.lq, self.lk, self.causal)
                return (hi - lo).to(self.device, dtype)[:, None, :, None]
            step = max(1, min(block, (1 << 22) // max(1, self.lk)))
            parts = [
                self.rows(r0, min(r0 + step, self.lq)).sum(-1, keepdim=True).to(dtype)
                for r0 in range(0, self.lq, step)
            ]
            if not parts:
                return torch.zeros((1, 1, 0, 1), dtype=dtype, device=self.device)
            return torch.cat(parts, dim=-2)
        return visible_keys(
            self.mask,
            self.lq,
            self.lk,
            causal=self.causal,
            dtype=dtype,
            block=block,
            device=self.device,
        )
