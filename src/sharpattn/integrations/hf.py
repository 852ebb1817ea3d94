"""Hugging Face transformers: any sharpattn method as an attention implementation.

>>> import sharpattn.hf
>>> sharpattn.hf.apply(model, "adaptive")      # in place; model.config._attn_implementation
>>> model.generate(...)                         # == "sharpattn:adaptive"

Import it as ``sharpattn.hf``, its public name (this module path is where it is implemented).
Importing it needs no transformers (each function checks for it) and lets
`sharpattn.diagnostics.capture` record Hugging Face models.

Every registry method ``m`` is registered with transformers' ``AttentionInterface`` *and*
``AttentionMaskInterface`` as ``"sharpattn:m"`` (without the mask entry transformers builds no mask for
an unknown implementation, and causal masking and padding would be silently lost). What a query
sees goes to [`sharpattn.attend`][sharpattn.attend] as structure, with no ``[B, 1, Lq, Lk]``
mask, where it is one:

- packed sequences (padding-free batches, as transformers' flash-attention path reads them): one
  batch row whose ``position_ids`` restart for each document (``DataCollatorWithFlattening``), or
  ``cu_seq_lens_q``/``cu_seq_lens_k`` given to the model, go as ``documents=``/``cu_seqlens=``
  with ``causal=True`` (with no KV cache transformers' mask code finds the documents in the
  ``position_ids`` itself; with one, the attention function reads them, once per forward);
- a sliding window (``config.sliding_window``) goes as ``window=(W − 1, 0)``: as in transformers'
  masks, a query sees W keys, itself included;
- padding, a 2-d ``attention_mask`` whose ones are one run per row, goes as ``lengths`` ``[B, 2]``
  (first real token, one past the last: right or left padding).

Anything else still goes as a boolean ``mask=`` (True = attend): a 4-d mask the user passes, a
padding mask with holes, a model that adds to its mask (ALiBi), other mask patterns (chunked
attention, overlays for image tokens), a static cache, ``torch.compile``, and
``apply(..., check_finite=False)`` (reading the structure waits for the device, which
``check_finite=False`` promises not to). ``return_weights`` (``output_attentions``) and dropout in
training take `attend`'s naive path, which builds the dense mask from the structure itself.

Learnable normalizer parameters (registry ``Param(learnable=True)``) become per-layer, per-head
``nn.Parameter``s ``[H]`` in ``attn_module.sharpattn_params`` (so they are in ``state_dict`` and
``save_pretrained``); the method and its fixed parameters are written to ``config.sharpattn`` so
[`from_pretrained`][sharpattn.integrations.hf.from_pretrained] restores the patched model.
A method's ``query_dependent`` parameters (ASEntmax's β and γ) also get, as in
[`MultiheadAttention`][sharpattn.attention.MultiheadAttention], a linear map of the query's layer input x_i,
p_{h,i} = p_h + w_h·x_i (``attn_module.sharpattn_projections``, w initialised to 0, so the patched
model starts with per-head values); x is read by a forward pre-hook on the attention module (its
``hidden_states``), whose rows are the queries' also with a KV cache.

Selective attention (Zhang et al., NeurIPS 2024; `sharpattn.attention.selective`):

>>> sharpattn.hf.apply(model, "selective", targets="qv", sharing=False)   # softmax + τ_q, τ_v
>>> sharpattn.hf.parameter_overhead(model)                               # Overhead(added, base, ...)

attaches one `Temperature` per target and layer in
``attn_module.sharpattn_selective`` (a ``ModuleDict`` "q"/"k"/"v"; per head, with the layer's
key/value heads for "k"/"v" under GQA) and scales the rows of q, k, v inside the attention function
before the normalizer (``normalizer=``, default softmax). Inside a transformers attention function
we receive q, k, v already projected, split into heads (and, for rotary models, with q and k
rotated), so:

- ``sharing=True``, the weight-sharing form f(x)_h = w_h·GELU((x·W)_h), takes (x·W)_h to be the
  per-head state the function receives. For v this is exactly x·W_v (+ bias); for q and k of
  rotary models (Llama, GPT-NeoX) it is the *rotated* projection R_n·x·W_q, so τ_tok of q/k there
  also depends on the position (for GPT-2, with learned absolute positions, it is exact). With a KV
  cache the cached value states are there, so τ_v of every key is computed, and ``generate()`` works.
- ``sharing=False`` (base SSA), f a two-layer GELU MLP of the layer input x, reads x from a forward
  pre-hook on the attention module (its ``hidden_states``, i.e. after the layer norm, as in the
  paper). A KV cache keeps the value states but not x, so τ_k/τ_v of this form refuse to run with a
  cache (or cross-attention): use ``use_cache=False`` or ``sharing=True``; τ_q works with a cache.
- the position n: for a query, the number of keys transformers' mask lets it see (so with a cache,
  query i of Lq over Lk keys has n = i + Lk − Lq + 1, padding does not count); for a key/value, its
  1-based position among the keys some query may see (left padding does not count), counted from
  its document's start in packed sequences. This route builds the dense mask from the structure
  to count them (attend still gets the structure).

At initialisation τ = 1 + c₀·log n with c₀ ≈ 5.1e-6 (the module's default), so the patched model
computes what it did before to far better than 1e-3 relative; ``terms="token"`` makes it exact.
The configuration goes to ``config.sharpattn["selective"]`` and [`from_pretrained`][sharpattn.integrations.hf.from_pretrained] restores it
and the learned temperatures.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import normalizers as nz
from ..attention import attend
from ..attention.masking import Masking, Structure
from ..attention.selective import (
    Overhead,
    SelectiveConfig,
    Temperature,
    apply_temperatures,
    key_positions,
    query_positions,
)
from ..attention.selective import parameter_overhead as _parameter_overhead
from ..diagnostics.capture import add_model_kind
from ..extras import install

__all__ = [
    "FIXED_ATTR",
    "PARAMS_ATTR",
    "PREFIX",
    "PROJ_ATTR",
    "SELECTIVE",
    "SELECTIVE_ATTR",
    "apply",
    "attention_modules",
    "from_pretrained",
    "implementation_name",
    "learnable_parameters",
    "parameter_overhead",
    "register_all",
]

Tensor = torch.Tensor
PREFIX = "sharpattn:"
PARAMS_ATTR = "sharpattn_params"  # ParameterDict of learnable per-head parameters
PROJ_ATTR = "sharpattn_projections"  # ModuleDict: query-dependent parameter -> Linear(d, H)
FIXED_ATTR = "sharpattn_fixed"  # dict of fixed normalizer parameters
SELECTIVE_ATTR = "sharpattn_selective"  # ModuleDict "q"/"k"/"v" -> Temperature
_X_ATTR = "_sharpattn_x"  # the attention module's input during its forward (MLP temperatures)
_HOOKS_ATTR = "_sharpattn_hooks"
SELECTIVE = "selective"

_registered: set[str] = set()


def _transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"sharpattn.hf needs transformers: {install('hf')}.", name="transformers"
        ) from None
    return transformers


def implementation_name(method: str) -> str:
    """The transformers attention-implementation name of a sharpattn method: ``"sharpattn:<m>"``."""
    return PREFIX + nz.get(method).name


def register_all() -> list[str]:
    """Register every registry method (also ones added since the last call); returns the names."""
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    names = []
    for method in nz.available():
        name = PREFIX + method
        if name not in _registered:
            AttentionInterface.register(name, _make_attention(method))
            AttentionMaskInterface.register(name, _structure_mask)
            _registered.add(name)
        names.append(name)
    return names


def _boolean_mask(*args, allow_is_causal_skip: bool = True, dtype=None, config=None, **kwargs):
    """transformers' sdpa mask (boolean, True = attend), never skipped for causal attention."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


class _Structure:
    """What sharpattn's mask entry gives the model in place of a dense mask: the causal flag, and
    as [`sharpattn.attend`][sharpattn.attend]'s structure the packed documents (``[B, Lk]`` ids),
    the sliding window ``(left, 0)`` and the padding (``[B, 2]`` first valid key, one past the
    last). The model hands it to the attention function untouched, as it does flex attention's
    ``BlockMask``."""

    __slots__ = ("causal", "documents", "lengths", "window")

    def __init__(self, causal: bool, documents=None, window=None, lengths=None):
        self.causal = causal
        self.documents = documents
        self.window = window
        self.lengths = lengths

    def __repr__(self) -> str:  # pragma: no cover - for debugging
        docs = None if self.documents is None else tuple(self.documents.shape)
        pads = None if self.lengths is None else self.lengths.tolist()
        return (
            f"_Structure(causal={self.causal}, documents={docs}, window={self.window}, "
            f"lengths={pads})"
        )


def _closure(fn) -> tuple[str, dict[str, Any]]:
    """(the name of the transformers function that made the mask function ``fn``, its closure
    variables), or ("", {}) for anything else."""
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__module__", None) != "transformers.masking_utils":
        return "", {}
    cells = fn.__closure__ or ()
    try:
        free = {
            name: cell.cell_contents for name, cell in zip(code.co_freevars, cells, strict=True)
        }
    except ValueError:  # an empty cell
        return "", {}
    return fn.__qualname__.split(".<locals>.")[0], free


def _mask_kind(fn) -> tuple[bool, int | None, Tensor | None] | None:
    """(causal, sliding window W, packed document ids) of one of transformers' own mask functions:
    causal, bidirectional, sliding-window causal, each possibly remapped to packed sequences;
    None for any other mask function (one with extra ``and``/``or`` terms, chunked attention)."""
    from transformers import masking_utils as mu

    if fn is mu.causal_mask_function:
        return True, None, None
    if fn is mu.bidirectional_mask_function:
        return False, None, None
    name, free = _closure(fn)
    parts = free.get("mask_functions") if name == "and_masks" else None
    if not parts or len(parts) != 2:
        return None
    first, second = parts
    name_a, free_a = _closure(first)
    if name_a == "sliding_window_overlay" and second is mu.causal_mask_function:
        w = free_a.get("sliding_window")
        return (True, w, None) if isinstance(w, int) and w > 0 else None
    name_b, free_b = _closure(second)
    if (
        name_a == "remap_positions_for_packed_sequence"
        and name_b == "packed_sequence_mask_function"
    ):
        # the inner mask sees positions, which within a document (a run of +1 steps) are the
        # indices from the document's start: the same mask on indices, within each document
        inner = _mask_kind(free_a.get("mask_function"))
        ids = free_b.get("packed_sequence_mask")
        if inner is None or inner[2] is not None or not torch.is_tensor(ids):
            return None
        return inner[0], inner[1], ids
    return None


def _padding_lengths(padding: Tensor) -> Tensor | None | bool:
    """A boolean ``[B, Lk]`` padding mask (True = real token) as ``[B, 2]`` (first valid key, one
    past the last) when each row's real tokens are one contiguous run (one host read); None when
    there is no padding; False when it is not contiguous."""
    b, lk = padding.shape
    count = padding.sum(-1)
    first = padding.to(torch.uint8).argmax(-1)
    last = lk - 1 - padding.flip(-1).to(torch.uint8).argmax(-1)
    contiguous = (count == 0) | (last - first + 1 == count)
    full = count == lk
    ok, none = (bool(x) for x in torch.stack([contiguous.all(), full.all()]).tolist())
    if not ok:
        return False
    if none:
        return None
    first = torch.where(count == 0, 0, first)
    return torch.stack([first, first + count], dim=-1).to("cpu", torch.int64)


def _structure_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    config=None,
    **kwargs,
):
    """sharpattn's mask entry: the mask as structure (`_Structure`, or None for plain causal or
    full attention without padding) where it is one, else transformers' boolean sdpa mask.

    Structure: transformers' causal, bidirectional and sliding-window causal masks, also over
    packed sequences, with a padding mask whose real tokens are one run per row. A dense mask
    still where the model asks for one (``allow_is_causal_skip=False``: it adds to it), for any
    other mask function, under ``torch.compile`` and with ``check_finite=False`` (structure is
    read on the host, which waits for the device)."""
    dense = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        **kwargs,
    )
    if mask_function is not None:
        dense["mask_function"] = mask_function
    structure = _as_structure(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        allow_is_causal_skip,
        allow_is_bidirectional_skip,
        use_vmap,
        config,
    )
    if structure is False:
        return _boolean_mask(**dense)
    return structure


def _as_structure(
    b, lq, lk, q_offset, kv_offset, fn, attention_mask, skip_causal, skip_full, use_vmap, config
):
    """`_Structure` or None (no mask needed) for `_structure_mask`, False where only a dense
    mask will do."""
    spec = getattr(config, "sharpattn", None) or {}
    if not (spec.get("params") or {}).get("check_finite", True):
        return False
    if use_vmap or fn is None or torch.compiler.is_compiling():
        return False
    kind = _mask_kind(fn)
    if kind is None:
        return False
    causal, w, documents = kind
    if documents is None and not (skip_causal if causal else skip_full):
        return False  # the model adds to the mask: it wants the tensor
    if documents is not None and (documents.shape[-1] != lk or lq != lk):
        return False
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return False  # a static cache's tensor offset
    if (causal or w is not None) and q_offset + lq != kv_offset + lk:
        return False  # the last query is not at the last key (a static cache's empty slots)
    lengths = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
            return False
        padding = attention_mask[:, kv_offset : kv_offset + lk]
        if padding.shape[-1] < lk:  # transformers pads a short 2-d mask with False
            padding = nn.functional.pad(padding, (0, lk - padding.shape[-1]))
        lengths = _padding_lengths(padding.expand(b, lk))
        if lengths is False:
            return False
    window = (w - 1, 0) if w is not None and lk > w else None  # W keys, the query's included
    if documents is not None:
        documents = documents.expand(b, lk)
        if bool((documents == documents[:, :1]).all()):
            documents = None
    if documents is None and window is None and lengths is None:
        return None  # plain causal or full attention: the attention function's causal flag
    return _Structure(causal, documents, window, lengths)


# (weakref to the last position_ids, its version counter, its document ids | None)
_last_positions: list[Any] = [None, -1, None]


def _documents_of_positions(position_ids: Tensor) -> Tensor | None:
    """Document ids ``[1, L]`` of one packed row whose ``position_ids`` restart for each document
    (a new document wherever the position is not the previous one + 1, as transformers' masks
    read packed sequences), None when they do not restart. Read once per ``position_ids`` tensor
    and version (every layer gets the same one; an inference-mode tensor at every call)."""
    # an inference tensor keeps no version counter (an in-place change would go unseen): read
    # it every time
    version = None if position_ids.is_inference() else position_ids._version
    ref, last, docs = _last_positions
    if version is not None and ref is not None and ref() is position_ids and last == version:
        return docs
    p = position_ids.reshape(1, -1)
    new = torch.ones_like(p, dtype=torch.bool)
    new[:, 1:] = p[:, 1:] != p[:, :-1] + 1
    ids = new.cumsum(-1) - 1
    docs = ids if bool(ids[0, -1] > 0) else None
    if version is not None:
        _last_positions[:] = [weakref.ref(position_ids), version, docs]
    return docs


def _packing(kwargs, query: Tensor, key: Tensor, structure: dict, check_finite: bool) -> None:
    """Add the packed documents of flash-attention's padding-free batches to ``structure``:
    ``cu_seq_lens_q``/``cu_seq_lens_k`` (FlashAttentionKwargs) or, with one batch row and no
    past keys, ``position_ids`` that restart for each document (``DataCollatorWithFlattening``)."""
    b, lq, lk = query.shape[0], query.shape[2], key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        cu = cu_k if cu_k is not None else cu_q
        same = cu_q is None or cu_k is None or cu_q is cu_k or torch.equal(cu_q, cu_k)
        if b != 1 or lq != lk or not same:
            raise ValueError(
                "cu_seq_lens_q/cu_seq_lens_k describe packed sequences in one batch row, the same "
                f"for queries and keys; got batch {b}, {lq} queries and {lk} keys"
                f"{'' if same else ', different query and key lengths'}."
            )
        structure.pop("documents", None)  # the same documents, given explicitly
        structure["cu_seqlens"] = cu
        return
    positions = kwargs.get("position_ids")
    if (
        "documents" in structure
        or not check_finite
        or positions is None
        or not torch.is_tensor(positions)
        or b != 1
        or lq != lk
        or lq < 2
        or positions.numel() != lq
    ):
        return
    docs = _documents_of_positions(positions)
    if docs is not None:
        structure["documents"] = docs


def _allowed(attention_mask, query: Tensor, key: Tensor, causal: bool, check_finite: bool = True):
    """transformers' mask -> boolean mask broadcastable to [B, H, Lq, Lk] (True = attend).

    An additive float mask is checked to hold only 0 and very negative values (no biases) with
    ``check_finite`` only: the check reads the mask on the host (a sync)."""
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None:
        return None, causal and lq > 1
    if not torch.is_tensor(attention_mask):
        raise ValueError(
            f"sharpattn attention got a {type(attention_mask).__name__} mask; only tensor masks "
            "(boolean or additive 0/-inf) are supported."
        )
    if attention_mask.shape[-1] != lk:
        raise ValueError(
            f"the attention mask covers {attention_mask.shape[-1]} keys but there are {lk}."
        )
    mask = attention_mask
    if mask.dtype == torch.bool:
        return mask, False
    # An additive float mask (e.g. a user-made 4-D mask): 0 = attend, very negative = masked.
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if check_finite and bool(((mask != 0) & ~blocked).any()):
        raise ValueError(
            "sharpattn attention supports only 0/-inf additive masks, not additive biases "
            "(ALiBi, relative position biases); use the model's own attention for those."
        )
    return ~blocked, False


def _make_attention(method: str):
    entry_name = method

    def sharpattn_attention_forward(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ):
        # query (B, H, Lq, D); key/value (B, Hkv, Lk, D); returns (B, Lq, H, Dv), weights | None
        for unsupported in ("softcap", "position_bias", "s_aux", "sinks"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(
                    f"sharpattn:{entry_name} does not support the model's {unsupported!r} argument; "
                    "use the model's own attention implementation."
                )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        params = dict(getattr(module, FIXED_ATTR, {}) or {})
        check_finite = params.get("check_finite", True)
        structure: dict[str, Any] = {}
        if isinstance(attention_mask, _Structure):  # sharpattn's mask entry: no dense mask
            mask, causal = None, attention_mask.causal
            for name in ("documents", "window", "lengths"):
                if getattr(attention_mask, name) is not None:
                    structure[name] = getattr(attention_mask, name)
        else:
            mask, causal = _allowed(attention_mask, query, key, bool(causal), check_finite)
        _packing(kwargs, query, key, structure, check_finite)
        learned = getattr(module, PARAMS_ATTR, None)
        if learned is not None:
            h = query.shape[1]
            for name, p in learned.items():
                if p.shape[0] != h:
                    raise ValueError(
                        f"{name} has {p.shape[0]} heads but the layer has {h}; re-run apply()."
                    )
                params[name] = p.view(1, h, 1, 1).to(query.dtype)
        projections = getattr(module, PROJ_ATTR, None)
        if projections:  # p_{h,i} = p_h + w_h·x_i: [B, H, Lq, 1]
            x = getattr(module, _X_ATTR, None)
            if x is None or x.shape[1] != query.shape[2]:
                raise ValueError(
                    f"sharpattn:{entry_name}'s query-dependent parameters did not get the layer "
                    "input of the queries; re-run sharpattn.hf.apply(model, ...)."
                )
            for name, proj in projections.items():
                w = proj(x.to(proj.weight.dtype)).transpose(1, 2).unsqueeze(-1)
                params[name] = params[name] + w.to(query.dtype)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
        temperatures = getattr(module, SELECTIVE_ATTR, None)
        if temperatures is not None:  # selective attention: scale rows of q, k, v (scale stays)
            # the positions n need which keys each query sees: with structure, read from the
            # dense mask it makes (this route only; attend itself still gets the structure)
            seen, starts = mask, None
            if structure:
                seen, starts = _dense_mask(mask, causal, query, key, structure)
            query, key, value = _selective_scale(
                module, temperatures, query, key, value, seen, causal and seen is None, starts
            )
        want_weights = bool(kwargs.get("output_attentions")) or (dropout > 0 and module.training)
        result = attend(
            query,
            key,
            value,
            entry_name,
            mask=mask,
            causal=causal,
            **structure,
            scale=scale,
            return_weights=want_weights,
            **params,
        )
        out, weights = result if want_weights else (result, None)
        # (attend is where sharpattn.diagnostics.capture observes; capture runs in eval mode)
        if dropout > 0 and module.training:  # dropout on the weights, as transformers' eager does
            rep = query.shape[1] // value.shape[1]
            v = value.repeat_interleave(rep, dim=1) if rep > 1 else value
            out = torch.matmul(nn.functional.dropout(weights, p=dropout).to(v.dtype), v)
        return out.transpose(1, 2).contiguous(), weights

    sharpattn_attention_forward.__name__ = f"sharpattn_{method}_attention_forward"
    return sharpattn_attention_forward


def _dense_mask(mask, causal, query, key, structure) -> tuple[Tensor, Tensor | None]:
    """The boolean mask ``[B|1, 1, Lq, Lk]`` of a mask, the causal flag and `attend`'s structure,
    and the first key of each key's document ``[1|B, Lk]`` (None without documents)."""
    lk = key.shape[2]
    b = query.shape[0]
    built = Structure.build(
        structure.get("documents"),
        structure.get("cu_seqlens"),
        structure.get("window"),
        structure.get("lengths"),
        b,
        lk,
    )
    dense = Masking.build(mask, causal, query.shape[2], lk, query.device, built).dense()
    return dense, None if built is None else built.doc_start


def _selective_scale(module, temperatures, query, key, value, mask, causal, doc_start=None):
    """q, k, v with their rows scaled by τ (see the module docstring for x and n); with packed
    documents (``doc_start`` ``[1|B, Lk]``, each key's document's first key) a key's n counts
    from its document's start."""
    lq, lk = query.shape[2], key.shape[2]
    x = getattr(module, _X_ATTR, None)
    states = {"q": query, "k": key, "v": value}
    taus = {}
    for target, temperature in temperatures.items():
        if target == "q":
            n = query_positions(lq, lk, mask=mask, causal=causal, device=query.device)
        else:
            key_mask = None
            if mask is not None:  # a key counts if some query may see it
                m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
                key_mask = m.any(dim=-2).any(dim=1)  # (B', Lk)
            n = key_positions(lk, key_mask=key_mask, device=key.device)
            if doc_start is not None:  # keys before the document's first key do not count
                start = doc_start.to(n.device).unsqueeze(1)  # (1|B, 1, Lk)
                count = n.expand(max(n.shape[0], start.shape[0]), 1, lk)
                before = count.gather(-1, (start - 1).clamp(min=0).expand_as(count))
                n = count - torch.where(start > 0, before, 0)
        if temperature.token == "mlp":
            if x is None:
                raise ValueError(
                    "the selective MLP temperature did not get the layer input; re-run "
                    "sharpattn.hf.apply(model, 'selective', ...)."
                )
            if x.shape[1] != (lq if target == "q" else lk):
                raise ValueError(
                    f"the sharing=False temperature of {target} needs the layer input of every "
                    "key, which a KV cache (or cross-attention) does not keep; pass "
                    "use_cache=False or apply selective with sharing=True."
                )
        # the temperatures are float32 parameters whatever the model's dtype: x follows them
        xt = None if x is None else x.to(next(temperature.parameters()).dtype)
        taus[f"tau_{target}"] = temperature(n, x=xt, proj=states[target])
    return apply_temperatures(query, key, value, **taus)


def _remember_input(module, args, kwargs):
    x = kwargs.get("hidden_states", args[0] if args else None)
    setattr(module, _X_ATTR, x)


def _forget_input(module, args, kwargs, output):
    setattr(module, _X_ATTR, None)


def _remove_selective(module: nn.Module) -> None:
    """Drop what apply() attached beyond the per-head parameters: selective temperatures,
    query-dependent maps and the input hooks."""
    for handle in getattr(module, _HOOKS_ATTR, ()):
        handle.remove()
    for attr in (SELECTIVE_ATTR, PROJ_ATTR, _HOOKS_ATTR, _X_ATTR):
        if hasattr(module, attr):
            delattr(module, attr)


def _num_kv_heads(module: nn.Module, heads: int) -> int:
    for source in (module, module.config):
        for attr in ("num_key_value_heads", "num_kv_heads"):
            n = getattr(source, attr, None)
            if isinstance(n, int):
                return n
    return heads


def _head_dim(module: nn.Module, heads: int) -> int:
    for attr in ("head_dim", "head_size"):
        n = getattr(module, attr, None)
        if isinstance(n, int):
            return n
    return int(module.config.hidden_size) // heads


def _apply_selective(
    model: nn.Module,
    targets: str = "qv",
    *,
    sharing: bool = False,
    token: str | None = None,
    terms: str = "both",
    hidden: int | None = None,
    position_param: str = "exp",
    position_init: float | None = None,
    normalizer: str = "softmax",
    **params: Any,
) -> nn.Module:
    if normalizer == SELECTIVE:
        raise ValueError("normalizer= names the method selective attention uses, e.g. 'softmax'.")
    config = SelectiveConfig(
        targets=targets,
        sharing=sharing,
        token=token,
        terms=terms,
        hidden=hidden,
        position_param=position_param,
        position_init=position_init,
    )
    if config.token_form == "feature":
        raise ValueError(
            "the feature-based temperature needs per-token features, which a transformers model "
            "does not pass to its attention; use token='mlp' or sharing=True."
        )
    apply(model, normalizer, **params)
    for module in attention_modules(model):
        ref = next(module.parameters(), None)
        factory = {"device": ref.device if ref is not None else None, "dtype": torch.float32}
        heads = _num_heads(module)
        kv_heads = _num_kv_heads(module, heads)
        head_dim = _head_dim(module, heads)
        embed_dim = int(module.config.hidden_size)
        temperatures = nn.ModuleDict(
            {
                t: Temperature(
                    embed_dim, heads if t == "q" else kv_heads, head_dim, config, **factory
                )
                for t in "kqv"
                if t in config.targets
            }
        )
        setattr(module, SELECTIVE_ATTR, temperatures)
        hooks = getattr(module, _HOOKS_ATTR, [])  # apply()'s, for query-dependent parameters
        if config.token_form == "mlp" and not hooks:
            hooks.append(module.register_forward_pre_hook(_remember_input, with_kwargs=True))
            hooks.append(
                module.register_forward_hook(_forget_input, with_kwargs=True, always_call=True)
            )
        setattr(module, _HOOKS_ATTR, hooks)
    model.config.sharpattn[SELECTIVE] = {
        "targets": config.targets,
        "sharing": config.sharing,
        "token": config.token,
        "terms": config.terms,
        "hidden": config.hidden,
        "position_param": config.position_param,
        "position_init": config.position_init,
    }
    return model


def parameter_overhead(model: nn.Module) -> Overhead:
    """Parameters the selective temperatures add to a (patched) transformers model: ``added``,
    ``base`` (all others) and ``fraction`` = added / base."""
    return _parameter_overhead(model)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that call transformers' attention interface, in model order."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "scaling") and hasattr(m, "config") and hasattr(m, "is_causal")
    ]


def _captured_modules(model: nn.Module) -> list[nn.Module]:
    """`sharpattn.diagnostics.capture`'s view of a transformers model: its attention modules."""
    if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
        return []
    return attention_modules(model)


def _route_through_attend(model: nn.Module):
    """While captured, a model on eager / sdpa / flash attention (all softmax) runs sharpattn's
    softmax, which calls attend; returns the undo."""
    register_all()
    previous = model.config._attn_implementation
    if str(previous).startswith(PREFIX):
        return lambda: None
    model.set_attn_implementation(implementation_name("softmax"))
    return lambda: model.set_attn_implementation(previous)


add_model_kind(_captured_modules, _route_through_attend)


def _num_heads(module: nn.Module) -> int:
    for attr in ("num_heads", "num_attention_heads"):
        n = getattr(module, attr, None)
        if isinstance(n, int):
            return n
    return int(module.config.num_attention_heads)


def apply(model: nn.Module, method: str, **params: Any) -> nn.Module:
    """Switch a loaded transformers model to sharpattn ``method`` in place; returns the model.

    ``params`` go to the normalizer (and ``check_finite=False`` to [`sharpattn.attend`][sharpattn.attend]: no
    check reads tensor values, so the attention never waits for the device and
    ``torch.compile`` captures it whole). Learnable ones become per-layer, per-head trainable
    ``nn.Parameter``s initialised to the given value or the registry default (the default leaves
    the model computing what it did, where the method allows).

    ``method="selective"`` adds selective-attention temperatures (see the module docstring):
    ``apply(model, "selective", targets="qv", sharing=False, normalizer="softmax", token=None,
    terms="both", hidden=None, position_param="exp", position_init=None, **normalizer_params)``.
    """
    _transformers()
    if method == SELECTIVE:
        return _apply_selective(model, **params)
    entry = nz.get(method)
    register_all()
    # names, types, ranges and a tensor's shape (one value per row, [B|1, H|1, Lq|1, 1]; attend
    # checks it again against each call's sizes): once, here
    entry.check_params(params, rows=(None, None, None))
    entry.check_initial_values(params, "apply()", "every layer and head")
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention module using transformers' AttentionInterface."
        )
    learnable = {p.name: params.pop(p.name, p.default) for p in entry.learnable}
    for module in modules:
        _remove_selective(module)
        ref = next(module.parameters(), None)
        factory = {"device": ref.device if ref is not None else None, "dtype": torch.float32}
        h = _num_heads(module)
        setattr(
            module,
            PARAMS_ATTR,
            nn.ParameterDict(
                {
                    n: nn.Parameter(torch.full((h,), float(v), **factory))
                    for n, v in learnable.items()
                }
            ),
        )
        setattr(module, FIXED_ATTR, dict(params))
        dependent = [n for n in entry.query_dependent if n in learnable]
        if dependent:
            d = int(module.config.hidden_size)
            maps = nn.ModuleDict({n: nn.Linear(d, h, bias=False, **factory) for n in dependent})
            for proj in maps.values():
                nn.init.zeros_(proj.weight)
            setattr(module, PROJ_ATTR, maps)
            setattr(
                module,
                _HOOKS_ATTR,
                [
                    module.register_forward_pre_hook(_remember_input, with_kwargs=True),
                    module.register_forward_hook(_forget_input, with_kwargs=True, always_call=True),
                ],
            )
    name = implementation_name(entry.name)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(
            f"{type(model).__name__} does not let its attention implementation be changed "
            "(it does not use transformers' AttentionInterface)."
        )
    model.config.sharpattn = {"method": entry.name, "params": _jsonable(params)}
    return model


def _jsonable(params: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in params.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)):
            out[k] = [float(x) for x in v]
        else:
            out[k] = str(v)
    return out


def learnable_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter that [`apply`][sharpattn.integrations.hf.apply] attached."""
    for name, p in model.named_parameters():
        if _is_sharpattn_key(name):
            yield name, p


def _is_sharpattn_key(name: str) -> bool:
    return any(f".{attr}." in f".{name}" for attr in (PARAMS_ATTR, SELECTIVE_ATTR, PROJ_ATTR))


#: sharpattn's tensors in a saved model's state dict (as a transformers ignore pattern)
_SHARPATTN_KEY = r"(^|\.)(" + "|".join((PARAMS_ATTR, SELECTIVE_ATTR, PROJ_ATTR)) + r")\."


def _quiet_class(model_class, path: str | Path, kwargs: dict[str, Any]):
    """A subclass of the class ``model_class.from_pretrained`` builds (an auto class resolved
    through the saved config) whose load report leaves out sharpattn's tensors: transformers
    does not know them, lists each as UNEXPECTED, and `from_pretrained` loads them afterwards.
    None where the class cannot be resolved (the report is then left as it is)."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:  # an auto class: the concrete class of the saved config
        try:
            config = kwargs.get("config")
            if config is None or isinstance(config, (str, Path)):
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(config or path)
            model_class = mapping[type(config)]
        except Exception:  # remote code, an unknown architecture: transformers says why later
            return None
    if not isinstance(model_class, type):
        return None
    ignored = set(getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or ())
    attrs = {
        "_keys_to_ignore_on_load_unexpected": sorted(ignored | {_SHARPATTN_KEY}),
        "__module__": model_class.__module__,
        "__qualname__": model_class.__qualname__,
    }
    return type(model_class.__name__, (model_class,), attrs)


def from_pretrained(path: str | Path, model_class=None, **kwargs) -> nn.Module:
    """Load a model saved after [`apply`][sharpattn.integrations.hf.apply] (``save_pretrained``), patched and with its learned
    sharpattn parameters. ``model_class`` defaults to ``transformers.AutoModel``.

    transformers' load report (any tensor of the files the model does not hold, any it misses)
    leaves out sharpattn's own tensors, which this function loads itself; every other key is
    reported as transformers reports it."""
    _transformers()
    from safetensors import safe_open

    if model_class is None:
        from transformers import AutoModel as model_class
    quiet = _quiet_class(model_class, path, kwargs)
    if quiet is None:
        model = model_class.from_pretrained(path, **kwargs)
    else:
        model = quiet.from_pretrained(path, **kwargs)
        model.__class__ = quiet.__bases__[0]  # the class itself: the subclass only loaded it
        ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
        if isinstance(ignored, set):  # post_init's copy, which later loads read
            ignored.discard(_SHARPATTN_KEY)
    spec = getattr(model.config, "sharpattn", None)
    if not spec:
        return model
    if spec.get(SELECTIVE):
        apply(
            model, SELECTIVE, normalizer=spec["method"], **spec[SELECTIVE], **spec.get("params", {})
        )
    else:
        apply(model, spec["method"], **spec.get("params", {}))
    wanted = dict(learnable_parameters(model))
    found = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if _is_sharpattn_key(key):
                    found[key] = f.get_tensor(key)
    with torch.no_grad():
        for name, p in wanted.items():
            match = [
                k for k in found if k == name or k.endswith("." + name) or name.endswith("." + k)
            ]
            if len(match) != 1:
                raise ValueError(f"{path} holds no saved value for sharpattn parameter {name!r}.")
            p.copy_(found[match[0]])
    return model
