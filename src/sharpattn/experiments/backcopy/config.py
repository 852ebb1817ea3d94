"""Bigram-Backcopy's configuration: the settings of a training run (`Training`, `RunConfig`),
the report's runs and profiles, and the generator streams."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, TypeVar

import torch

from ...lab import runner
from ...lab.runner import profile_settings
from ...models.transformer import (
    TransformerConfig,
    layers_name,
    parse_layers,
)
from ...tasks.bigram_backcopy import BigramBackcopy

Tensor = torch.Tensor


OPTIMIZERS = ("adam", "sgd")
DEFAULT_LR = {"adam": 3e-4, "sgd": 0.03}
# purposes of a run seed (runner.seed_int): independent streams
STREAM_INIT, STREAM_DATA, STREAM_EVAL, STREAM_BETA0 = range(4)
M = TypeVar("M", bound=torch.nn.Module)


@dataclass
class Training:
    """What every Bigram-Backcopy training run sets (`RunConfig`, the simplified model's
    `simplified_model.SimplifiedConfig`): ``steps`` steps, each on ``batch`` fresh sequences
    of ``seq_len`` tokens (BOS first) from the run's data stream; AdamW's ``betas`` and
    ``weight_decay``; the ``seed``; ``eval_batch`` held-out sequences; a checkpoint every
    ``checkpoint_every`` steps (the only setting a run folder lets change)."""

    steps: int = 10_000
    batch: int = 512
    seq_len: int = 256
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.99)
    seed: int = 0
    eval_batch: int = 64
    checkpoint_every: int = 100

    #: the settings that count something (each >= 1)
    COUNTS: ClassVar[tuple[str, ...]] = (
        "steps",
        "batch",
        "seq_len",
        "eval_batch",
        "checkpoint_every",
    )

    def __post_init__(self):
        for name in self.COUNTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.seq_len < 3:
            raise ValueError(f"seq_len must be >= 3, got {self.seq_len}.")
        self.betas = tuple(self.betas)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class RunConfig(Training):
    """One training run of a transformer (`Training`'s settings, then these). ``lr=None``
    takes 3e-4 for AdamW and 0.03 for SGD (App. C.1).

    SGD is plain (no weight decay; heavy-ball ``momentum`` if given, none by default); AdamW
    uses betas (0.9, 0.99), ε = 1e-8 and weight decay 0.01. The model predicts the next token at
    every position. Measures at ``n_measure`` log-spaced steps.
    """

    layers: str = "tf"
    method: str = "softmax"
    optimizer: str = "adam"
    lr: float | None = None
    d_model: int = 256
    n_heads: int = 1
    n_measure: int = 30
    # Options beyond App. C.1; None keeps the paper's setting (and the identity of older runs).
    momentum: float | None = None  # SGD (heavy-ball) momentum; None = plain SGD
    loss_from: int | None = None  # first query position in the loss; None = 0 (BOS's too)
    bos: bool | None = None  # False: the task without BOS (App. C.4); None = with BOS

    COUNTS: ClassVar[tuple[str, ...]] = (*Training.COUNTS, "d_model", "n_measure")

    def __post_init__(self):
        self.layers = layers_name(parse_layers(self.layers))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}."
            )
        super().__post_init__()
        if self.loss_from is not None and not 0 <= self.loss_from < self.seq_len:
            raise ValueError(f"loss_from must be in [0, seq_len), got {self.loss_from}.")
        if self.momentum is not None:
            if self.optimizer != "sgd":
                raise ValueError("momentum applies to SGD only: leave it None with adam.")
            if not 0.0 <= self.momentum < 1.0:
                raise ValueError(f"momentum must be in [0, 1), got {self.momentum}.")

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else float(self.lr)

    def model_config(self, task: BigramBackcopy) -> TransformerConfig:
        return TransformerConfig(
            vocab_size=task.vocab_size,
            n_out=task.V,
            max_len=self.seq_len,
            d_model=self.d_model,
            n_heads=self.n_heads,
            layers=self.layers,
            method=self.method,
        )


def log_steps(total: int, n: int) -> list[int]:
    """0 and about ``n`` log-spaced steps in [1, total], always including ``total``."""
    return runner.log_steps(total, n)


# ----- the report -----------------------------------------------------------------------------
PROFILES = {
    # The paper's App. C.1 settings: d = 256, batch 512, N = 256, 10,000 AdamW steps (each step
    # takes 13-48 CPU-seconds here: a checkpoint every 25).
    "paper": {
        "d_model": 256,
        "seq_len": 256,
        "batch": 512,
        "steps": 10_000,
        "eval_batch": 64,
        "checkpoint_every": 25,
    },
    # Between the two: the paper's AdamW lr 3e-4 and 10,000 steps with
    # d = 128, 128 tokens, batch 32 (the paper: 256, 256, 512). Its cost: docs/active-dormant-heads.md.
    "medium": {
        "d_model": 128,
        "seq_len": 128,
        "batch": 32,
        "steps": 10_000,
        "eval_batch": 32,
        "n_measure": 30,
        "checkpoint_every": 250,
    },
    # Small enough for 2 shared CPU cores in minutes. A larger AdamW step compresses time: lr
    # 1e-3 for the one-layer runs, 3e-3 for the three-layer ones, whose residual-state peak
    # takes the paper ~10^4 steps. "steps" and "adam_lr" may give each run its own value.
    "quick": {
        "d_model": 64,
        "seq_len": 64,
        "batch": 16,
        "steps": {
            "1L-softmax-adam": 1500,
            "1L-relu-adam": 600,
            "3L-softmax-adam": 1200,
            "3L-softmax-sgd": 1200,
            "3L-relu-adam": 1200,
        },
        "adam_lr": {
            "1L-softmax-adam": 1e-3,
            "1L-relu-adam": 1e-3,
            "3L-softmax-adam": 3e-3,
            "3L-relu-adam": 3e-3,
        },
        "eval_batch": 32,
        "n_measure": 24,
        "checkpoint_every": 100,
    },
}

RUNS = {
    "1L-softmax-adam": {"layers": "tf", "method": "softmax", "optimizer": "adam"},
    "1L-relu-adam": {"layers": "tf", "method": "relu", "optimizer": "adam"},
    "3L-softmax-adam": {"layers": "tf,tf,tf", "method": "softmax", "optimizer": "adam"},
    "3L-softmax-sgd": {"layers": "tf,tf,tf", "method": "softmax", "optimizer": "sgd"},
    "3L-relu-adam": {"layers": "tf,tf,tf", "method": "relu", "optimizer": "adam"},
}

CONVERGED = 0.1  # nats: a run's risks have converged once both excess risks are below this


def profile_config(profile: str, run: str, seed: int = 0) -> RunConfig:
    """The RunConfig of ``run`` (a key of RUNS) in ``profile`` (a key of PROFILES)."""
    settings = profile_settings(PROFILES, profile)
    if run not in RUNS:
        raise ValueError(f"run must be one of {', '.join(RUNS)}, got {run!r}.")
    adam_lr = settings.pop("adam_lr", None)
    if isinstance(settings["steps"], dict):
        settings["steps"] = settings["steps"][run]
    if isinstance(adam_lr, dict):
        adam_lr = adam_lr.get(run)
    spec = RUNS[run]
    lr = adam_lr if spec["optimizer"] == "adam" else None
    return RunConfig(**spec, **settings, lr=lr, seed=seed)
