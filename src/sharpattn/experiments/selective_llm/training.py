"""The selective-LLM study's pieces: the text's training tokens and held-out windows, the
temperatures, their optimizer, the training windows, the loss and the evaluation."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from ...lab import runner
from ...lab.runner import Progress, emit
from ...lab.runs import damaged
from .. import adapters
from ..llm import window_nll
from .config import Config


def split(ids: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(training tokens, held-out windows of the longest evaluation length): the text's first
    ``train_fraction`` trains; the windows tile the rest without overlap."""
    ids = ids.reshape(-1)
    cut = int(len(ids) * cfg.train_fraction)
    train, held = ids[:cut], ids[cut:]
    longest = max(cfg.lengths)
    if len(train) < cfg.context + 1:
        raise ValueError(
            f"the training text has {len(train)} tokens; a window needs {cfg.context}."
        )
    count = len(held) // longest
    if count < cfg.eval_windows:
        raise ValueError(
            f"the held-out text has {len(held)} tokens: {count} windows of {longest}, "
            f"{cfg.eval_windows} wanted (lower --eval-windows or the context)."
        )
    return train, [held[i * longest : (i + 1) * longest] for i in range(cfg.eval_windows)]


def temperatures(net: nn.Module) -> nn.ModuleDict:
    """The selective temperatures [`sharpattn.hf.apply`][sharpattn.integrations.hf.apply] attached, in one module (what the
    Trainer trains and checkpoints)."""
    from ... import hf

    mods = {
        f"layer{i}": getattr(m, hf.SELECTIVE_ATTR)
        for i, m in enumerate(hf.attention_modules(net))
        if hasattr(m, hf.SELECTIVE_ATTR)
    }
    if not mods:
        raise ValueError("the model has no selective temperatures: apply(net, 'selective') first.")
    return nn.ModuleDict(mods)


def optimizer(holder: nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW over the temperatures: the position parameters at ``position_lr``, the token terms
    at ``lr``; LoRA adapters, if any, at ``lora_lr``."""
    named = list(holder.named_parameters())
    lora = [p for n, p in named if adapters.is_adapter(n)]
    named = [(n, p) for n, p in named if not adapters.is_adapter(n)]
    pos = [p for n, p in named if n.rsplit(".", 1)[-1] in ("beta", "alpha")]
    tok = [p for n, p in named if n.rsplit(".", 1)[-1] not in ("beta", "alpha")]
    groups = [
        {"params": g, "lr": lr}
        for g, lr in ((tok, cfg.lr), (pos, cfg.position_lr), (lora, cfg.lora_lr))
        if g
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr)


def window_batches(train_ids: torch.Tensor, cfg: Config, data: torch.Generator):
    """``batch(step)``: ``cfg.batch`` windows of ``cfg.context`` training tokens at offsets drawn
    from ``data``."""

    def batch(step: int) -> torch.Tensor:
        hi = len(train_ids) - cfg.context
        starts = torch.randint(0, hi + 1, (cfg.batch,), generator=data).tolist()
        return torch.stack([train_ids[s : s + cfg.context] for s in starts])

    return batch


def lm_loss(net: nn.Module):
    """``loss(holder, x)``: the next-token loss of ``net`` on windows ``x``."""

    def loss(_holder, x: torch.Tensor) -> torch.Tensor:
        return net(input_ids=x, labels=x).loss

    return loss


def evaluate(
    net: nn.Module,
    windows: list[torch.Tensor],
    where: Path,
    label: str,
    cfg: Config,
    progress: Progress | None,
) -> dict[str, list[float]]:
    """Per length, the window NLLs, each stored once in ``where`` (a later invocation with other
    lengths or window counts reuses what it can)."""
    res = {}
    for i, length in enumerate(cfg.lengths):
        path = where / f"nll_n{length}_w{cfg.eval_windows}.json"
        res[str(length)] = runner.once(
            path, functools.partial(window_nll, net, windows, length), shape=[float]
        )
        if len(res[str(length)]) != cfg.eval_windows:
            raise damaged(path, f"it holds {len(res[str(length)])} windows, not {cfg.eval_windows}")
        emit(progress, f"perplexity ({label})", f"{length} tokens", i + 1, len(cfg.lengths))
    return res


def position_coefficients(holder: nn.ModuleDict) -> dict[str, list[float]]:
    """Per target (q, k, v): the mean over heads of c (τ_pos = 1 + c·log n), per layer."""
    out: dict[str, list[float]] = {}
    for layer in holder.values():
        for t, temp in layer.items():
            c = temp.coefficient()
            out.setdefault(t, []).append(float("nan") if c is None else float(c.detach().mean()))
    return out
