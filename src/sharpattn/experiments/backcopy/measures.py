"""Bigram-Backcopy's measures of a trained model on held-out sequences (the package's
docstring lists them), by kind of query, and the interventions that zero a token's value."""

from __future__ import annotations

import torch

from ...diagnostics import (
    Capture,
    attention_on,
    capture,
    delta_logit,
    residual_peak,
    sink_mass,
    value_drain,
)
from ...models.transformer import (
    Transformer,
)
from ...tasks.bigram_backcopy import KIND_BACKCOPY, KIND_BIGRAM, BigramBackcopy

Tensor = torch.Tensor


# ----- measures -------------------------------------------------------------------------------
def query_mask(task: BigramBackcopy, tokens: Tensor, k: int) -> Tensor:
    return task.position_kind(tokens) == k  # (B, T)


@torch.no_grad()
def internals(model: Transformer, tokens: Tensor, zero=()) -> tuple[Tensor, Capture]:
    """``(logits, cap)``: the model in eval mode on ``tokens`` under
    `sharpattn.diagnostics.capture` (``cap["layers.{L}.attn.scores"]`` ...), with the
    sublayers named in ``zero`` zeroed."""
    was_training = model.training
    model.eval()
    try:
        with capture(model) as cap:
            logits = model(tokens, zero=zero)
    finally:
        model.train(was_training)
    return logits, cap


@torch.no_grad()
def measure(model: Transformer, task: BigramBackcopy, tokens: Tensor, zero=()) -> dict[str, float]:
    """Every measure of the module docstring on the sequences ``tokens`` ``[B, T]`` (with the
    sublayers named in ``zero`` zeroed: the interventions of Fig. 7b)."""
    logits, cap = internals(model, tokens, zero)
    out = task.risks(logits, tokens)
    bigram_q = query_mask(task, tokens, KIND_BIGRAM)
    copy_q = query_mask(task, tokens, KIND_BACKCOPY)
    for i, kind in enumerate(model.cfg.layers):
        pre = f"layers.{i}"
        if kind in ("tf", "attn") and f"{pre}.attn" not in zero:
            w, s = cap[f"{pre}.attn.weights"], cap[f"{pre}.attn.scores"]
            out[f"{pre}.attn.bos_weight"] = attention_on(w, bigram_q)
            total = w.sum(-1, keepdim=True)  # ReLU attention rows need not sum to 1
            share = w / torch.where(total > 0, total, torch.ones_like(total))
            out[f"{pre}.attn.bos_share"] = attention_on(share, bigram_q)
            out[f"{pre}.attn.bos_weight_trigger"] = attention_on(w, copy_q)
            out[f"{pre}.attn.prev_weight_trigger"] = attention_on(w, copy_q, offset=1)
            out[f"{pre}.attn.delta_logit"] = delta_logit(s, bigram_q)
            out[f"{pre}.attn.bos_sink_mass"] = float(sink_mass(w)[..., 0].mean())
            val = cap[f"{pre}.attn.values"]  # (B, H, T): ‖O_h·V_h·LN(h)_j‖
            out[f"{pre}.attn.val_bos"] = float(val[..., 0].mean())
            out[f"{pre}.attn.val_other"] = float(val[..., 1:].mean())
            out[f"{pre}.attn.val_drain"] = float(value_drain(val, 0).mean())
        res = cap[f"{pre}.resid_post"]  # (B, T, d)
        norms = res.double().norm(dim=-1)
        rb, ro = float(norms[:, 0].mean()), float(norms[:, 1:].mean())
        out[f"{pre}.res_bos"], out[f"{pre}.res_other"] = rb, ro
        out[f"{pre}.res_peak"] = rb - ro
        out[f"{pre}.res_ratio"] = float(residual_peak(res, 0).mean())
    return out


#: characters that end or separate words and clauses (App. C.4's "delimiter tokens")
DELIMITERS = frozenset("\n.,;:!?-'")


def key_class_weights(weights: Tensor, tokens: Tensor, query: Tensor, task) -> dict[str, float]:
    """App. C.4 (the task without BOS): the mean attention weight a key of each class receives
    from the selected queries, over every visible (query, key) pair with key ≤ query: the first
    position ("first"), triggers, delimiters (`DELIMITERS`, not triggers) and the other
    tokens at positions ≥ 1; and "uniform", the same mean for weights 1/(n+1) (no preference).
    ``weights`` ``[B, T, T]`` (heads averaged), ``tokens`` and ``query`` ``[B, T]``."""
    t = weights.shape[-1]
    vis = torch.ones(t, t, dtype=torch.bool, device=weights.device).tril()
    pairs = query[:, :, None] & vis[None]  # (B, Tq, Tk)
    trig = task.is_trigger(tokens)
    delim = torch.tensor([c in DELIMITERS for c in task.chars] + [False])[tokens] & ~trig
    first = torch.zeros_like(trig)
    first[:, 0] = True
    rest = ~first
    classes = {
        "first": first,
        "trigger": trig & rest,
        "delimiter": delim & rest,
        "other": rest & ~trig & ~delim,
    }
    w = weights.double()
    out = {}
    for name, keys in classes.items():
        sel = pairs & keys[:, None, :]
        out[name] = float(w[sel].mean()) if bool(sel.any()) else float("nan")
    n = torch.arange(1, t + 1, dtype=torch.float64)[None, :, None].expand_as(w)
    out["uniform"] = float((1.0 / n)[pairs].mean())
    return out


@torch.no_grad()
def measure_no_bos(model: Transformer, task: BigramBackcopy, tokens: Tensor) -> dict[str, float]:
    """The measures of a run on the task without BOS (App. C.4): the model reads
    ``tokens[:, 1:]`` (``tokens`` sampled with BOS, which is dropped); risks, and per layer the
    `key_class_weights` of the non-trigger queries at positions ≥ 1 and the value-state
    norms of the first position and of the others."""
    x = tokens[:, 1:]
    logits, cap = internals(model, x)
    out = task.risks(logits, tokens, drop=1)
    q = query_mask(task, x, KIND_BIGRAM)
    q[:, 0] = False  # the first query sees only itself: no choice to measure
    for i, kind in enumerate(model.cfg.layers):
        if kind in ("tf", "attn"):
            w = cap[f"layers.{i}.attn.weights"].mean(1)
            for name, v in key_class_weights(w, x, q, task).items():
                out[f"layers.{i}.attn.weight_{name}"] = v
            val = cap[f"layers.{i}.attn.values"].mean(1)  # (B, T)
            out[f"layers.{i}.attn.val_first"] = float(val[:, 0].mean())
            out[f"layers.{i}.attn.val_other"] = float(val[:, 1:].mean())
    return out


@torch.no_grad()
def interventions(model: Transformer, task: BigramBackcopy, tokens: Tensor) -> list[dict]:
    """Risks with nothing zeroed and with each attn / mlp sublayer's output zeroed (Fig. 4a)."""
    model.eval()
    rows = []
    for zero in [None, *model.sublayers]:
        logits = model(tokens, zero=() if zero is None else (zero,))
        rows.append({"zeroed": zero or "none", **task.risks(logits, tokens)})
    model.train()
    return rows
