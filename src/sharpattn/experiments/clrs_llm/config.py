"""The CLRS-LLM study's configuration: `Config`, its profiles, what a run folder fixes, the
algorithms' tasks and the generator streams."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...lab import memory
from ...lab.protocol import option
from ...lab.runner import profile_settings
from ..adapters import adapter_parameters
from ..llm import pretrained_shape

IGNORE = -100
METHODS = ("softmax", "adaptive")
STREAM_TRAIN, STREAM_TEST = 0, 1  # purposes of a run seed (runner.generator(seed, purpose, ...))
#: one stored evaluation: per test prompt, exact match and answer tokens right / scored
SCORES = {"exact": [int], "right": [int], "tokens": [int]}


@dataclass
class Config:
    model: str = option("smollm2-135m", "Pretrained decoder.")
    tasks: tuple[str, ...] = option(
        ("minimum", "insertion_sort"),
        "Comma-separated CLRS algorithms (overrides the profile; see reproduce clrs --list).",
        kind="names",
    )
    train_sizes: tuple[int, int] = option(
        (4, 8),
        "Sizes trained at, inclusive (overrides the profile's 4,8).",
        kind="size_range",
        metavar="LO,HI",
    )
    seed: int = option(
        0, "First seed (adapters and training batches; the test prompts).", kind="seed"
    )
    seeds: int = option(2, "Number of seeds (overrides the profile).", maximum="seeds")
    steps: int = option(40, "AdamW steps per fine-tuning.", maximum="steps")
    rank: int = option(8, "Rank of the LoRA adapters.", maximum="rank")  # α = 2·rank
    lr: float = option(1e-3, "Learning rate of the adapters.", maximum="rate")
    eval_factor: int = option(
        4, "Evaluate up to this multiple of the largest training size.", maximum="factor"
    )
    #: sizes evaluated besides `sizes`' doublings (e.g. 10 and 12 items: between the training
    #: range and the sizes where both methods are at 0)
    eval_sizes: tuple[int, ...] = option(
        (),
        "More sizes to evaluate, e.g. 10,12 (between the "
        "training range and the doublings); may be added to "
        "an existing run.",
        kind="sizes",
        metavar="N,N,...",
        show_default=False,
    )
    #: adaptive temperature's AdamW steps where they differ from ``steps`` (None: the same):
    #: to compare the methods at matched in-distribution accuracy when adaptive learns slower
    adaptive_steps: int | None = option(
        None,
        "AdamW steps of the adaptive fine-tunings where "
        "they differ from --steps (to compare at matched "
        "in-distribution accuracy).",
        kind="count",
        maximum="steps",
        show_default=False,
    )
    prompts: int = option(
        16,
        "Test prompts per algorithm and size, the same for both methods "
        "and every seed (overrides the profile).",
        maximum="sets",
    )
    checkpoint_every: int = option(50, "", kind="checkpoint")
    threads: int | None = option(None, "", kind="threads")
    values: int = 10  # keys 0 … values-1: one digit each at 10
    batch: int = 4
    eval_batch: int = 8

    def __post_init__(self):
        self.tasks = tuple(self.tasks)
        self.train_sizes = tuple(int(s) for s in self.train_sizes)
        self.eval_sizes = tuple(sorted({int(s) for s in self.eval_sizes}))
        if any(s < 1 for s in self.eval_sizes):
            raise ValueError(f"eval_sizes must be sizes >= 1, got {self.eval_sizes}.")
        if self.adaptive_steps is not None and self.adaptive_steps < 1:
            raise ValueError(f"adaptive_steps must be >= 1, got {self.adaptive_steps}.")
        for name in (
            "eval_factor",
            "values",
            "seeds",
            "steps",
            "batch",
            "rank",
            "prompts",
            "eval_batch",
            "checkpoint_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not self.tasks:
            raise ValueError("choose at least one algorithm.")
        if len(self.train_sizes) != 2 or not 1 <= self.train_sizes[0] <= self.train_sizes[1]:
            raise ValueError(f"train_sizes must be two sizes lo <= hi, got {self.train_sizes}.")
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}.")
        for name in self.tasks:
            task(name, self)  # an unknown algorithm or size: one sentence, before any work

    @property
    def sizes(self) -> list[int]:
        """The evaluated sizes: the training range's ends and the powers of two inside it, then
        doublings of its largest size up to ``eval_factor`` × it (and that multiple itself),
        and ``eval_sizes``."""
        lo, hi = self.train_sizes
        inside = {lo, hi} | {2**k for k in range(hi.bit_length()) if lo <= 2**k <= hi}
        beyond = {
            hi * 2**k for k in range(1, self.eval_factor.bit_length()) if 2**k <= self.eval_factor
        }
        return sorted(inside | beyond | {hi * self.eval_factor} | set(self.eval_sizes))

    def steps_of(self, method: str) -> int:
        """A method's AdamW steps: ``adaptive_steps`` for adaptive where given, else ``steps``."""
        if method == "adaptive" and self.adaptive_steps is not None:
            return self.adaptive_steps
        return self.steps


PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "tasks": ("minimum", "insertion_sort"),
        "train_sizes": (4, 8),
        "seeds": 2,
        "steps": 40,
        "batch": 4,
        "prompts": 16,
    },
    "paper": {
        "tasks": ("insertion_sort", "binary_search", "activity_selector"),
        "train_sizes": (4, 8),
        "seeds": 2,
        "steps": 400,
        "batch": 8,
        "prompts": 48,
    },
}

#: what defines the run (a folder of other values is refused): the fine-tuned models and the
#: number of seeds, fixed before the first job so that a verdict over seeds is over the seeds
#: planned; other evaluation sizes or prompt counts may be asked of an existing folder
IDENTITY = (
    "model",
    "tasks",
    "train_sizes",
    "values",
    "steps",
    "batch",
    "lr",
    "rank",
    "seed",
    "seeds",
    "adaptive_steps",
)


def make_config(profile: str = "quick", **overrides: Any) -> Config:
    return Config(**profile_settings(PROFILES, profile, overrides))


def task(name: str, cfg: Config):
    """The CLRS-Text algorithm ``name`` trained at ``cfg.train_sizes`` (keys ``0 … values-1``
    where the algorithm has keys), checked to make every evaluated size. Its own evaluation
    sizes are left at their default, which no option of this study changes: a task whose data
    depend on them (``bfs``'s label pool) draws the same training examples whatever sizes are
    evaluated."""
    from ...tasks import sequence as tasks

    known = tasks.available("clrs")
    if name not in known:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(known)}.")
    options: dict[str, Any] = {"train_sizes": cfg.train_sizes}
    if "values" in inspect.signature(tasks.TASKS[name]).parameters:
        options["values"] = cfg.values
    t = tasks.get(name, **options)
    for size in cfg.sizes:
        t.check_size(size)
    return t


def seeds_of(cfg: Config) -> list[int]:
    return [cfg.seed + i for i in range(cfg.seeds)]


#: LLM tokens per task token of a CLRS-Text prompt and its answer, at most (SmolLM2's tokenizer:
#: 1.0-4.1 over the algorithms at sizes 4-128)
PROMPT_TOKENS = 5
#: bytes per LLM token of a test prompt while it is made and kept: the task's tokens, the text,
#: the tokenizer's encoding and the list of ids (191 measured)
PROMPT_BYTES = 256


def check_memory(cfg: Config, pool: str | None = None) -> None:
    """Refuse in one sentence, before the model is loaded or any test prompt made, a run whose
    estimated memory (`memory.estimate`) is more than this machine has available: the
    pretrained model and the copy being fine-tuned with its adapters, every test prompt (all
    are made before training), and the activations of a training batch at the largest training
    size and of an evaluation batch at the largest evaluated size, at most the model's context
    long (a longer prompt is refused once made). The fine-tunings run in this process, so
    ``pool`` is not used. A model other than SmolLM2 is not estimated: loading it is refused."""
    known = pretrained_shape(cfg.model)
    if known is None:
        return
    shape, context = known
    ts = [task(name, cfg) for name in cfg.tasks]
    hi, top = cfg.train_sizes[1], max(cfg.sizes)

    def tokens(size: int) -> int:  # the longest prompt and answer at ``size``, at most
        return max(PROMPT_TOKENS * t.length(size) for t in ts)

    made = sum(tokens(size) for size in cfg.sizes) * len(ts) * cfg.prompts * PROMPT_BYTES
    job = memory.estimate(
        shape,
        train=(cfg.batch, min(tokens(hi), context)),
        evaluate=(cfg.eval_batch, min(tokens(top), context)),
        trained=adapter_parameters(shape, cfg.rank),
        copies=2,
        inputs=made,
    )
    grown = "--eval-sizes" if top in cfg.eval_sizes else "--eval-factor"
    what, smaller = {
        "inputs": (
            f"making {cfg.prompts:,} test prompts per algorithm at sizes up to {top:,}",
            f"{grown} or --prompts",
        ),
        "evaluation": (f"evaluating {cfg.model} at size {top:,}", grown),
        "training": (f"fine-tuning {cfg.model} at size {hi:,}", "--train-sizes"),
        "model": (f"fine-tuning {cfg.model} with adapters of rank {cfg.rank}", "--rank"),
    }[job.largest]
    memory.check(job, 1, what, smaller)
