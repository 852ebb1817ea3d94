"""attend(q, k, v, method=...): attention with any registered normalizer."""

from __future__ import annotations

import contextvars
import functools
import math
import threading
from collections.abc import Callable

import torch

from ..normalizers import get
from ..normalizers._contract import causal_rows, compute_dtype
from ..normalizers.families import HookError
from ..normalizers.registry import CHECK_FINITE, Param, is_built_in
from . import policy
from .cpu import decoding, native
from .cpu.fused import positive_scale
from .dispatch.fast import FAST, check_hook_values, decodes, path_of, scores_in_range
from .masking import Masking, Structure
from .pieces import run_pieces
from .reference.chunked import chunked_attend
from .reference.naive import naive_attention
from .stats import row_stats

Tensor = torch.Tensor

IMPLS = ("auto", "fused", "chunked", "naive")
#: ``scale``, checked once before any path: a finite real number of any sign, or None (1/√D)
SCALE = Param("scale", None, "the scores' factor (None: 1/√D)", kind="real", optional=True)
#: the dtypes q, k, v may have (integer, complex and 8-bit floats are refused in one sentence)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: The one observation point of attention (used by `sharpattn.diagnostics.capture`): when
#: set, every `attend` call ends with ``out = observer(q, k, v, out, mask=, causal=, scale=,
#: method=, params=)``, where q, k, v are what the normalizer saw (after selective temperatures)
#: and ``out`` ``[B, H, Lq, Dv]`` may be replaced (e.g. a head zeroed). Set it with
#: `observe`; sharpattn's ``MultiheadAttention`` and the Hugging Face integration both
#: call `attend`, so one observer sees both.
_observer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "sharpattn_attend_observer", default=None
)
#: How many `observe` calls have not been undone yet, in any context. While it is 0,
#: `attend` does not read the ContextVar at all: ``torch.compile`` cannot trace
#: ``ContextVar.get`` (a graph break), but it guards on this module global (a compiled attend
#: recompiles when observing starts, and breaks its graph there while it lasts). A context copied
#: from an observing one (a thread, an asyncio task) sees the observer only until that one stops.
_observing = 0
_observing_lock = threading.Lock()


def observe(observer: Callable | None) -> contextvars.Token:
    """Install ``observer`` for [`attend`][sharpattn.attend] calls in this context; returns the token for
    `stop_observing`."""
    global _observing
    token = _observer.set(observer)
    with _observing_lock:
        _observing += 1
    return token


def stop_observing(token: contextvars.Token) -> None:
    """Restore the observer that was active before `observe` returned ``token``."""
    global _observing
    _observer.reset(token)
    with _observing_lock:
        _observing = max(0, _observing - 1)


def causal_mask(lq: int, lk: int, device=None) -> Tensor:
    """``[Lq, Lk]`` boolean mask, True where key j is visible to query i.

    Queries are aligned to the *end* of the keys (decoding with a cache): query i sees keys
    j <= i + (Lk − Lq). With Lq > Lk the first Lq − Lk queries see nothing (all-zero rows).
    """
    return causal_rows(0, lq, lq, lk, device)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str = "softmax",
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    documents: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    lengths: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    impl: str = "auto",
    check_finite: bool = True,
    return_stats: bool = False,
    block_size: int | None = None,
    **params,
):
    """Attention output ``[B, H, Lq, Dv]`` = normalizer(scale·q·kᵀ, mask) · v.

    q ``[B, H, Lq, D]``; k ``[B, Hkv, Lk, D]``; v ``[B, Hkv, Lk, Dv]``. When Hkv < H
    (grouped-query attention), query head h uses key/value head h // (H / Hkv).
    ``mask``: boolean, broadcastable to ``[B, H, Lq, Lk]``, True = may attend. ``causal``: query
    i sees keys j <= i + (Lk − Lq).

    Structure, which every path honours without an ``[Lq, Lk]`` mask (query i sits at key
    position p_i = i + Lk − Lq, as with ``causal``; a key is visible when every given rule allows
    it):

    * ``documents``: packed sequences, one document id per key, ``[Lk]`` or ``[B, Lk]``, each
      document one contiguous run; query i sees only the keys of key p_i's document. Or
      ``cu_seqlens``: flash-attention's cumulative lengths ``[documents + 1]`` (0 first, Lk
      last; equal neighbours are empty documents), the same for every batch row.
    * ``window=(left, right)``: query i sees keys p_i − left <= j <= p_i + right (None: no limit
      on that side). A causal sliding window of W keys, the query's own included, is
      ``window=(W − 1, 0)`` with ``causal=True``.
    * ``lengths``: padding, ``[B]`` (batch row b's valid keys are its first lengths[b]) or
      ``[B, 2]`` (its first valid key and one past its last: left padding too).

    The fast paths cut such a call into pieces that each see a contiguous block of keys (a
    document, a band of the window) and never read the keys no row of a piece may see; the
    naive path builds the dense mask. Row statistics (n for the length-scaled methods,
    adaptive's entropy, a sink's denominator) count only the row's visible keys. Positions
    (stick-breaking's ``query_offset`` and log-position shift) stay those of the whole call.
    The ids and lengths are read on the host.

    ``scale``: a finite real number of any sign (0 gives every visible key the same score), None
    for 1/sqrt(D); anything else (NaN, ±inf, a bool, a string, a tensor) raises ValueError
    naming ``scale`` and the value, before any path, whatever ``check_finite`` is. Every path computes a scale <= 0 as it is (the fused paths carry it on
    q: torch's flash kernel takes a positive one). ``params`` go to the normalizer (e.g.
    ``temperature=0.5``, ``coefficients="arxiv"``).

    ``impl`` picks the computation; every path gives the same result within rounding:

    * ``"fused"``: no score matrix, O(n) memory, torch's flash kernel (methods whose registry
      entry names a ``fused`` path: softmax, adaptive, ...; see `fused`).
    * ``"chunked"``: any method, query blocks of ``block_size`` rows (default: about 2^23 score
      entries per block), extra memory O(block·Lk) in forward and backward.
    * ``"naive"``: the whole ``[B, H, Lq, Lk]`` score matrix (the reference).
    * ``"auto"``: naive when ``return_weights``; else fused when the method has it; else naive
      up to ``policy.NAIVE_MAX_ELEMENTS`` score entries and chunked beyond.

    Forcing a path the method lacks (``impl="fused"`` without a fused path) raises ValueError.

    ``params`` are validated once, before any path, against the method's registry
    [`Param`][sharpattn.normalizers.Param] entries (``Normalizer.check_params``):
    a name the method does not take, a NaN, an infinity where the parameter must be finite, a
    value out of its range or of the wrong type raise ValueError naming the parameter and what it
    accepts, whichever path runs (tensor parameters' values only with ``check_finite``). A tensor
    parameter holds one value per row of the scores: its shape must be ``[B|1, H|1, Lq|1, 1]``
    (``[1, H, 1, 1]`` per head, ``[B, H, Lq, 1]`` per query; leading 1s may be left out); any
    other shape (``[H]``, ``[Lq]``, one value per key) raises ValueError naming the method, the
    parameter, its shape and the shapes allowed, from the shape alone, whatever
    ``check_finite`` is.

    Hostile input, the same on every path (``tests/contract/test_adversarial.py``): B, Lq or Lk = 0 give
    an empty or all-zero output (rows that see no key are 0) with working gradients; H, Hkv or
    D = 0 raise ValueError, as do q, k, v, the mask and tensor parameters on more than one
    device (naming each device). NaN or ±inf anywhere in q, k or v raises ValueError naming the
    position, before any path runs, whether or not a mask hides it. Scores are computed in
    float32 for 16-bit inputs (as the fused kernel does), so fp16 q·kᵀ beyond 65504 is no error.
    Whether a sum overflows depends on its order, so the rule is on a bound: when
    D·max|q|·max|k|·max(1, scale) reaches the largest number of the compute dtype (q·kᵀ could
    overflow on some path), every path raises ValueError. Below it, the fused paths run the
    kernel only while every magnitude its forward and backward multiply (|q|, |k|, |v| and the
    scores' D·max|q|·max|k|·scale) stays below the dtype's largest number to the power 1/4
    (float32: 4e9), so products of up to four of them are finite, and, for the row-scaled and
    adaptive methods, while |β|·|s| (β's bound over the call's rows, `fast.scores_in_range`)
    stays below ``policy.FUSED_SCALED_SCORE_MAX`` (the kernel's backward recomputes exp(β·s −
    lse) in float32, so its gradients lose ε·|β·s|: a tiny temperature, a large ssmax ``s``,
    adaptive ``floor``); beyond, and wherever the
    kernel's output is not finite (β·s overflowing inside it, e.g. a tiny temperature),
    ``attend`` computes the result on the chunked path, which evaluates the normalizer without
    overflow (the stats then lack the fused-only fields lse and β). An output that is still not
    finite (unnormalised weights such as ``relu``'s beyond float16) raises ValueError.

    ``check_finite=False`` skips every check that reads tensor values, for speed and so that
    ``attend`` never waits for the device (no host synchronisation: ``torch.compile(attend,
    fullgraph=True)`` captures every method and path in one graph). Skipped then: the input and
    range checks above, the normalizer's checks (NaN/+inf scores, the values of tensor
    parameters such as a per-head θ > 0 or α > 1, relu's overflow, stick_breaking's causal
    check: a mask reaching past the query's position is then cut to the causal one), the
    output check, and the fused paths' recompute: where the kernel overflows (β·s beyond the
    dtype, e.g. a tiny temperature on huge scores) the output is NaN, and huge inputs may give
    non-finite gradients on the fused paths. Use ``impl="chunked"`` or ``"naive"`` for such
    inputs, or keep ``check_finite=True``.

    Returns the output; with ``return_weights=True`` also the weights ``[B, H, Lq, Lk]`` (naive
    only); with ``return_stats=True`` also an [`AttentionStats`][sharpattn.attention.stats.AttentionStats]
    of per-row statistics (entropy, mass, visible keys; lse and β on fused paths), computed
    without the weights matrix on the fused and chunked paths. Order: ``(output[, weights][,
    stats])``.
    """
    entry = get(method)
    try:
        fast = path_of(entry)
        if entry.fused is not None and fast is None:  # a registered entry's own mistake
            raise ValueError(
                f"method {entry.name!r} names the fused path {entry.fused!r}, which does not exist; "
                f"the fused paths: {', '.join(sorted(FAST))}."
            )
        CHECK_FINITE.check(check_finite, "attend")
        SCALE.check(scale, "attend")
        check_devices("attend", q=q, k=k, v=v, mask=mask, **params)
        # once, before any path: every path refuses the same parameters (tensor values only with
        # check_finite, which reads them on the host; tensor shapes always: one value per row)
        rows = tuple(q.shape[:3]) if torch.is_tensor(q) and q.dim() == 4 else None
        entry.check_params(params, check_values=check_finite, rows=rows)
        _check_inputs(q, k, v)
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}.")
        b, h, lq, d = q.shape
        lk = k.shape[2]
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        _check_mask(mask, (b, h, lq, lk))
        structure = Structure.build(documents, cu_seqlens, window, lengths, b, lk)
        masking = Masking.build(mask, causal, lq, lk, q.device, structure)
        cd = compute_dtype(q.dtype)
        sizes = None
        # a decoding step that reads the cache once checks k and v from what it read (`_run`)
        defer = (
            check_finite
            and structure is None
            and impl in ("auto", "fused")
            and not return_weights
            and fast is not None
            and decodes(entry, q, k, v, masking, return_stats, params)
        )
        if defer:
            _check_query(q)
        elif check_finite:  # once, before any path: every path rejects the same inputs
            sizes = _check_ranges(q, k, v, scale, cd)

        if impl == "auto":
            if return_weights:
                impl = "naive"
            elif entry.fused is not None:
                impl = "fused"
            else:
                impl = "naive" if b * h * lq * lk <= policy.NAIVE_MAX_ELEMENTS else "chunked"
        if return_weights and impl != "naive":
            raise ValueError(
                f"return_weights=True needs the weights matrix; use impl='naive' (not {impl!r}), "
                "or return_stats=True for per-row statistics without it."
            )
        if impl == "fused" and entry.fused is None:
            raise ValueError(
                f"method {entry.name!r} has no fused path; use impl='chunked' or impl='naive'."
            )
        if 0 in (b, h, lq, lk):
            # no score at all: every path's answer is the empty (or all-zero) one; the naive path
            # gives it, its parameters checked and no hook asked (the contract's empty input)
            impl = "naive"

        weights = stats = None
        if impl == "naive":
            out, weights, stats = naive_attention(
                entry.fn, q, k, v, masking, scale, check_finite, return_stats, params
            )
        else:
            run = functools.partial(
                _run, entry, fast, impl, scale, sizes, defer, check_finite, return_stats, block_size
            )
            if structure is None:
                out, stats = run(q, k, v, masking, params)
            else:  # pieces without structure, on the same path
                out, stats = run_pieces(run, entry, q, k, v, masking, params, return_stats)
        if check_finite:
            _check_output(out, entry.name, is_built_in(entry))
        observer = _observer.get() if _observing else None  # no ContextVar read while unused
        if observer is not None:
            out = observer(
                q,
                k,
                v,
                out,
                mask=mask if structure is None else masking.dense(),
                causal=causal,
                scale=scale,
                method=entry.name,
                params=params,
            )

        result = (out,)
        if return_weights:
            result += (weights,)
        if return_stats:
            result += (stats,)
        return result if len(result) > 1 else out
    except HookError as err:  # a family's hook returned what it cannot use: name the method
        if err.method is not None:
            raise
        raise HookError(err.clause, entry.name) from None


def _run(
    entry,
    fast,
    impl,
    scale,
    sizes,
    defer,
    check_finite,
    return_stats,
    block_size,
    q,
    k,
    v,
    masking,
    params,
):
    """(output, statistics or None) of one call without structure on the fused path (falling back
    to the chunked one where the kernel's range or output says so) or the chunked path.

    ``sizes``: `_check_ranges`'s magnitudes, or None unchecked; with ``defer`` the fused path runs
    first, as a decoding step that reports what it read of k and v (`decoding.collected`), and
    the inputs are checked from that before its output is used."""
    b, h, lq = q.shape[:3]
    stats = None
    if impl == "fused":
        full = {p.name: p.default for p in entry.params}
        full.update(params)
        if check_finite:  # the naive maths checks its hooks' values itself (check_finite)
            check_hook_values(entry, full, masking, (b, h, lq, 1))
        exact = out = None
        if defer:
            qf, sf = positive_scale(q, scale)
            with decoding.collected() as read:
                out, stats = fast(qf, k, v, masking, sf, return_stats, **full)
            read = read if read.complete else None  # the path read less: read k and v here
            sizes = _check_ranges(q, k, v, scale, compute_dtype(q.dtype), read)
            exact = None if read is None else read.score  # the largest |β·s| it computed
        if sizes is not None and (
            max(sizes) >= torch.finfo(compute_dtype(q.dtype)).max ** 0.25
            or not scores_in_range(entry, full, q, k, scale, sizes[3], exact)
        ):
            # the kernel's backward could overflow, or lose β·s's precision: the exact path
            impl = "chunked"
        else:
            if out is None:
                # a scale <= 0 rides on q (the flash kernel and the paths that divide by the
                # scale take a positive one)
                qf, sf = positive_scale(q, scale)
                out, stats = fast(qf, k, v, masking, sf, return_stats, **full)
            if check_finite and not math.isfinite(_max_abs(out)):
                # the kernel overflowed on finite inputs (_check_ranges rejected non-finite
                # ones; β·s beyond the dtype: NaN): recompute on the chunked path, which
                # evaluates the normalizer without overflowing. Reading max |out| is a host
                # sync, so check_finite=False skips it (and the recompute).
                impl, stats = "chunked", None
            else:
                return out, stats
    out, pieces = chunked_attend(
        entry.fn,
        q,
        k,
        v,
        masking,
        scale,
        block_size=block_size,
        want_stats=return_stats,
        check_finite=check_finite,
        positional=entry.positional,
        params=params,
    )
    if return_stats:
        ent, mass = pieces
        stats = row_stats((b, h, lq), masking.visible_keys(), entropy=ent, mass=mass)
    return out, stats


def check_devices(caller: str, **tensors) -> None:
    """Refuse tensors on more than one device (the keyword arguments that are tensors, named by
    their keywords; the others are ignored) in one sentence that names each device. Only the
    ``.device`` attributes are compared: no host synchronisation. Without it a CPU tensor beside
    CUDA ones fails deep inside a path (a torch op's RuntimeError) or, handed to a Triton kernel
    as a pointer, reads memory it does not own."""
    where: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        if torch.is_tensor(t):
            where.setdefault(t.device, []).append(name)
    if len(where) > 1:
        groups = [f"{', '.join(names)} on {device}" for device, names in where.items()]
        first = next(iter(where.values()))[0]
        raise ValueError(
            f"{caller} takes its tensors on one device, got {', '.join(groups[:-1])} and "
            f"{groups[-1]}; move them to one device (e.g. .to({first}.device))."
        )


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not torch.is_tensor(t) or t.dim() != 4:
            shape = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"{name} must be a 4-d tensor [B, heads, L, D], got {shape}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if q.dtype not in DTYPES:
        raise ValueError(
            f"q, k, v are {q.dtype}; attention takes float16, bfloat16, float32 or float64 "
            "(convert them with .float())."
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, heads and length."
        )
    for name, t, dims in (("q", q, (1, 3)), ("k", k, (1,))):
        for dim in dims:
            if t.shape[dim] == 0:
                what = "0 heads" if dim == 1 else "head size D = 0"
                raise ValueError(
                    f"{name} has {what} (shape {tuple(t.shape)} [B, heads, L, D]); "
                    "heads and D must be >= 1 (B and L may be 0)."
                )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head size D."
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads and k {k.shape[1]}: the key/value heads must divide the "
            f"query heads (q {tuple(q.shape)}, k {tuple(k.shape)})."
        )


def _check_mask(mask, shape) -> None:
    if mask is None:
        return
    if not torch.is_tensor(mask) or mask.dtype != torch.bool:
        raise ValueError("mask must be a boolean tensor (True = may attend).")
    try:
        ok = torch.broadcast_shapes(mask.shape, shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
            f"{shape} [B, H, Lq, Lk]."
        )


#: tensors of at least this many float32 values on the CPU are read by the C++ loop `abs_max`
#: (torch.aminmax took 0.24 ms for a 4,096-key cache's k and v, B1 H8 D64, as long as SDPA's
#: whole decoding step over them on the 2-core AMD EPYC)
NATIVE_MAX_ABS = 1 << 16


def _max_abs(t: Tensor) -> float:
    """max |t| (0 if empty; NaN if t holds a NaN, inf if an inf), one pass, no copy."""
    if t.numel() == 0:
        return 0.0
    if (
        t.numel() >= NATIVE_MAX_ABS
        and t.dtype == torch.float32
        and t.is_contiguous()
        and native.wanted(t.device, t.dtype)
    ):
        return native.abs_max(t.detach())
    lo, hi = (float(x) for x in torch.aminmax(t.detach()))  # both NaN if any NaN
    return max(-lo, hi) if not math.isnan(lo) else math.nan


def _check_query(q: Tensor) -> None:
    """Reject a non-finite q (`_check_ranges` without k and v)."""
    if not math.isfinite(_max_abs(q)):
        _check_finite(q=q)


def _check_ranges(
    q: Tensor, k: Tensor, v: Tensor, scale: float, cd, read=None
) -> tuple[float, ...]:
    """Reject non-finite q, k, v and a q·kᵀ that could overflow ``cd``; return the magnitudes
    the fused kernel multiplies (max |q|, max |k|, max |v|, D·max|q|·max|k|·|scale| ≥ every
    scaled score) for the fused paths' range test. ``read``: max |k| and max |v| as a decoding
    step read them (`decoding.Reads`), instead of reading k and v here.

    The score bound D·max|q|·max|k|·max(1, |scale|) exceeds every partial sum of q·kᵀ, in any
    order, and the scaled score: below the dtype's largest number no path overflows, so the
    rule does not depend on how a path orders its sums.
    """
    mq = _max_abs(q)
    mk, mv = (_max_abs(k), _max_abs(v)) if read is None else (read.k, read.v)
    if not all(math.isfinite(m) for m in (mq, mk, mv)):
        _check_finite(q=q, k=k, v=v)  # names the first bad position
    bound = q.shape[-1] * mq * mk * max(1.0, abs(scale))  # Python floats: no overflow below 1e308
    if bound >= torch.finfo(cd).max:
        raise ValueError(
            f"q·kᵀ can overflow {cd}: D·max|q|·max|k|·max(1, scale) = {bound:.3g} reaches its "
            f"largest number {torch.finfo(cd).max:.3g}; scale q or k down, or pass "
            "check_finite=False to skip this check."
        )
    return mq, mk, mv, q.shape[-1] * mq * mk * abs(scale)


def _check_output(out: Tensor, method: str, built_in: bool = True) -> None:
    """Finite inputs, non-finite output — an error, not a silent inf/NaN: for sharpattn's own
    methods the true result is beyond the output dtype (the weights of an unnormalised method
    grow with the scores); a user's method (``built_in`` False: a plug-in, a registered
    `Normalizer`) may as well have made the NaN in its own function or one of its family's
    hooks, where scaling q or k would not help."""
    if math.isfinite(_max_abs(out)):
        return
    where = tuple(int(i) for i in (~torch.isfinite(out)).nonzero()[0])
    if not built_in:
        raise ValueError(
            f"the {method} attention output at {where} is NaN or infinite from finite q, k and "
            "v: it came from the method's function (its weights or a hook of its family), not "
            f"from their scale, unless its weights grow beyond the range of {out.dtype}."
        )
    raise ValueError(
        f"the {method} attention output at {where} is beyond the range of {out.dtype} "
        "(its weights grow with the scores); scale q or k down or use a wider dtype."
    )


def _check_finite(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} contains a non-finite value at {where}; pass check_finite=False to skip "
                "this check."
            )
