"""Fine-tuning a pretrained decoder with low-rank adapters (peft LoRA), the one place the
fine-tuning studies (``reproduce clrs-llm``, ``reproduce selective-llm --lora``) get them.

`prepare` freezes every pretrained weight, injects LoRA adapters (Hu et al. 2021:
W x + (α/r)·B A x, A [r, d_in] Kaiming-uniform, B [d_out, r] zero, so the adapted model starts as
the pretrained one) into the attention projections `TARGETS` of every layer, then applies
the attention method with [`sharpattn.hf.apply`][sharpattn.integrations.hf.apply] (its own parameters, if any, train too).
The adapters are drawn from their own seeded stream and the method's parameters from another, so
two methods prepared with one seed start from the same adapters. `trained` gathers what
trains into one module, which the runner's `Trainer` trains and checkpoints (a
few megabytes: adapters, method parameters and Adam's moments, never the frozen model).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..lab import memory, runner

#: the modules adapted: Llama's query, key, value and output projections of every attention layer
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LORA, _METHOD = 101, 102  # purposes of a run seed (runner.seeded(seed, purpose))


def require_peft():
    """The ``peft`` module (the pretrained extra); called before any work, so a missing one ends
    the command with one sentence naming the extra (``cli.main``)."""
    import peft

    return peft


def adapter_parameters(shape: memory.Shape, rank: int) -> int:
    """The parameters of rank-``rank`` adapters on `TARGETS` in every layer of a decoder of
    ``shape``, each projection counted as ``d_model`` × ``d_model`` (A and B: 2·d_model·rank;
    grouped-query attention's k and v are narrower)."""
    return shape.layers * len(TARGETS) * 2 * shape.d_model * rank


def prepare(net: nn.Module, method: str, params: dict[str, Any], rank: int, seed: int) -> nn.Module:
    """Freeze ``net``, add rank-``rank`` LoRA adapters (α = 2·rank) to `TARGETS`, switch
    its attention to ``method`` (``sharpattn.hf.apply(net, method, **params)``) and return
    `trained` of it. The adapters depend on ``seed`` only, not on ``method``."""
    from .. import hf

    peft = require_peft()
    for p in net.parameters():
        p.requires_grad_(False)
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(TARGETS)
    )
    with runner.seeded(seed, _LORA):  # A's Kaiming draw comes from the global generator
        peft.inject_adapter_in_model(config, net)
    with runner.seeded(seed, _METHOD):  # so do the method's parameters (selective temperatures)
        hf.apply(net, method, **params)
    net.eval()  # no dropout anywhere; only the trained modules are put in training mode
    return trained(net)


def trained(net: nn.Module) -> nn.ModuleDict:
    """Every outermost module of ``net`` whose parameters all train (the adapters, the method's
    parameters), in one ``ModuleDict`` keyed by its path ("." written "-"): what the Trainer
    trains and checkpoints. Refuses a model with nothing to train."""
    picked: dict[str, nn.Module] = {}
    for name, module in net.named_modules():
        if any(name.startswith(p + ".") for p in picked):
            continue
        params = list(module.parameters())
        if name and params and all(p.requires_grad for p in params):
            picked[name] = module
    if not picked:
        raise ValueError("the model has no trainable parameters: prepare() it first.")
    return nn.ModuleDict({name.replace(".", "-"): m for name, m in picked.items()})


def is_adapter(name: str) -> bool:
    """Whether a parameter name of `trained` is a LoRA adapter's."""
    return "lora_" in name
