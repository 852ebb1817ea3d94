"""The selective-LLM study's configuration: `Config`, its profiles, what a run folder fixes, and
the generator streams."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...attention.selective import SelectiveConfig
from ...lab import memory
from ...lab.protocol import option
from ...lab.runner import profile_settings
from ..adapters import adapter_parameters
from ..llm import pretrained_shape

STREAM_TRAIN, STREAM_EVAL, STREAM_INIT = 0, 1, 2  # generator purposes


MATCHED_SEEDS = 2  # the matched study's seeds unless told


@dataclass
class Config:
    model: str = option("smollm2-135m", "Pretrained decoder.")
    steps: int = option(200, "AdamW steps.", maximum="steps")
    context: int = option(256, "Training window in tokens.", maximum="length", minimum=2)
    factors: tuple[int, ...] = (1, 2, 4)  # evaluation lengths, multiples of the context
    batch: int = 1
    # the token term's
    lr: float = option(1e-3, "Learning rate of the temperatures.", maximum="rate")
    # the position parameter's (β of c = e^{−e^β}: Adam moves it by about its learning rate per
    # step, so at 1e-3 it would stay at its identity value)
    position_lr: float = option(3e-2, "Learning rate of the position parameter.", maximum="rate")
    targets: str = option("qv", "Temperatures on q, k and/or v.")
    # False: base SSA (MLP token term); True: weight sharing
    sharing: bool = option(
        False, "The paper's weight sharing instead of base SSA's MLP token term."
    )
    # "both", "token" or "position" (τ = 1 + c·log n alone: the control that cannot adapt to
    # the text's tokens, only to lengths)
    terms: str = option(
        "both",
        "Token and position terms, or one of them.",
        kind="choice",
        choices=("both", "token", "position"),
    )
    eval_windows: int = option(
        16, "Held-out windows per length (overrides the profile).", maximum="sets"
    )
    train_fraction: float = 0.8
    #: the matched study (`run_matched`): LoRA adapters of this rank fine-tuned with and
    #: without the temperatures (0: the frozen study), at ``lora_lr``, for ``seeds`` seeds
    lora: int = option(
        0,
        "The matched study: LoRA adapters of this rank fine-tuned with and "
        "without the temperatures, on the same windows and seeds.",
        maximum="rank",
        metavar="RANK",
        show_default=False,
    )
    lora_lr: float = option(1e-3, "Learning rate of the adapters (with --lora).", maximum="rate")
    seeds: int = option(
        1,
        f"Seeds of the matched study (with --lora) [default: {MATCHED_SEEDS}].",
        maximum="seeds",
        show_default=False,
    )
    seed: int = option(0, "Seed of the training windows (the first seed with --lora).", kind="seed")
    checkpoint_every: int = option(50, "", kind="checkpoint")
    threads: int | None = option(None, "", kind="threads")

    def __post_init__(self):
        self.factors = tuple(int(f) for f in self.factors)
        for name in ("steps", "context", "batch", "eval_windows", "checkpoint_every", "seeds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.lora < 0:
            raise ValueError(f"lora must be a rank >= 1 (or 0: no adapters), got {self.lora}.")
        if self.seeds > 1 and not self.lora:
            raise ValueError(
                "several seeds are for the fine-tuned study (--lora); the frozen study trains one."
            )
        if not self.factors or min(self.factors) < 1:
            raise ValueError(f"factors must be positive integers, got {list(self.factors)}.")
        for name in ("lr", "position_lr", "lora_lr"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}.")
        if not 0 < self.train_fraction < 1:
            raise ValueError(f"train_fraction must be in (0, 1), got {self.train_fraction}.")
        # targets, sharing and terms as hf.apply will check them, before any work
        SelectiveConfig(targets=self.targets, sharing=bool(self.sharing), terms=self.terms)

    @property
    def lengths(self) -> list[int]:
        return [self.context * f for f in self.factors]


PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"steps": 20, "eval_windows": 4, "factors": (1, 2)},
    "paper": {"steps": 100, "eval_windows": 8, "factors": (1, 2, 4)},
}

#: what a run computes; threads and the evaluation window count may change between invocations.
#: The matched study's seeds are fixed when its folder is created: a report over seeds is over
#: the seeds the run set out to train
IDENTITY = (
    "model",
    "steps",
    "context",
    "batch",
    "lr",
    "position_lr",
    "targets",
    "sharing",
    "terms",
    "train_fraction",
    "seed",
)
MATCHED_IDENTITY = (*IDENTITY, "lora", "lora_lr", "seeds")


def make_config(profile: str = "quick", **overrides: Any) -> Config:
    values = profile_settings(PROFILES, profile, overrides)
    if values.get("lora") and "seeds" not in values:
        values["seeds"] = MATCHED_SEEDS
    return Config(**values)


def check_memory(cfg: Config, pool: str | None = None) -> None:
    """Refuse in one sentence, before the model is loaded, a run whose estimated memory
    (`memory.estimate`) is more than this machine has available: the pretrained model (with
    ``lora``, also the copy fine-tuned with its adapters), training on windows of ``context``
    tokens, and the unpatched model's evaluation of the longest windows (its attention makes
    whole score matrices). The study runs in this process, so ``pool`` is not used. Lengths
    beyond the model's context are refused once it is loaded, before any window is made, and a
    model other than SmolLM2 when it is loaded: neither is estimated."""
    known = pretrained_shape(cfg.model)
    if known is None or max(cfg.lengths) > known[1]:
        return
    shape, longest = known[0], max(cfg.lengths)
    job = memory.estimate(
        shape,
        train=(cfg.batch, cfg.context),
        evaluate=(1, longest),
        trained=adapter_parameters(shape, cfg.lora),
        copies=2 if cfg.lora else 1,
        dense=True,
    )
    if job.largest == "model" and cfg.lora:
        what, smaller = f"fine-tuning {cfg.model} with adapters of rank {cfg.lora}", "--lora"
    elif job.largest == "evaluation":
        what, smaller = f"evaluating {cfg.model} on windows of {longest:,} tokens", "--context"
    else:
        what, smaller = f"training on windows of {cfg.context:,} tokens", "--context"
    memory.check(job, 1, what, smaller)
