"""MultiheadAttention: an attention layer for ``[B, L, d]`` inputs, any normalizer (the drop-in for
``torch.nn.MultiheadAttention`` is `dropin.DropInMultiheadAttention`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..normalizers import Param, get
from .functional import attend, check_devices
from .masking import Masking, Structure
from .positions import LINEAR_BIASES, bias_columns, slopes_of
from .rotary import apply_rotary
from .selective import (
    SelectiveConfig,
    Temperature,
    key_positions,
    query_positions,
    selective_attend,
)

Tensor = torch.Tensor

#: the gated-attention options of `MultiheadAttention` (Qiu et al. 2025)
GATES = (None, "headwise", "elementwise")
#: the on/off options of `MultiheadAttention`, checked as normalizer parameters are
OPTIONS = (
    Param("bias", True, "biases in the four projections"),
    Param("causal", False, "causal masking by default"),
    Param("rotary", False, "rotary position embeddings"),
)


def normalizer_parameters(entry, method_params, num_heads, embed_dim, owner, device, dtype):
    """The normalizer parameters of an attention module with ``num_heads`` heads:
    ``(learnable, projections, fixed)``.

    ``learnable``: an ``nn.ParameterDict`` of one ``[H]`` parameter per learnable parameter of
    ``entry`` (initialised to the number in ``method_params`` or the registry default);
    ``projections``: an ``nn.ModuleDict`` of zero-initialised ``nn.Linear(embed_dim, H)`` for
    the learnable ones the registry marks ``query_dependent``; ``fixed``: the other
    ``method_params``. ``method_params`` must have passed ``entry.check_params``; a tensor given
    for a learnable parameter is refused (``owner`` names the module in the sentence).
    """
    entry.check_initial_values(method_params, owner, "every head")
    fixed = dict(method_params)
    factory = {"device": device, "dtype": dtype}
    learnable = nn.ParameterDict(
        {
            p.name: nn.Parameter(
                torch.full((num_heads,), float(fixed.pop(p.name, p.default)), **factory)
            )
            for p in entry.learnable
        }
    )
    projections = nn.ModuleDict(
        {
            name: nn.Linear(embed_dim, num_heads, bias=False, **factory)
            for name in entry.query_dependent
            if name in learnable
        }
    )
    for proj in projections.values():
        nn.init.zeros_(proj.weight)
    return learnable, projections, fixed


def row_parameters(module: nn.Module, query: Tensor) -> dict:
    """The normalizer parameters ``attend`` gets from ``module`` (its ``method_params``,
    ``normalizer_params`` and ``normalizer_projections``, see `normalizer_parameters`) for the
    layer input ``query`` ``[B, Lq, d]``: a learnable one per head, ``[1, H, 1, 1]``, or per
    query, p_h + w_h·x_i, ``[B, H, Lq, 1]``."""
    params = dict(module.method_params)
    for name, p in module.normalizer_params.items():
        params[name] = p.view(1, -1, 1, 1)
        if name in module.normalizer_projections:
            w = module.normalizer_projections[name](query).transpose(1, 2).unsqueeze(-1)
            params[name] = params[name] + w
    return params


class MultiheadAttention(nn.Module):
    """Multi-head (and grouped-query) attention with any registered normalizer.

    Args:
        embed_dim: model width d of the ``[B, L, d]`` inputs and of the output.
        num_heads: number of query heads H.
        method: normalizer name (``sharpattn.normalizers.available()``).
        num_kv_heads: key/value heads (grouped-query attention); must divide ``num_heads``.
        head_dim: per-head size; default ``embed_dim // num_heads``.
        kdim: width of the key input (default ``embed_dim``).
        vdim: width of the value input (default ``embed_dim``).
        bias: biases in the four projections.
        causal: default causal masking for [`forward`][sharpattn.attention.mha.MultiheadAttention.forward].
        selective: selective attention (Zhang et al., NeurIPS 2024): per-token temperatures on
            ``"q"``, ``"v"``, ``"qv"`` or ``"kqv"``, or a [`SelectiveConfig`][sharpattn.attention.SelectiveConfig] for the other
            choices (token/position terms, MLP width, feature-based). Identity at initialisation
            (see `sharpattn.attention.selective`).
        sharing: with ``selective``, the weight-sharing token temperature (reuses the projections;
            one vector per head) instead of a separate MLP.
        rotary: rotary position embeddings (`sharpattn.attention.rotary`) on q and k after
            the projections (and after selective temperatures are computed, so a weight-sharing
            τ_tok sees the unrotated projection; scaling a row commutes with rotating it). Keys
            are at positions 0..Lk−1 and queries at the last Lq of them (a cache's offset).
        rotary_base: the RoPE base (θ_i = base^{−2i/D}).
        alibi: a linear position bias added to every score of head h, −m_h·(i − j) for query
            position i and key position j (`sharpattn.attention.positions`): ``"alibi"``
            (Press et al.: every head, slopes m_h = 2^{−8h/H} for H a power of 2) or
            ``"nape"`` (NoPE + ALiBi, as ASEntmax's code has it: slopes 1, 1/2, … on the first
            ⌊H/2⌋ heads, no bias on the others; needs H ≥ 2). It rides two extra columns of q
            and k, so every normalizer runs it on every path (the fast ones in O(n) memory);
            the normalizer sees the biased score (a temperature scales the bias too). 16-bit
            inputs are attended in float32 (positions in a 16-bit column would be rounded).
            Keys are at positions 0..Lk−1, queries at the last Lq of them. Not with ``rotary``.
        gate: gated attention (Qiu et al. 2025, *Gated Attention for Large Language Models:
            Non-linearity, Sparsity, and Attention-Sink-Free*, the gate at position G1): the
            attention output of head h at query i, Y_{h,i}, is multiplied by σ(x_i·W_θ) before the
            output projection, x_i the query's layer input. ``"elementwise"`` (their best
            variant): one gate per output dimension, W_θ ``[d, H·head_dim]``; ``"headwise"``: one
            per head, W_θ ``[d, H]``; both without bias (Y' = Y ⊙ σ(XW_θ), their Eq.), default
            ``nn.Linear`` initialisation, in ``self.gate_proj``. None (default): no gate.
        **method_params: normalizer parameters. Learnable ones (see the registry) become
            per-head ``nn.Parameter``s in ``self.normalizer_params``, initialised to the value given
            here or the registry default; the others are passed as given. The learnable ones the
            registry marks ``query_dependent`` (ASEntmax's) also get a linear map of the query's
            input, p_{h,i} = p_h + w_h·x_i (``self.normalizer_projections``, w initialised to 0,
            so p starts per head).

    Masks follow the library's single convention: True = may attend / is a real token.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        method: str = "softmax",
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        causal: bool = False,
        selective: str | SelectiveConfig | None = None,
        sharing: bool | None = None,
        rotary: bool = False,
        rotary_base: float = 10000.0,
        alibi: str | None = None,
        gate: str | None = None,
        device=None,
        dtype=None,
        **method_params,
    ):
        super().__init__()
        entry = get(method)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must be positive and divide num_heads ({num_heads})."
            )
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}) "
                    "unless head_dim is given."
                )
            head_dim = embed_dim // num_heads
        if rotary and head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {head_dim}.")
        if alibi is not None:
            if alibi not in LINEAR_BIASES:
                raise ValueError(
                    f"alibi must be None or one of {', '.join(map(repr, LINEAR_BIASES))}, "
                    f"got {alibi!r}."
                )
            if rotary:
                raise ValueError("alibi and rotary are two position schemes: pick one.")
            slopes_of(alibi, num_heads)  # nape with one head: refused here, in one sentence
        for option in OPTIONS:  # the layer's own switches (a method parameter of the same name,
            # e.g. sink's bias, can not be given here: it starts at its registry default)
            option.check(locals()[option.name], "MultiheadAttention")
        # names, types, ranges and a tensor's shape (one value per row: [B|1, H|1, Lq|1, 1]):
        # at construction, once; attend checks the shapes again against each call's B and Lq
        entry.check_params(method_params, rows=(None, num_heads, None))
        self.method = entry.name
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.causal = head_dim, causal
        self.rotary, self.rotary_base = bool(rotary), float(rotary_base)
        self.alibi = alibi
        #: the heads' slopes of ``alibi`` (Python numbers: no buffer, so old checkpoints load
        #: and a cast of the module to 16 bits does not round them)
        self.alibi_slopes = None if alibi is None else tuple(slopes_of(alibi, num_heads))
        factory = {"device": device, "dtype": dtype}
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        learnable, projections, fixed = normalizer_parameters(
            entry, method_params, num_heads, embed_dim, "MultiheadAttention", device, dtype
        )
        self.normalizer_params, self.normalizer_projections = learnable, projections
        self.method_params = fixed  # fixed (non-learnable) normalizer parameters
        self.selective = self._selective(selective, sharing, factory)
        if gate not in GATES:
            raise ValueError(f"gate must be one of {', '.join(map(repr, GATES))}, got {gate!r}.")
        self.gate = gate
        if gate is not None:
            width = num_heads * head_dim if gate == "elementwise" else num_heads
            self.gate_proj = nn.Linear(embed_dim, width, bias=False, **factory)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool | None = None,
        documents: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        window: tuple[int | None, int | None] | None = None,
        lengths: Tensor | None = None,
        return_weights: bool = False,
        impl: str = "auto",
        token_features: Tensor | None = None,
        key_features: Tensor | None = None,
    ):
        """Attend ``query`` ``[B, Lq, d]`` over ``key``/``value`` ``[B, Lk, ·]`` (self-attention
        when omitted).

        ``key_mask`` ``[B, Lk]``: True for real tokens, False for padding. ``mask``: boolean,
        broadcastable to ``[B, H, Lq, Lk]``, True = may attend. ``documents``/``cu_seqlens``
        (packed sequences), ``window`` and ``lengths`` (padding) go to
        [`attend`][sharpattn.attend] as structure, with no ``[Lq, Lk]`` mask; with
        documents, rotary positions restart at 0 in each document. Returns ``[B, Lq, d]``, and
        the weights ``[B, H, Lq, Lk]`` too with ``return_weights=True``.
        ``token_features`` ``[B, Lq(, F)]`` / ``key_features`` ``[B, Lk(, F)]``: the per-token
        features of a feature-based selective temperature (key_features default to
        token_features in self-attention).
        """
        self_attention = key is None
        key = query if key is None else key
        value = key if value is None else value
        check_devices(
            "MultiheadAttention",
            query=query,
            key=key,
            value=value,
            key_mask=key_mask,
            mask=mask,
            token_features=token_features,
            key_features=key_features,
            module=self.q_proj.weight,
        )
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(
                f"inputs must be [B, L, d]; got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}."
            )
        b, lq, _ = query.shape
        lk = key.shape[1]
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(b, lq, h, hd).transpose(1, 2)  # (B, H, Lq, hd)
        k = self.k_proj(key).view(b, lk, hkv, hd).transpose(1, 2)  # (B, Hkv, Lk, hd)
        v = self.v_proj(value).view(b, lk, hkv, hd).transpose(1, 2)  # (B, Hkv, Lk, hd)
        if key_mask is not None:
            if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, lk):
                raise ValueError(
                    f"key_mask must be a boolean [B, Lk] = {[b, lk]} tensor (True = real token), "
                    f"got {key_mask.dtype} {tuple(key_mask.shape)}."
                )
            km = key_mask[:, None, None, :]  # (B, 1, 1, Lk)
            mask = km if mask is None else mask & km
        params = row_parameters(self, query)
        causal = self.causal if causal is None else causal
        structure = Structure.build(documents, cu_seqlens, window, lengths, b, lk)
        kw = dict(documents=documents, cu_seqlens=cu_seqlens, window=window, lengths=lengths)
        if structure is not None and self.selective is not None:
            # the temperatures' positions read a dense mask: the structure's, built here
            dense = Masking.build(mask, causal, lq, lk, query.device, structure).dense()
            mask, kw = dense, {}
        if self.selective is not None:  # τ_q, τ_k, τ_v: [B, heads, L] each
            if self_attention and key_features is None:
                key_features = token_features
            params.update(
                self._temperatures(
                    (query, key, value),
                    (q, k, v),
                    mask,
                    causal,
                    key_mask,
                    token_features,
                    key_features,
                )
            )
        if self.rotary:
            starts = None if structure is None else structure.doc_start
            q, k = self.rotate(q, k, starts)
        dtype = v.dtype
        if self.alibi is not None:
            q, k, v = self.bias(q, k, v)
            params["scale"] = 1.0 / math.sqrt(hd)  # not 1/√ of the widened q
        fn = attend if self.selective is None else selective_attend
        result = fn(
            q,
            k,
            v,
            self.method,
            mask=mask,
            causal=causal,
            return_weights=return_weights,
            impl=impl,
            **kw,
            **params,
        )
        out, weights = result if return_weights else (result, None)
        out = out.to(dtype)
        out = out.transpose(1, 2)  # (B, Lq, H, hd)
        if self.gate is not None:  # Y ⊙ σ(x·W_θ), per head or per output dimension
            g = torch.sigmoid(self.gate_proj(query)).view(b, lq, h, -1)  # (B, Lq, H, 1|hd)
            out = out * g.to(out.dtype)
        out = self.out_proj(out.reshape(b, lq, h * hd))  # (B, Lq, d)
        return (out, weights) if return_weights else out

    def rotate(
        self, q: Tensor, k: Tensor, doc_start: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """RoPE on q ``[B, H, Lq, hd]`` and k ``[B, Hkv, Lk, hd]``: keys at 0..Lk−1, queries at
        Lk−Lq..Lk−1 (identity when ``rotary=False``); with ``doc_start`` ``[1|B, Lk]`` (the
        first key of each key's document), positions counted from the start of each document."""
        if not self.rotary:
            return q, k
        lq, lk = q.shape[2], k.shape[2]
        pos = torch.arange(max(lq, lk), device=q.device, dtype=torch.float32)
        if doc_start is None or lk == 0:
            q = apply_rotary(q, pos[:lq] + (lk - lq), self.rotary_base)
            return q, apply_rotary(k, pos[:lk], self.rotary_base)
        pk = pos[:lk] - doc_start.to(q.device, torch.float32)  # (1|B, Lk)
        at = (torch.arange(lq, device=q.device) + (lk - lq)).clamp(0, lk - 1)
        pq = pk[:, at]
        q = apply_rotary(q, pq[:, None, :], self.rotary_base)
        return q, apply_rotary(k, pk[:, None, :], self.rotary_base)

    def bias(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k with ``alibi``'s two columns appended (`positions.bias_columns`; keys at
        0..Lk−1, queries at the last Lq of them), and v; all three in float32 where they were
        16-bit (identity without ``alibi``)."""
        if self.alibi is None:
            return q, k, v
        if q.dtype in (torch.float16, torch.bfloat16):
            q, k, v = q.float(), k.float(), v.float()
        q, k = bias_columns(q, k, self.alibi_slopes, 1.0 / math.sqrt(self.head_dim))
        return q, k, v

    def _selective(self, selective, sharing, factory) -> nn.ModuleDict | None:
        if selective is None:
            if sharing is not None:
                raise ValueError("sharing= only applies with selective= ('q', 'v', 'qv' or 'kqv').")
            return None
        if isinstance(selective, str):
            config = SelectiveConfig(
                targets=selective, sharing=False if sharing is None else sharing
            )
        elif isinstance(selective, SelectiveConfig):
            if sharing is not None and sharing != selective.sharing:
                raise ValueError(
                    "sharing= conflicts with the SelectiveConfig; set sharing in the config only."
                )
            config = selective
        else:
            raise ValueError(
                f"selective must be 'q', 'v', 'qv', 'kqv' or a SelectiveConfig, got {selective!r}."
            )
        heads = {"q": self.num_heads, "k": self.num_kv_heads, "v": self.num_kv_heads}
        width = {"q": self.embed_dim, "k": self.k_proj.in_features, "v": self.v_proj.in_features}
        return nn.ModuleDict(
            {
                t: Temperature(width[t], heads[t], self.head_dim, config, **factory)
                for t in "kqv"
                if t in config.targets
            }
        )

    def _temperatures(self, inputs, projections, mask, causal, key_mask, features, key_features):
        """``{"tau_q": [B, H, Lq], "tau_k"/"tau_v": [B, Hkv, Lk]}`` for the selected targets."""
        out = {}
        lq, lk = projections[0].shape[2], projections[1].shape[2]
        for i, t in enumerate("qkv"):
            if t not in self.selective:
                continue
            if t == "q":
                n = query_positions(lq, lk, mask=mask, causal=causal, device=projections[0].device)
            else:
                n = key_positions(lk, key_mask=key_mask, device=projections[i].device)
            out[f"tau_{t}"] = self.selective[t](
                n, x=inputs[i], proj=projections[i], features=features if t == "q" else key_features
            )
        return out

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, method={self.method!r}"
            + (f", rotary_base={self.rotary_base:g}" if self.rotary else "")
            + (f", alibi={self.alibi!r}" if self.alibi is not None else "")
            + (f", gate={self.gate!r}" if self.gate is not None else "")
        )
