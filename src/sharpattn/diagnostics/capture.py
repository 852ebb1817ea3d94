"""Capture what attention computes, in sharpattn's own models and Hugging Face models alike.

>>> with capture(model) as cap:
...     model(input_ids)
>>> cap["layers.0.attn.weights"]        # (B, H, Lq, Lk)

One naming scheme for everything recorded. Layer L counts attention modules in model order;
for a model built from sharpattn ``MultiheadAttention`` with a ``layers`` ModuleList holding at
most one attention module per entry (e.g. `sharpattn.models.Transformer`), L is the entry's
index instead, and every entry's output is recorded as its residual, attention or not:

* ``layers.{L}.attn.scores``  (B, H, Lq, Lk) pre-normalizer scores scale·q·kᵀ, -inf where masked
* ``layers.{L}.attn.weights`` (B, H, Lq, Lk) the normalizer's weights
* ``layers.{L}.attn.values``  (B, H, Lk) value-state norms ‖O_h·V_h·x_j‖ (O_h: head h's slice of the
  output projection; ‖V_h·x_j‖ where the model has none we can find, see ``values_projected``)
* ``layers.{L}.resid_post``   (B, L, d) residual states after layer L's block
* for inputs longer than ``full_until`` keys, instead of scores/weights, the per-row statistics
  [`attend`][sharpattn.attend] returns with ``return_stats=True`` (O(Lk) memory per row, see
  [`AttentionStats`][sharpattn.attention.AttentionStats]), each (B, H, Lq):
  ``layers.{L}.attn.{entropy,mass,visible}``, and ``lse``, ``beta``, ``softmax_entropy`` where
  the method's path gives them. Metrics of whole weight matrices (``sink_mass``, ...) need
  ``full_until`` at least the input's length.

``ablate={(L, h), ...}`` zeroes head h's output in layer L (the active/dormant test);
``ablate_rows=[heads of row 0, heads of row 1, ...]`` zeroes heads per batch row instead, so one
forward pass over copies of an input runs several single-head ablations side by side.
``stop_early=True`` ends the forward pass once the last layer in ``layers`` has recorded its
attention (the model's output is then never computed, nor that layer's ``resid_post``; the
exception that stops it ends at the ``with`` block, so write nothing after the call inside it).
Every hook and patch is removed when the ``with`` block ends, also on error.

Models whose attention is not sharpattn's ``MultiheadAttention`` are captured through a model kind
that an integration adds with `add_model_kind` when it is imported: ``import sharpattn.hf``
adds Hugging Face models (switched to sharpattn's softmax while captured, which calls
``attend``). Nothing here imports an integration.
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from .. import normalizers as nz
from ..attention import MultiheadAttention, attend
from ..attention.functional import causal_mask, observe, stop_observing

Tensor = torch.Tensor


class ModelKind(NamedTuple):
    """How [`Capture`][sharpattn.diagnostics.capture.Capture] records a kind of model built without sharpattn's attention modules.

    ``modules(model)``: the model's attention modules in model order, ``[]`` if it is not of this
    kind. ``route(model)``: make those modules compute through [`attend`][sharpattn.attend] (the one
    observation point); returns the function that undoes it.
    """

    modules: Callable[[nn.Module], list[nn.Module]]
    route: Callable[[nn.Module], Callable[[], None]]


_KINDS: list[ModelKind] = []


def add_model_kind(modules: Callable, route: Callable) -> ModelKind:
    """Let [`capture`][sharpattn.diagnostics.capture.capture] record another kind of model (see `ModelKind`); integrations call
    it when imported. Adding the same pair twice adds it once."""
    kind = ModelKind(modules, route)
    if kind not in _KINDS:
        _KINDS.append(kind)
    return kind


class Capture:
    """Context manager recording attention internals; see the module docstring for the names."""

    def __init__(
        self,
        model: nn.Module,
        *,
        layers=None,
        full_until: int = 2048,
        ablate=(),
        query_block: int | None = None,
        keep: str = "last",
        ablate_rows: Sequence[Iterable[tuple[int, int]]] | None = None,
        stop_early: bool = False,
    ):
        self.model = model
        self.layers = None if layers is None else {int(x) for x in layers}
        self.full_until = int(full_until)
        self.ablate = {(int(a), int(b)) for a, b in ablate}
        self.ablate_rows = (
            None
            if ablate_rows is None
            else [{(int(a), int(b)) for a, b in row} for row in ablate_rows]
        )
        if stop_early and not self.layers:
            raise ValueError("stop_early needs the layers to record (layers=[...], not empty).")
        self.stop_early = bool(stop_early)
        self.blocks: dict[int, nn.Module] = {}  # layer index -> the block holding its attention
        self.query_block = None if query_block is None else int(query_block)
        if keep not in ("last", "all"):
            raise ValueError(f"keep must be 'last' or 'all', got {keep!r}.")
        self.keep = keep
        self.records: dict[str, list[Tensor]] = defaultdict(list)
        self.values_projected: dict[int, bool] = {}
        self._undo: list = []
        self._index: dict[int, int] = {}  # id(attention module) -> layer index
        self._out_weight: dict[int, Tensor | None] = {}
        self._running: list[nn.Module] = []  # the attention modules whose forward is running

    # ---- access -------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Tensor:
        if name not in self.records:
            raise KeyError(
                f"{name!r} was not captured; captured: {', '.join(sorted(self.records))}."
            )
        return self.records[name][-1]

    def __contains__(self, name: str) -> bool:
        return name in self.records

    def all(self, name: str) -> list[Tensor]:
        """Every recorded tensor of ``name`` (one per forward call with ``keep="all"``)."""
        return list(self.records[name])

    def names(self) -> list[str]:
        return sorted(self.records)

    @property
    def num_layers(self) -> int:
        """Highest layer index with an attention module, plus one."""
        return max(self._index.values(), default=-1) + 1

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Capture:
        try:
            self._install()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._remove()
        return exc_type is _Stop  # stop_early: the forward pass ended on purpose

    def _remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _install(self) -> None:
        own = [m for m in self.model.modules() if isinstance(m, MultiheadAttention)]
        kind, modules = None, own
        for candidate in [] if own else _KINDS:
            modules = candidate.modules(self.model)
            if modules:
                kind = candidate
                break
        if not modules:
            raise ValueError(
                f"{type(self.model).__name__} has no sharpattn MultiheadAttention and no attention "
                "module of a kind an integration added (for a Hugging Face model, import "
                "sharpattn.hf first)."
            )
        stack = _layer_stack(self.model, own)
        if stack is not None:  # layer L = entry L of the model's `layers` ModuleList
            self._index = {
                id(m): i for i, block in enumerate(stack) for m in own if _holds(block, m)
            }
            blocks = dict(enumerate(stack))
        else:  # layer L = the L-th attention module in model order
            self._index = {id(m): i for i, m in enumerate(modules)}
            blocks = _blocks(self.model, modules)
        self.blocks = dict(blocks)
        if self.stop_early:
            last = max(self.layers)
            for m in modules:
                if self._index[id(m)] == last:
                    h = m.register_forward_hook(_raise_stop)
                    self._undo.append(h.remove)
        for m in modules:
            self._out_weight[id(m)] = _output_projection(self.model, m)
            self.values_projected[self._index[id(m)]] = self._out_weight[id(m)] is not None
        for m in modules:  # which attention module (layer) is running when attend() is called
            h1 = m.register_forward_pre_hook(self._enter_module)
            h2 = m.register_forward_hook(self._leave_module, always_call=True)
            self._undo += [h1.remove, h2.remove]
        if kind is not None:
            self._undo.append(kind.route(self.model))
        token = observe(self._observe)  # the one observation point: the end of attend()
        self._undo.append(lambda: stop_observing(token))
        for layer, block in blocks.items():
            h = block.register_forward_hook(self._resid_hook(layer))
            self._undo.append(h.remove)

    # ---- hooks --------------------------------------------------------------------------------
    def _enter_module(self, module, _args):
        self._running.append(module)

    def _leave_module(self, module, _args, _output):
        if self._running and self._running[-1] is module:
            self._running.pop()

    def _observe(self, q, k, v, out, *, mask, causal, scale, method, params):
        module = self._running[-1] if self._running else None
        layer = None if module is None else self._index.get(id(module))
        if layer is None:  # an attend() call outside the captured attention modules
            return out
        self._record(layer, module, q, k, v, mask, causal, scale, method, params)
        return self._zero_heads(layer, out, head_dim=1)

    def _zero_heads(self, layer: int, out: Tensor, head_dim: int) -> Tensor:
        heads = [h for lay, h in self.ablate if lay == layer]
        rows = [
            (r, h) for r, row in enumerate(self.ablate_rows or ()) for lay, h in row if lay == layer
        ]
        if not heads and not rows:
            return out
        if self.ablate_rows is not None and out.shape[0] != len(self.ablate_rows):
            raise ValueError(
                f"ablate_rows has {len(self.ablate_rows)} rows but the batch has {out.shape[0]}."
            )
        # keep[b, h] = 0 for the heads zeroed in row b (all rows for `ablate`), else 1
        keep = torch.ones(out.shape[0], out.shape[head_dim], dtype=out.dtype, device=out.device)
        keep[:, heads] = 0
        for r, h in rows:
            keep[r, h] = 0
        shape = [1] * out.dim()
        shape[0], shape[head_dim] = out.shape[0], out.shape[head_dim]
        return out * keep.view(shape)

    def _resid_hook(self, layer: int):
        def hook(_module, _args, output):
            if self.layers is not None and layer not in self.layers:
                return None
            x = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(x):
                self._put(f"layers.{layer}.resid_post", x.detach())
            return None

        return hook

    def _put(self, name: str, value: Tensor) -> None:
        if self.keep == "last":
            self.records[name] = [value]
        else:
            self.records[name].append(value)

    # ---- the one recording path for both kinds of model ---------------------------------------
    @torch.no_grad()
    def _record(self, layer, module, q, k, v, mask, causal, scale, method, params):
        if self.layers is not None and layer not in self.layers:
            return
        q, k, v = q.detach(), k.detach(), v.detach()
        params = {n: (p.detach() if torch.is_tensor(p) else p) for n, p in params.items()}
        name = f"layers.{layer}.attn"
        b, h, lq, _ = q.shape
        lk = k.shape[2]
        if lk > self.full_until:  # long input: attend's per-row statistics, no weight matrix
            stats = self._row_stats(q, k, v, mask, causal, scale, method, params)
            for key, value in vars(stats).items():
                if value is not None:
                    self._put(f"{name}.{key}", value)
        rep = h // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        self._put(f"{name}.values", self._value_norms(module, v))
        if lk > self.full_until:
            return
        allowed = torch.ones(b, h, lq, lk, dtype=torch.bool, device=q.device)
        if mask is not None:
            allowed = allowed & mask
        if causal:
            allowed = allowed & causal_mask(lq, lk, q.device)
        scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
        scores = scores.masked_fill(~allowed, float("-inf"))
        self._put(f"{name}.scores", scores)
        params.pop("check_finite", None)
        self._put(f"{name}.weights", nz.get(method).fn(scores, allowed, **params))

    def _row_stats(self, q, k, v, mask, causal, scale, method, params):
        """[`attend`][sharpattn.attend]'s statistics of this call, computed again unobserved."""
        token = observe(None)  # this attend call is capture's own, not the model's
        try:
            _, stats = attend(
                q,
                k,
                v,
                method,
                mask=mask,
                causal=causal,
                scale=scale,
                return_stats=True,
                block_size=self.query_block,
                **params,
            )
        finally:
            stop_observing(token)
        return stats

    def _value_norms(self, module, v: Tensor) -> Tensor:
        """‖O_h·v_{h,j}‖ per head and token (B, H, Lk); ‖v_{h,j}‖ without an output projection."""
        weight = self._out_weight.get(id(module))
        h, d = v.shape[1], v.shape[-1]
        if weight is None or weight.shape[1] != h * d:
            return v.float().norm(dim=-1)
        o = weight.detach().float().view(weight.shape[0], h, d)  # (d_model, H, hd)
        projected = torch.einsum("bhjd,mhd->bhjm", v.float(), o)
        return projected.norm(dim=-1)


def capture(model: nn.Module, **kwargs) -> Capture:
    """``with capture(model) as cap: model(x)``; see [`Capture`][sharpattn.diagnostics.capture.Capture]."""
    return Capture(model, **kwargs)


class _Stop(Exception):
    """Raised by ``stop_early`` after the last recorded layer; swallowed by ``Capture.__exit__``."""


def _raise_stop(_module, _args, _output):
    raise _Stop


def head_ablation(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, object], Tensor],
    domains: Mapping[str, Iterable],
    heads: Iterable[tuple[int, int]],
    *,
    batch: int = 1,
    reuse_prefix: bool = False,
    workers: int = 1,
) -> dict[str, dict[tuple[int, int], float]]:
    """Active/dormant test: loss(head (L, h) zeroed) − loss(intact), mean over each domain's inputs.

    ``loss_fn(model, x)`` returns the loss of input ``x``; zeroing uses
    `sharpattn.diagnostics.capture` (``ablate``), and the intact loss is measured under the
    same capture. A head whose removal barely changes the loss on a domain is dormant there, one
    whose removal hurts is active (Guo et al., §3.1).

    Faster, measuring the same thing (every head still gets its own forward pass with only that
    head zeroed; the results differ only by float rounding):

    * ``batch > 1``: up to ``batch`` heads per forward pass, each on its own copy of ``x`` along
      the batch dimension (``ablate_rows``). Every input then has batch size 1 (tensors, or
      mappings of tensors such as a tokenizer's output, with first dimension 1) and ``loss_fn``
      returns one loss per row of its input, shape ``(rows,)``.
    * ``reuse_prefix``: the blocks before a pass's first ablated layer are not run again; they
      return the outputs recorded in the intact pass. Only valid when ``loss_fn`` runs every block
      once, in layer order, and a block's output depends only on its arguments (no KV cache being
      filled: call Hugging Face models with ``use_cache=False``). Where the intact pass shows
      otherwise (a block not called, or called twice), the full passes are run instead.
    * ``workers > 1``: that many passes run at once, in threads, each on its own copy of the model
      (``copy.deepcopy``), taking the next pass when done. Meant for one torch intra-op thread
      (``torch.set_num_threads(1)``): no thread then waits for another inside an operation, so a
      core taken by other work slows the test down to one core's speed, not below it.
    """
    heads = sorted({(int(a), int(b)) for a, b in heads})
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}.")
    # passes: groups of heads in layer order, so a group's heads share a long intact prefix
    groups = [heads[i : i + batch] for i in range(0, len(heads), batch)]
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}.")
    models = [model] + [copy.deepcopy(model) for _ in range(min(workers, len(groups)) - 1)]

    def _ablated(replica, group, x, prefix) -> list[float]:
        """The losses of one pass: row r of ``x``'s copies has head ``group[r]`` zeroed."""
        copies = _repeat(x, len(group)) if batch > 1 else x
        start = min(layer for layer, _ in group) if prefix else 0
        with (
            capture(replica, layers=(), ablate_rows=[{head} for head in group]) as cap,
            _replay(cap.blocks, prefix, start, len(group)),
        ):
            loss = loss_fn(replica, copies).reshape(-1)
        if loss.numel() != len(group):
            raise ValueError(
                f"loss_fn returned {loss.numel()} losses for {len(group)} rows; with batch > 1 "
                "it must return one loss per row of its input."
            )
        return loss.tolist()

    out: dict[str, dict[tuple[int, int], float]] = {}
    with torch.inference_mode():
        for domain, inputs in domains.items():
            inputs = list(inputs)
            total = dict.fromkeys(heads, 0.0)
            base = 0.0
            for x in inputs:
                if batch > 1 and _rows(x) != 1:
                    raise ValueError(
                        f"batch > 1 needs inputs of batch size 1, got {_rows(x)} rows."
                    )
                prefix: dict[int, Tensor] = {}
                with capture(model, layers=()) as cap, _record_blocks(cap.blocks) as (calls, outs):
                    base += float(loss_fn(model, x))
                layers = list(range(len(cap.blocks)))
                if reuse_prefix and calls == layers and sorted(cap.blocks) == layers:
                    prefix = outs
                passes = [(group, x, prefix) for group in groups]
                for group, loss in zip(groups, side_by_side(_ablated, passes, models), strict=True):
                    for head, value in zip(group, loss, strict=True):
                        total[head] += value
            base /= len(inputs)
            out[domain] = {head: total[head] / len(inputs) - base for head in heads}
    return out


def side_by_side(fn: Callable, items: list[tuple], models: list[nn.Module]) -> list:
    """``[fn(model, *item) for item in items]``, the items shared out among ``models`` (one thread
    each, every thread taking the next item when done); exceptions propagate."""
    if len(models) == 1:
        return [fn(models[0], *item) for item in items]
    results: list = [None] * len(items)
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work(replica):
        with torch.inference_mode():  # thread-local, like grad mode
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                results[i] = fn(replica, *items[i])

    with ThreadPoolExecutor(len(models)) as pool:
        for job in [pool.submit(work, m) for m in models]:
            job.result()
    return results


def _rows(x) -> int:
    """The batch size of an input: a tensor's first dimension, or its tensors' in a mapping."""
    if torch.is_tensor(x):
        return int(x.shape[0])
    sizes = (
        {int(v.shape[0]) for v in x.values() if torch.is_tensor(v)}
        if isinstance(x, Mapping)
        else set()
    )
    if len(sizes) != 1:
        raise ValueError(
            "batch > 1 needs a tensor input or a mapping of tensors of one batch size."
        )
    return sizes.pop()


def _repeat(x, n: int):
    """``n`` copies of a batch-size-1 input along the batch dimension (mappings: every tensor)."""
    if torch.is_tensor(x):
        return x.expand(n, *x.shape[1:]).contiguous()
    return {k: _repeat(v, n) if torch.is_tensor(v) else v for k, v in x.items()}


@contextmanager
def _record_blocks(blocks: Mapping[int, nn.Module]):
    """Yield ``(calls, outputs)``: the layer order in which ``blocks`` ran, and a copy of each
    block's output tensor (a block whose output is not one tensor is left out of ``calls``)."""
    calls: list[int] = []
    outputs: dict[int, Tensor] = {}
    handles = []

    def hook(layer):
        def record(_module, _args, output):
            calls.append(layer if torch.is_tensor(output) else -1)
            if torch.is_tensor(output):
                outputs[layer] = output.clone()

        return record

    try:
        handles = [block.register_forward_hook(hook(layer)) for layer, block in blocks.items()]
        yield calls, outputs
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _replay(blocks: Mapping[int, nn.Module], outputs: Mapping[int, Tensor], upto: int, n: int):
    """Blocks ``0 … upto−1`` skip their computation and return their recorded (batch-1) output,
    repeated ``n`` times along the batch dimension."""
    patched = []
    try:
        for layer in range(upto):
            block, recorded = blocks[layer], outputs[layer]

            def forward(*_args, _recorded=recorded, **_kwargs):
                return _recorded.expand(n, *_recorded.shape[1:]).contiguous()

            patched.append((block, block.__dict__.get("forward")))
            block.forward = forward  # an instance attribute: nn.Module.__call__ runs it
        yield
    finally:
        for block, previous in patched:
            if previous is None:
                del block.forward
            else:
                block.forward = previous


def _linear_weight(lin: nn.Module) -> Tensor | None:
    w = getattr(lin, "weight", None)
    if not torch.is_tensor(w) or w.dim() != 2:
        return None
    return w.t() if hasattr(lin, "nf") else w  # transformers' Conv1D stores (in, out)


def _output_projection(model: nn.Module, module: nn.Module) -> Tensor | None:
    """The weight (d_model, H·hd) that maps the heads' outputs back to the residual stream."""
    if isinstance(module, MultiheadAttention):
        return module.out_proj.weight
    for attr in ("o_proj", "out_proj", "c_proj", "dense"):
        lin = getattr(module, attr, None)
        if isinstance(lin, nn.Module) and _linear_weight(lin) is not None:
            return _linear_weight(lin)
    # BERT-style: the projection lives in the parent's `output.dense`
    for parent in model.modules():
        if any(child is module for child in parent.children()):
            out = getattr(getattr(parent, "output", None), "dense", None)
            if isinstance(out, nn.Module):
                return _linear_weight(out)
    return None


def _holds(block: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in block.modules())


def _layer_stack(model: nn.Module, own: list[nn.Module]) -> nn.ModuleList | None:
    """A sharpattn model's documented ``layers`` ModuleList, when every attention module sits in
    it, at most one per entry (entries without attention, e.g. MLP-only layers, still count)."""
    stack = getattr(model, "layers", None)
    if not own or not isinstance(stack, nn.ModuleList):
        return None
    per_block = [sum(_holds(block, m) for m in own) for block in stack]
    if max(per_block, default=0) > 1 or sum(per_block) != len(own):
        return None
    return stack


def _blocks(model: nn.Module, attention: list[nn.Module]) -> dict[int, nn.Module]:
    """Layer index -> the block (a ModuleList entry) that holds that attention module."""
    ids = {id(m): i for i, m in enumerate(attention)}
    blocks = {}
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList):
            for block in mod:
                inner = [ids[id(m)] for m in block.modules() if id(m) in ids]
                if len(inner) == 1:
                    blocks[inner[0]] = block
    return blocks
