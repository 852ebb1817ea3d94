"""Max retrieval's configuration: the paper's numbers, `Config` and its profiles, the seeds'
groups and streams, and the run folder."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ... import normalizers as nz
from ...lab.protocol import option
from ...lab.runner import Progress, RunFolder, cores, profile_settings, seeded
from ...lab.runner import read_config as read_config_json
from ...lab.runs import available_memory, check_memory
from ...models import SetAttention
from ..paper_numbers import MAX_RETRIEVAL_SIZES, MAX_RETRIEVAL_TABLE1

#: Table 1's sizes and numbers (`paper_numbers`)
PAPER_SIZES, PAPER_TABLE1 = MAX_RETRIEVAL_SIZES, MAX_RETRIEVAL_TABLE1


#: How App. A.4's "L2 regularisation with λ = 0.001" can enter training; the paper does not say
#: which. Each is one change from "l2", the reading the reproduction defaults to.
REGULARISERS = {
    "l2": "CE + λ·Σw² over all parameters, Adam",
    "half_l2": "CE + λ/2·Σw² over all parameters, Adam",
    "l2_kernels": "CE + λ·Σw² over the weight matrices only (biases free), Adam",
    "adamw": "CE, AdamW with decoupled decay w ← w − lr·λ·w on all parameters",
}


@dataclass
class Config:
    """Everything that defines a run; stored in config.json. Defaults are the paper's (App. A.4)."""

    seeds: int = option(10, "Number of seeds (overrides the profile).", maximum="seeds")
    steps: int = option(100_000, "Adam steps per seed (overrides the profile).", maximum="steps")
    sizes: tuple[int, ...] = option(
        PAPER_SIZES, "Comma-separated evaluation set sizes.", kind="set_sizes", show_default=False
    )
    # the normalizer trained with ("baseline")
    method: str = option("softmax", "Normalizer trained with (the baseline).")
    # adaptive temperature at inference
    coefficients: str | list[float] = option(
        "icml",
        "Adaptive-temperature polynomial at inference: icml, arxiv or a JSON file.",
        kind="text",
    )
    batch: int = 128
    lr: float = 1e-3
    l2: float = 1e-3  # λ of App. A.4's "L2 regularisation"; how it enters: ``regulariser``
    # a key of REGULARISERS
    regulariser: str = option(
        "l2",
        "How λ = 0.001 enters training: l2 (λ·Σw²), half_l2 (λ/2·Σw²), "
        "l2_kernels (λ·Σw² without biases) or adamw (decoupled decay).",
    )
    min_items: int = 5
    max_items: int = 16
    # per size: standard error <= 0.5 points
    test_sets: int = option(
        10_000, "Most test sets per size (overrides the profile).", maximum="sets"
    )
    checkpoint_every: int = option(1_000, "", kind="checkpoint")
    log_every: int = 100
    # seeds trained together as one batched ensemble
    group: int = option(
        10,
        "Seeds trained together as one batched ensemble (default: the profile's).",
        maximum="seeds",
    )
    workers: int = 1  # groups trained in parallel local processes (or Ray tasks)
    # torch threads per process (default: cores // workers)
    threads: int | None = option(None, "", kind="threads")

    def __post_init__(self):
        self.sizes = tuple(int(n) for n in self.sizes)
        for name in (
            "seeds",
            "steps",
            "batch",
            "test_sets",
            "checkpoint_every",
            "log_every",
            "group",
            "workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"sizes must be positive integers, got {list(self.sizes)}.")
        if not 1 <= self.min_items <= self.max_items:
            raise ValueError(
                f"need 1 <= min_items <= max_items, got {self.min_items}, {self.max_items}."
            )
        if not (self.lr > 0 and self.l2 >= 0):
            raise ValueError(f"need lr > 0 and l2 >= 0, got lr={self.lr}, l2={self.l2}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}.")
        if self.regulariser not in REGULARISERS:
            raise ValueError(
                f"unknown regulariser {self.regulariser!r}; known: {', '.join(REGULARISERS)}."
            )
        if self.threads is None and self.workers > 1:
            self.threads = max(1, cores() // self.workers)
        nz.get(self.method)  # unknown names raise ValueError listing the known
        nz.resolve_coefficients(self.coefficients)


PROFILES: dict[str, dict[str, Any]] = {
    "quick": dict(
        seeds=1, group=1, steps=5_000, sizes=PAPER_SIZES[:9], test_sets=1_000, log_every=100
    ),
    # two single-threaded processes of 5 seeds each: as fast as one two-threaded process of 10
    # (benchmarks/batched_seeds.py), and no thread waits on a core another job holds
    "paper": dict(
        seeds=10,
        group=5,
        workers=2,
        steps=100_000,
        sizes=PAPER_SIZES,
        test_sets=10_000,
        log_every=1_000,
    ),
}


def make_config(profile: str = "quick", **overrides: Any) -> Config:
    """The configuration of a profile (a key of PROFILES), with ``overrides`` (None values
    ignored); the rest are Config's defaults, the paper's."""
    return Config(**profile_settings(PROFILES, profile, overrides))


#: the generator streams of a run (``runner.generator(seed, stream, …)``): fixed numbers, so a
#: run draws the same models and sets whatever else changes
(
    STREAM_INIT,
    STREAM_DATA,
    STREAM_PROBE,
    STREAM_TEST,
    STREAM_FIGURE,
    STREAM_FIT,
    STREAM_SIZES,
    STREAM_SCATTER,
) = range(8)
#: the test sets' seed: they are shared by all seeds and methods (paired comparison)
TEST_SEED = 20250101


#: peak bytes per member of a training ensemble at batch 128 and 16 items a set (activations,
#: gradients, Adam's state): 14 MiB measured (peak RSS growth of `train_group` from 10 to 40
#: members), twice that here
_MEMBER_BYTES = 32 << 20


def member_bytes(config: Config) -> int:
    """Training memory of one member of an ensemble, scaled from `_MEMBER_BYTES` by the
    batch's items (``batch × max_items``)."""
    return _MEMBER_BYTES * max(1, config.batch * config.max_items) // (128 * 16)


def check_groups(config: Config, ray: str | None = None) -> None:
    """Refuse in one sentence, before any model is built, ensembles that need more memory than
    this machine has available: ``group`` members (`member_bytes` each) on each worker process
    that trains at the same time (Ray's jobs run elsewhere: one is counted)."""
    members = min(config.group, config.seeds)
    at_once = 1 if ray is not None else min(config.workers, len(groups(config)))
    what, smaller = f"training {members:,} seeds together as one ensemble", "--group"
    if at_once > 1:
        what += f" in each of {at_once} worker processes at once"
        smaller += " or --workers"
    check_memory(at_once * members * member_bytes(config), what, smaller)


def seeds_together(config: Config, run: str | Path | None = None) -> tuple[int, str]:
    """The ``group`` for ``config.seeds`` seeds when the user did not choose one, and why.

    Every seed in one ensemble (``ceil(seeds / workers)`` per worker process, so each worker
    gets one), up to the memory bound: the ensembles that train at once (one per worker) must
    fit in the memory available now (`member_bytes` per member). A run folder ``run`` that
    already holds a max-retrieval run keeps its stored ``group``, so its trained ensembles are
    resumed, never trained again in another grouping."""
    stored = Path(run, "config.json") if run is not None else None
    if stored is not None and stored.is_file():
        with contextlib.suppress(ValueError, FileNotFoundError, TypeError):
            old = read_config_json(run, "max-retrieval")
            # a whole number: JSON's true is an int to Python, and no group size
            if type(old.get("group")) is int and old["group"] >= 1:
                return old["group"], f"the group of the run it resumes in {run}"
    per_worker = -(-config.seeds // config.workers)
    free = available_memory()
    bound = per_worker if free is None else max(1, free // (config.workers * member_bytes(config)))
    if per_worker <= bound:
        return per_worker, "all seeds together" if config.workers == 1 else "one per worker"
    return bound, f"as many as fit in the {free / 2**30:,.1f} GiB of memory available"


def build_model(config: Config, seed: int) -> SetAttention:
    """A freshly initialised model for ``seed`` (initialisation does not touch the global RNG)."""
    with seeded(seed, STREAM_INIT):
        return SetAttention(method=config.method)


def groups(config: Config) -> list[list[int]]:
    """Seeds trained together: consecutive blocks of ``config.group`` seeds."""
    seeds = list(range(config.seeds))
    return [seeds[i : i + config.group] for i in range(0, len(seeds), config.group)]


def group_dir(run: Path, seeds: list[int]) -> Path:
    return (
        Path(run)
        / "train"
        / (f"seed{seeds[0]}" if len(seeds) == 1 else f"seeds{seeds[0]}-{seeds[-1]}")
    )


#: Settings that change what a seed's training produces: a run folder keeps them fixed.
TRAINING_SETTINGS = (
    "steps",
    "method",
    "batch",
    "lr",
    "l2",
    "regulariser",
    "min_items",
    "max_items",
    "log_every",
)
#: what a run folder written before a training setting existed was trained with
_BEFORE = {"regulariser": "l2"}


def open_run(out: str | Path, config: Config) -> Path:
    """The run folder ``out`` for ``config``: written, or checked to hold a run of the same
    `TRAINING_SETTINGS` (refused in one sentence otherwise; a folder from before the
    ``regulariser`` setting holds "l2")."""
    return RunFolder(
        out, "max-retrieval", asdict(config), identity=TRAINING_SETTINGS, missing=_BEFORE
    ).path


def read_config(run: Path) -> Config:
    return Config(**{**_BEFORE, **read_config_json(run, "max-retrieval")})


def run_jobs(fn, jobs, config: Config, ray: str | None, progress: Progress | None):
    """``fn(job, progress)`` for every job: in this process, or on ``config.workers`` local
    processes or Ray (`sweep.run_jobs`); the results in order."""
    if config.workers == 1 and ray is None:
        return [fn(job, progress) for job in jobs]
    from ...lab.sweep import run_jobs as sweep_jobs

    return sweep_jobs(fn, jobs, workers=config.workers, ray=ray, progress=progress)
