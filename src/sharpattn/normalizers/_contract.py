"""The normalizer contract, shared by every normalizer.

``fn(scores, mask=None, **params) -> weights``

* ``scores``: ``[..., Lq, Lk]`` floating tensor.
* ``mask``: boolean, broadcastable to ``scores``; ``True`` = the query may attend to that key.
* Masked entries of the result are exactly 0; a row with no allowed key is all zeros (never NaN).
* ``-inf`` scores count as masked. NaN or ``+inf`` at an allowed position raise ``ValueError``
  naming the position (``check_finite=False`` skips that check, for speed).
* Every check that reads tensor values on the host (the one above, tensor parameters' ranges,
  ``relu``'s overflow, ``stick_breaking``'s causal check) runs only with ``check_finite=True``:
  with ``check_finite=False`` a normalizer never synchronises with the device (no ``.item()``,
  ``bool(tensor)``, ``.nonzero()`` or Python branch on a tensor value), so ``torch.compile``
  captures it whole (``tests/paths/test_compile.py``). Checks of Python numbers always run.
* Weights come back in the dtype of ``scores``; half-precision inputs are computed in float32.
* Hostile input (the adversarial suite, ``tests/contract/test_adversarial.py``, holds every method to it):
  an empty ``scores`` (any dimension 0, e.g. Lk = 0) gives an empty result of the same shape and
  dtype (``mask`` and the parameters are still checked); finite scores of any size give finite
  weights — softmax-type maps are evaluated as softmax(β·(s − max s)), the sparse maps on
  s − max s, so neither a large score nor a large β (a tiny temperature) overflows; a method
  whose true weights cannot be represented (``relu`` with p > 1 on huge scores) raises
  ``ValueError`` instead of returning inf.
"""

from __future__ import annotations

import functools

import torch

Tensor = torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a normalizer computes in: float32 for 16-bit inputs, else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class HookError(ValueError):
    """A family's hook returned what its family cannot use. ``clause`` says which hook and what
    it returned; ``attend`` adds the method's name (``method``)."""

    def __init__(self, clause: str, method: str | None = None):
        super().__init__(clause if method is None else f"method {method!r}: {clause}.")
        self.clause, self.method = clause, method


def fits(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it (``torch.broadcast_shapes``
    of the two equals ``target``), in plain Python: torch's costs ~25 µs a call, which a
    decoding step pays several times."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False))


def as_4d(x: Tensor) -> Tensor:
    """``x`` with 1s in front up to 4 dimensions (``[H, 1, 1]`` -> ``[1, H, 1, 1]``; 4 or more
    as it is), the shape ``torch.broadcast_shapes(x.shape, (1, 1, 1, 1))`` gives."""
    if x.dim() >= 4:
        return x
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def on_device(value, dtype: torch.dtype, device) -> Tensor:
    """``value`` (a number or a tensor) as a tensor of ``dtype`` on ``device``: a tensor is
    converted (no copy where it is there already), a number filled in by a kernel
    (``torch.full``), the same value ``torch.as_tensor`` gives, without its copy from the host,
    which on CUDA synchronises with the device (see DEVELOPERS.md, "No host synchronisation")."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=dtype)
    return torch.full((), value, dtype=dtype, device=device)


def prepare(
    scores: Tensor, mask: Tensor | None = None, check_finite: bool = True
) -> tuple[Tensor, Tensor]:
    """Validate ``scores``/``mask`` and return ``(clean_scores, allowed)``.

    ``allowed`` is a boolean tensor of ``scores``' shape: the mask and the finite positions.
    ``clean_scores`` is ``scores`` in the compute dtype with every disallowed position set to 0,
    so any arithmetic on it (β·s, s − m, ...) stays finite and its gradient stays NaN-free;
    normalizers must re-apply ``allowed`` themselves (e.g. through `masked_softmax`).
    """
    if not torch.is_tensor(scores) or not scores.is_floating_point():
        raise ValueError(
            f"scores must be a floating-point tensor, got "
            f"{type(scores).__name__ if not torch.is_tensor(scores) else scores.dtype}."
        )
    if scores.dim() < 1:
        raise ValueError("scores must have at least one dimension (the keys), got a scalar.")
    allowed = scores != float("-inf")
    if mask is not None:
        if not torch.is_tensor(mask) or mask.dtype != torch.bool:
            raise ValueError(
                "mask must be a boolean tensor (True = may attend), got "
                f"{mask.dtype if torch.is_tensor(mask) else type(mask).__name__}."
            )
        try:
            allowed = allowed & mask
        except RuntimeError as err:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to scores of shape "
                f"{tuple(scores.shape)}."
            ) from err
        if allowed.shape != scores.shape:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to scores of shape "
                f"{tuple(scores.shape)}."
            )
    if check_finite:
        bad = allowed & (torch.isnan(scores) | (scores == float("inf")))
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            nan = bool(torch.isnan(scores[where]))
            kind = "NaN" if nan else f"+inf (a score above the largest {scores.dtype} overflows)"
            raise ValueError(
                f"scores contain {kind} at allowed position {where} "
                f"({int(bad.sum())} bad entries in all); pass check_finite=False to skip this check."
            )
    clean = scores.to(compute_dtype(scores.dtype)).masked_fill(~allowed, 0.0)
    return clean, allowed


def normalizer(fn):
    """Decorate a normalizer ``fn(scores, mask=None, **params)`` with the contract's guards.

    The one place where an empty input is handled for every method (normalizers written for
    non-empty rows need not think about it): ``scores`` with a zero-size dimension gives an
    empty result of its shape and dtype, connected to the autograd graph, after ``mask`` and the
    parameters are validated. [`register`][sharpattn.normalizers.register] applies it to every registered function,
    so user-registered methods inherit it.
    """
    if getattr(fn, "_contract_guarded", False):
        return fn

    @functools.wraps(fn)
    def guarded(scores, mask=None, *args, **params):
        if torch.is_tensor(scores) and scores.dim() >= 1 and scores.numel() == 0:
            prepare(scores, mask, check_finite=False)  # dtype, mask dtype and shape
            # the parameters are checked as for any input: on a stand-in with nothing allowed
            # and one key, the other sizes kept (0 made 1) so per-head and per-query tensor
            # parameters broadcast: O(B·H·Lq) memory, whatever Lk is; a tensor parameter with
            # no values (of a zero-size batch) has none to check and is left out
            shape = (*(max(n, 1) for n in scores.shape[:-1]), 1)
            shown = {
                name: value
                for name, value in params.items()
                if not (torch.is_tensor(value) and value.numel() == 0)
            }
            try:
                fn(
                    scores.new_zeros(shape),
                    scores.new_zeros(shape, dtype=torch.bool),
                    *args,
                    **shown,
                )
            except HookError:  # a family's hook, not its parameters: no score asks it here
                pass
            return scores * 0
        return fn(scores, mask, *args, **params)

    guarded._contract_guarded = True
    return guarded


def masked_softmax(scores: Tensor, allowed: Tensor, beta=None) -> Tensor:
    """softmax(β·s) over the allowed keys of each row; disallowed entries and empty rows are 0.

    ``scores`` must be finite where ``allowed`` (as `prepare` leaves them). ``beta`` (a
    number or a tensor broadcastable to ``[..., Lq, 1]``; None = 1) is applied as β·(s − m)
    (`shift_to_row_max`, m the row's largest allowed score, its smallest where β < 0): the
    same softmax, but every logit is <= 0, so β·s can not overflow to +inf however large the
    scores or β are (a tiny temperature gives the arg-max, its limit, not NaN).
    """
    row_any = allowed.any(dim=-1, keepdim=True)
    if beta is not None:
        lowest = None
        if torch.is_tensor(beta):
            lowest = beta.to(scores.device) < 0
        elif beta < 0:  # a number: every row's smallest score (no tensor, no copy)
            lowest = True
        big = torch.finfo(scores.dtype).max
        # β beyond the dtype (θ = 1e-39 in float32) is clamped to its largest number, so that
        # β·0 is 0, not NaN
        # (a tensor β in the scores' dtype first: a float32 θ with float64 scores is no error)
        beta = (
            beta.to(scores.dtype).clamp(-big, big)
            if torch.is_tensor(beta)
            else min(max(beta, -big), big)
        )
        scores = beta * shift_to_row_max(scores, allowed, lowest)
    # Empty rows get all-zero logits (a harmless uniform softmax) and are zeroed afterwards, so
    # neither the value nor the gradient ever sees a row of -inf.
    logits = scores.masked_fill(~allowed, float("-inf")).masked_fill(~row_any, 0.0)
    return torch.softmax(logits, dim=-1).masked_fill(~allowed, 0.0)


def shift_to_row_max(
    scores: Tensor, allowed: Tensor, lowest: Tensor | bool | None = None
) -> Tensor:
    """s − m per row, m the row's largest allowed score (its smallest where ``lowest``, a
    boolean tensor, or in every row for ``True``), 0 for rows with no allowed key, detached.

    The one place the shift-invariant maps (the softmax family, the entmax family) get their
    scores at the scale of 1: their values and gradients are those of s (the maps' Jacobians
    annihilate constant rows), but nothing downstream overflows or loses the support to rounding
    however large the scores are. Clamped to the dtype's range, which s − m leaves only when the
    allowed scores span more than it.
    """
    m = scores.masked_fill(~allowed, float("-inf")).amax(dim=-1, keepdim=True)
    if lowest is not None:
        lo = scores.masked_fill(~allowed, float("inf")).amin(dim=-1, keepdim=True)
        m = lo if lowest is True else torch.where(lowest, lo, m)
    m = m.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0).detach()
    big = torch.finfo(scores.dtype).max
    return (scores - m).clamp(-big, big)


def finish(weights: Tensor, like: Tensor) -> Tensor:
    """Return ``weights`` in the dtype of the caller's ``scores``."""
    return weights.to(like.dtype)


def causal_rows(r0: int, r1: int, lq: int, lk: int, device=None) -> Tensor:
    """``[r1 − r0, Lk]`` boolean, True where query i (r0 <= i < r1, of Lq) sees key j: j <= i +
    (Lk − Lq), queries aligned to the end of the keys (decoding with a cache)."""
    i = torch.arange(r0, r1, device=device).unsqueeze(-1)
    return torch.arange(lk, device=device) <= i + (lk - lq)


def visible_keys(
    mask: Tensor | None,
    lq: int | None = None,
    lk: int | None = None,
    *,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
    block: int = 1024,
    device=None,
) -> Tensor:
    """n_i, the number of keys query i may attend to, as ``dtype`` ``[..., Lq|1, 1]``: the one
    place "n" is counted (normalizers count their ``allowed`` matrix here, attention its
    `Masking`).

    ``mask``: boolean, broadcastable to ``[..., Lq, Lk]`` (True = may attend) or None (every key;
    then the result is ``[1, 1, Lq|1, 1]``). ``causal``: query i also sees only keys j <= i +
    (Lk − Lq) (`causal_rows`); ``lq``/``lk`` default to the mask's last two sizes. Counted
    as integers, then converted (one rounding), and without an ``[Lq, Lk]`` matrix: a count of
    the mask, the position for causal masks, a cumulative count of a mask that is the same for
    every query read at the causal edge for both; a per-query mask with ``causal`` is counted
    block by block (O(block·Lk) memory).
    """
    if mask is not None:
        lk = mask.shape[-1] if lk is None else lk
        if mask.shape[-1] != lk:  # keys broadcast
            mask = mask.expand(*mask.shape[:-1], lk)
        if not causal:
            return mask.sum(-1, keepdim=True).to(dtype)
        if mask.dim() < 2:
            mask = mask.unsqueeze(0)
        lq = mask.shape[-2] if lq is None else lq
        device = mask.device
    if lk == 0:
        return torch.zeros((1, 1, 1, 1), dtype=dtype, device=device)
    if mask is None:
        if not causal:
            return torch.full((1, 1, 1, 1), float(lk), dtype=dtype, device=device)
        last = torch.arange(lq, device=device) + (lk - lq)  # the last visible key of each query
        return (last + 1).clamp(0, lk).to(dtype).view(1, 1, lq, 1)
    if mask.shape[-2] == 1:  # the same keys for every query
        count = mask[..., 0, :].cumsum(-1)  # (..., Lk)
        last = torch.arange(lq, device=device) + (lk - lq)
        n = count.index_select(-1, last.clamp(0, lk - 1))  # (..., Lq)
        return torch.where(last >= 0, n, 0).unsqueeze(-1).to(dtype)
    parts = [
        (mask[..., r0 : r0 + block, :] & causal_rows(r0, min(r0 + block, lq), lq, lk, device))
        .sum(-1, keepdim=True)
        .to(dtype)
        for r0 in range(0, lq, block)
    ]
    if not parts:  # Lq = 0
        return torch.zeros((*mask.shape[:-2], 0, 1), dtype=dtype, device=device)
    return torch.cat(parts, dim=-2)


def nonnegative(value, name: str):
    """A parameter constrained to >= 0 (e.g. length_scaled's c).

    Plain numbers must satisfy it (ValueError otherwise). A tensor (e.g. a learnable per-head
    ``nn.Parameter``) is clamped at 0 in the forward pass while its gradient passes through
    unchanged (straight-through), so a value pushed below 0 acts as 0 yet can come back: no dead
    zone, as a plain clamp would have.
    """
    if torch.is_tensor(value):
        return value + (value.clamp_min(0.0) - value).detach()
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}.")
    return value
