"""DropInMultiheadAttention: ``torch.nn.MultiheadAttention``'s interface with any normalizer, and
[`swap`][sharpattn.swap], which puts it in place of every ``torch.nn.MultiheadAttention`` of a
model.

The module has torch's constructor, forward signature, return value, mask meanings and parameter
names (``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``; or
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` when ``kdim``/``vdim`` differ from
``embed_dim``), so a torch state dict loads unchanged and, with ``method="softmax"``, it computes
what torch's module computes. The attention itself is [`attend`][sharpattn.attend].
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..normalizers import get
from .functional import attend
from .mha import normalizer_parameters, row_parameters

Tensor = torch.Tensor


def _unsupported(add_bias_kv: bool, add_zero_attn: bool) -> str | None:
    """The torch option the drop-in can not honour, in words, or None."""
    if add_bias_kv:
        return "add_bias_kv=True (a learned key and value appended to every sequence)"
    if add_zero_attn:
        return "add_zero_attn=True (a zero key and value appended to every sequence)"
    return None


def _allowed(mask: Tensor, name: str) -> Tensor:
    """torch's mask (bool: True = not allowed; float: added to the scores) as the library's
    boolean mask (True = may attend)."""
    if mask.dtype == torch.bool:
        return ~mask
    if not mask.is_floating_point():
        raise ValueError(f"{name} must be a bool or float tensor, got {mask.dtype}.")
    allowed = mask == 0
    if not bool((allowed | (mask == float("-inf"))).all()):
        raise ValueError(
            f"a float {name} may only hold 0 and -inf (allowed and not allowed), since other "
            "additive biases have no meaning for most normalizers."
        )
    return allowed


class DropInMultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` with any registered normalizer.

    The arguments up to ``dtype`` are torch's, with torch's meanings; ``add_bias_kv=True`` and
    ``add_zero_attn=True`` are refused. ``dropout`` is applied to the attention weights while
    training, as torch does, which needs the weights matrix (the O(n²) naive path); in eval mode,
    or with ``dropout=0``, the attention runs on the method's fastest path.

    Args:
        embed_dim: model width E.
        num_heads: number of heads H; must divide E.
        dropout: probability of zeroing an attention weight while training.
        bias: biases in the input and output projections.
        add_bias_kv: refused when True.
        add_zero_attn: refused when True.
        kdim: width of the key input (default E).
        vdim: width of the value input (default E).
        batch_first: inputs and output ``[B, L, E]`` instead of ``[L, B, E]``.
        device: where the parameters are made.
        dtype: the parameters' dtype.
        method: normalizer name (``sharpattn.normalizers.available()``).
        **method_params: normalizer parameters, as for
            [`MultiheadAttention`][sharpattn.MultiheadAttention]: learnable ones become per-head
            ``nn.Parameter``s in ``self.normalizer_params`` (not in a torch state dict: load one
            with ``strict=False``, or use [`swap`][sharpattn.swap]).
    """

    #: read by ``torch.nn.TransformerEncoderLayer`` to choose its fused inference path, which
    #: would compute softmax attention from our weights without calling ``forward``; False keeps
    #: it calling ``forward`` (whether the projections are packed is ``self.packed``)
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        method: str = "softmax",
        **method_params,
    ):
        super().__init__()
        unsupported = _unsupported(add_bias_kv, add_zero_attn)
        if unsupported is not None:
            raise ValueError(f"DropInMultiheadAttention does not support {unsupported}.")
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be positive and divide embed_dim ({embed_dim})."
            )
        if isinstance(dropout, bool) or not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}.")
        entry = get(method)
        entry.check_params(method_params, rows=(None, num_heads, None))
        factory = {"device": device, "dtype": dtype}
        self.method = entry.name
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout, self.batch_first = float(dropout), batch_first
        self.add_zero_attn = False
        self.bias_k = self.bias_v = None
        #: one ``[3E, E]`` input projection (torch's ``_qkv_same_embed_dim``)
        self.packed = self.kdim == embed_dim and self.vdim == embed_dim
        e = embed_dim
        if self.packed:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * e, e, **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(e, e, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(e, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(e, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * e, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(e, e, bias=bias, **factory)
        self.normalizer_params, self.normalizer_projections, self.method_params = (
            normalizer_parameters(
                entry, method_params, num_heads, e, "DropInMultiheadAttention", device, dtype
            )
        )
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform input projections, zero biases."""
        if self.packed:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, method: str = "softmax", **method_params
    ) -> DropInMultiheadAttention:
        """The drop-in of ``module``'s configuration, weights, device, dtype and training mode,
        attending with ``method``; learnable normalizer parameters start at the value given or
        the registry default."""
        ref = module.out_proj.weight
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device=ref.device,
            dtype=ref.dtype,
            method=method,
            **method_params,
        )
        missing, unexpected = new.load_state_dict(module.state_dict(), strict=False)
        ours = ("normalizer_params.", "normalizer_projections.")
        if unexpected or any(not key.startswith(ours) for key in missing):
            raise ValueError(
                f"the state dict of {type(module).__name__} does not match the drop-in's "
                f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})."
            )
        return new.train(module.training)

    def _projection_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        if self.packed:
            return self.in_proj_weight.chunk(3)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``torch.nn.MultiheadAttention.forward``, with torch's meanings.

        Args:
            query: ``[L, B, E]`` (``[B, L, E]`` with ``batch_first``) or unbatched ``[L, E]``.
            key: ``[S, B, kdim]`` (``[B, S, kdim]``) or ``[S, kdim]``.
            value: ``[S, B, vdim]`` (``[B, S, vdim]``) or ``[S, vdim]``.
            key_padding_mask: ``[B, S]`` (``[S]`` unbatched): bool, True = a padding key to
                ignore; or float, added to the scores (only 0 and -inf).
            need_weights: also return the attention weights; they are computed on the naive
                path (the whole score matrix, O(L·S) memory).
            attn_mask: ``[L, S]`` or ``[B·H, L, S]`` (``[H, L, S]`` unbatched): bool, True = not
                allowed to attend; or float, added to the scores (only 0 and -inf).
            average_attn_weights: average the returned weights over the heads.
            is_causal: a hint that ``attn_mask`` is the causal mask, which must be given (as
                torch requires); the mask is used as it is.

        Returns:
            ``(attn_output, attn_weights)``: the output in the query's layout, and the weights
            ``[B, L, S]`` (averaged) or ``[B, H, L, S]`` (without the B unbatched), or None
            without ``need_weights``.
        """
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "query, key and value must all be batched (3-D) or all unbatched (2-D); got "
                f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}."
            )
        batched = query.dim() == 3
        if not batched:  # [L, E] -> [1, L, E]
            query, key, value = query[None], key[None], value[None]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[None]
        elif not self.batch_first:  # [L, B, E] -> [B, L, E]
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"key and value must have the same batch and length, got {tuple(key.shape)} and "
                f"{tuple(value.shape)}."
            )
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True is a hint that attn_mask is the causal mask, so attn_mask must "
                "be given too (as torch.nn.MultiheadAttention requires)."
            )
        h, hd = self.num_heads, self.head_dim
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        weights = self._projection_weights()
        q, k, v = (
            F.linear(x, w, bias).view(b, x.shape[1], h, hd).transpose(1, 2)
            for x, w, bias in zip((query, key, value), weights, biases, strict=True)
        )  # (B, H, L|S, hd)
        mask = self._mask(key_padding_mask, attn_mask, b, lq, lk)
        params = row_parameters(self, query)
        dropping = self.training and self.dropout > 0
        if need_weights or dropping:
            out, attn = attend(
                q, k, v, self.method, mask=mask, impl="naive", return_weights=True, **params
            )
            if dropping:  # torch's dropout on the weights: recompute the output from them
                attn = F.dropout(attn, self.dropout)
                out = torch.matmul(attn, v.to(attn.dtype))
        else:
            out, attn = attend(q, k, v, self.method, mask=mask, **params), None
        out = self.out_proj(out.to(v.dtype).transpose(1, 2).reshape(b, lq, self.embed_dim))
        if not batched:
            out = out[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        attn = attn.to(query.dtype)
        if average_attn_weights:
            attn = attn.mean(dim=1)
        return out, (attn if batched else attn[0])

    def _mask(self, key_padding_mask, attn_mask, b, lq, lk) -> Tensor | None:
        """torch's two masks as one boolean mask broadcastable to ``[B, H, L, S]``, True = may
        attend (None: every key)."""
        mask = None
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (b, lk):
                raise ValueError(
                    f"key_padding_mask must be [B, S] = {[b, lk]} ([S] unbatched), got "
                    f"{tuple(key_padding_mask.shape)}."
                )
            mask = _allowed(key_padding_mask, "key_padding_mask")[:, None, None, :]
        if attn_mask is not None:
            heads = b * self.num_heads
            if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (lq, lk):
                allowed = _allowed(attn_mask, "attn_mask")[None, None]
            elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (heads, lq, lk):
                allowed = _allowed(attn_mask, "attn_mask").view(b, self.num_heads, lq, lk)
            else:
                raise ValueError(
                    f"attn_mask must be [L, S] = {[lq, lk]} or [B·H, L, S] = {[heads, lq, lk]}, "
                    f"got {tuple(attn_mask.shape)}."
                )
            mask = allowed if mask is None else mask & allowed
        return mask

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, method={self.method!r}"
            + (f", kdim={self.kdim}, vdim={self.vdim}" if not self.packed else "")
            + (f", dropout={self.dropout:g}" if self.dropout else "")
            + f", batch_first={self.batch_first}"
        )


def swap(model: nn.Module, method: str, **params) -> nn.Module:
    """Replace every ``torch.nn.MultiheadAttention`` of ``model`` (at any depth, in place) by a
    [`DropInMultiheadAttention`][sharpattn.attention.DropInMultiheadAttention] attending with
    ``method``; returns the model.

    Each replacement has its module's configuration, weights, device, dtype and training mode
    (`DropInMultiheadAttention.from_torch`); ``params`` go to the normalizer (learnable ones
    start at the value given or the registry default, per module and head). A module used at
    several places is replaced by one drop-in. Nothing changes when a module can not be swapped
    (``add_bias_kv``, ``add_zero_attn``): the refusal names its path. A ``model`` that is itself
    a ``torch.nn.MultiheadAttention`` can not be replaced in place: its drop-in is returned.
    ``torch.nn.TransformerEncoder``'s nested-tensor inference path is turned off
    (``use_nested_tensor = False``) where it holds a swapped layer: it calls the attention
    with nested tensors, which ``attend`` does not take.
    """
    get(method)  # an unknown method: refused before anything changes
    new_of: dict[nn.Module, DropInMultiheadAttention] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        unsupported = _unsupported(module.bias_k is not None, module.add_zero_attn)
        if unsupported is not None:
            raise ValueError(
                f"cannot swap the torch.nn.MultiheadAttention at {path or 'the top'!r}: the "
                f"drop-in does not support {unsupported}."
            )
        new_of[module] = DropInMultiheadAttention.from_torch(module, method, **params)
    if not new_of:
        raise ValueError(f"{type(model).__name__} holds no torch.nn.MultiheadAttention to swap.")
    if model in new_of:
        return new_of[model]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child in new_of:
                setattr(parent, name, new_of[child])
    for encoder in model.modules():
        if isinstance(encoder, nn.TransformerEncoder) and any(
            isinstance(m, DropInMultiheadAttention) for m in encoder.modules()
        ):
            encoder.use_nested_tensor = False
    return model
