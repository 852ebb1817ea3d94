"""One sweep's configuration (`SequenceConfig`), its tasks and sizes, and one job of it (`Job`:
task, training recipe, seed)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ...lab import runner
from ...lab.protocol import option
from ...tasks.sequence import default_eval_sizes
from .choices import LENGTH_PARAMS, POSITIONS, Method, methods, resolve


@dataclass
class SequenceConfig:
    """One sweep: tasks × methods × seeds, the decoder, its training and its evaluation."""

    tasks: tuple[str, ...]
    methods: tuple[str, ...]
    seeds: int = 3
    seed: int = 0
    steps: int = 2000
    #: training steps of some tasks instead of ``steps`` ({task: steps}; `steps_of`)
    task_steps: dict[str, int] | None = None
    #: training until converged (0: off, every run trains its steps): every ``check_every``
    #: steps, the model's exact match is measured on ``check_sets`` check sequences at each
    #: in-distribution size (`in_distribution`; their own stream, not the test sequences), and
    #: training stops once it is at least ``converge`` at every one of them; a task's steps
    #: (`steps_of`) are the length of its learning-rate schedule, and the most it trains unless
    #: ``extend`` says more
    converge: float = 0.0
    check_every: int = 250
    check_sets: int = 64
    #: with ``converge``: a run not converged when its learning-rate schedule ends (its steps)
    #: trains on at the schedule's final rate, up to ``extend`` × its steps (`most_steps`; 1:
    #: no further)
    extend: float = 1.0
    #: with ``converge``, a plateau rule too (0: off): training also stops at a check once the
    #: schedule's steps are done and the last ``plateau`` checks have not raised the run's best
    #: check accuracy (the least over the sizes) by ``plateau_gain`` or more (`plateaued`); the
    #: gain must be above the checks' noise (one check sequence moves the accuracy by
    #: 1 / ``check_sets``)
    plateau: int = 0
    plateau_gain: float = 0.05
    batch: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 100
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    positions: str = "rotary"  # one of `POSITIONS`
    eval_factor: int = 64  # evaluate up to this multiple of the largest training size
    eval_sets: int = 128  # test sequences per size (the same for every method and seed); the most
    eval_batch: int = 16  # with ``eval_se``, when adaptive sampling stops short of it
    #: adaptive sampling (0: off, every size gets ``eval_sets``): test sequences are drawn in
    #: blocks of ``eval_batch`` until the cell's Agresti-Coull standard error is at most
    #: ``eval_se`` (after at least ``eval_min``), or ``eval_sets`` are spent (`enough`)
    eval_se: float = 0.0
    eval_min: int = 32
    #: stopping rule (0: off): after this many consecutive sizes beyond the training range at
    #: exact-match 0 (each on at least ``eval_min`` sequences), a run's larger sizes are not
    #: evaluated and count as 0 (rows marked ``skipped``; reports say how often it fired)
    stop_zeros: int = 0
    eval_sizes: dict[str, list[int]] = field(default_factory=dict)  # task -> sizes (override)
    checkpoint_every: int = 500
    workers: int = 1
    threads: int = 1
    #: seeds of some methods instead of ``seeds`` ({method: seeds}, `seeds_of`): unequal
    #: allocation, e.g. more for the reference every other method is compared with. A trained
    #: model serves every method of its recipe, so its jobs run the most seeds any of them has
    arm_seeds: dict[str, int] | None = None
    #: a planned run (`lab.plan`): its plan is fixed in its folder before the first job and
    #: pins its commit; ``record`` is its record (.tar.gz), unpacked before and packed after
    #: each sitting. Neither changes what is computed
    planned: bool = False
    record: str | None = None
    #: another run folder of the same command whose trained models this sweep evaluates, read
    #: only (its training settings must be these, and it must hold a trained model for every
    #: job; evaluations and rows go to this run's folder); None: this one's
    models: str | None = None

    def __post_init__(self):
        self.tasks, self.methods = tuple(self.tasks), tuple(self.methods)
        if not self.tasks or not self.methods:
            raise ValueError("a sweep needs at least one task and one method.")
        for name in (
            "seeds",
            "steps",
            "batch",
            "d_model",
            "heads",
            "layers",
            "eval_factor",
            "eval_sets",
            "eval_batch",
            "eval_min",
            "checkpoint_every",
            "workers",
            "threads",
            "check_every",
            "check_sets",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}.")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads}).")
        for name, steps in (self.task_steps or {}).items():
            if not isinstance(steps, int) or steps < 1:
                raise ValueError(f"task_steps[{name!r}] must be an integer >= 1, got {steps!r}.")
        if not 0 <= self.converge <= 1:
            raise ValueError(f"converge must be 0 (off) or in (0, 1], got {self.converge}.")
        if not (math.isfinite(self.extend) and self.extend >= 1):
            raise ValueError(f"extend must be a number >= 1 (1: no further), got {self.extend}.")
        if not isinstance(self.plateau, int) or self.plateau < 0:
            raise ValueError(f"plateau must be an integer >= 0 (0: off), got {self.plateau!r}.")
        if not 0 < self.plateau_gain <= 1:
            raise ValueError(f"plateau_gain must be in (0, 1], got {self.plateau_gain}.")
        for name, n in (self.arm_seeds or {}).items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"arm_seeds[{name!r}] must be an integer >= 1, got {n!r}.")
        if not 0 <= self.eval_se < 0.5:
            raise ValueError(f"eval_se must be in [0, 0.5), got {self.eval_se}.")
        if self.stop_zeros < 0:
            raise ValueError(f"stop_zeros must be >= 0, got {self.stop_zeros}.")
        if self.positions not in POSITIONS:
            raise ValueError(
                f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}."
            )
        if self.positions == "nape" and self.heads < 2:
            raise ValueError(
                "positions nape puts ALiBi on half of the heads: it needs heads >= 2, "
                f"got {self.heads}."
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SequenceOptions:
    """The options of the commands that run sweeps (``reproduce clrs``, ``leaderboard``;
    `protocol`): the fields of `SequenceConfig` a user sets, None where the profile's stand."""

    tasks: tuple[str, ...] | None = option(
        None, "Comma-separated tasks (see --list).", kind="names", show_default=False
    )
    seed: int = option(0, "First seed.", kind="seed")
    seeds: int | None = option(
        None,
        "Number of seeds (overrides the profile).",
        kind="count",
        maximum="seeds",
        show_default=False,
    )
    steps: int | None = option(
        None,
        "Training steps per run, for every task (replaces the profile's steps per task).",
        kind="count",
        maximum="steps",
        show_default=False,
    )
    positions: str | None = option(
        None,
        "Position scheme of the decoder: rotary (RoPE, the "
        "default), none (NoPE), alibi (a linear bias on every head) "
        "or nape (ALiBi on half of the heads, NoPE on the others, as "
        "ASEntmax trains).",
        kind="choice",
        choices=POSITIONS,
        show_default=False,
    )
    layers: int | None = option(
        None,
        f"Decoder layers [default: {SequenceConfig.layers}].",
        kind="count",
        maximum=64,
        show_default=False,
    )
    d_model: int | None = option(
        None,
        f"Decoder width [default: {SequenceConfig.d_model}].",
        kind="count",
        maximum=4096,
        show_default=False,
    )
    heads: int | None = option(
        None,
        f"Attention heads per layer [default: {SequenceConfig.heads}].",
        kind="count",
        maximum=64,
        show_default=False,
    )
    lr: float | None = option(
        None,
        "AdamW learning rate (overrides the profile).",
        kind="positive",
        maximum="rate",
        show_default=False,
    )
    eval_factor: int | None = option(
        None,
        "Evaluate up to this multiple of the largest training size (overrides the profile).",
        kind="count",
        maximum="factor",
        show_default=False,
    )
    eval_sets: int | None = option(
        None,
        "Test sequences per size, the same for every method and seed (overrides the profile).",
        kind="count",
        maximum="sets",
        show_default=False,
    )
    checkpoint_every: int = option(500, "", kind="checkpoint")
    threads: int | None = option(None, "", kind="threads")


def profile_config(
    profiles: dict[str, dict[str, Any]], profile: str, family: str, overrides: dict[str, Any]
) -> SequenceConfig:
    """A command's configuration: its ``profile`` (a key of ``profiles``), then ``overrides``
    (None values ignored); no tasks given means every task of ``family``, no methods every
    method of the leaderboard. Steps given without ``task_steps`` train every task that many
    steps (the profile's per-task steps are dropped), and seeds given without ``arm_seeds``
    give every method that many."""
    from ...tasks import sequence as tasks

    values = runner.profile_settings(profiles, profile, overrides)
    if overrides.get("steps") is not None and overrides.get("task_steps") is None:
        values["task_steps"] = None  # steps given: every task trains that many, not the profile's
    if overrides.get("seeds") is not None and overrides.get("arm_seeds") is None:
        values["arm_seeds"] = None  # seeds given: every method has that many
    if values.get("tasks") is None:
        values["tasks"] = tuple(tasks.available(family))
    if values.get("methods") is None:
        values["methods"] = tuple(methods())
    cfg = SequenceConfig(**values)
    resolve(cfg.methods)  # unknown methods or tasks: one sentence, before --list or any work
    for name in cfg.tasks:
        task(name)
    return cfg


#: options that leave a profile's work as it is: where it runs and how often it saves
NOT_WORK = ("checkpoint_every", "workers", "threads", "record")


def changes_work(cfg: SequenceConfig, plain: SequenceConfig) -> bool:
    """Whether ``cfg`` does other work than ``plain``, its profile unchanged (other tasks,
    methods, seeds, sizes, model or training): the profile's measured cost is then not its own."""
    same = {name: getattr(plain, name) for name in NOT_WORK}
    return replace(cfg, **same) != plain


#: the settings of training until converged (``converge`` and its checks)
CONVERGE_KEYS = ("converge", "check_every", "check_sets", "extend", "plateau", "plateau_gain")
#: what defines the trained models (a folder of another value of these is refused)
IDENTITY = (
    "seed",
    "steps",
    "task_steps",
    "batch",
    "lr",
    "weight_decay",
    "warmup",
    "d_model",
    "heads",
    "layers",
    "positions",
    *CONVERGE_KEYS,
)
#: what a run folder written before an `IDENTITY` key existed ran with (its config.json lacks
#: the key): the defaults, training for its steps
MISSING_IDENTITY = {name: getattr(SequenceConfig, name) for name in CONVERGE_KEYS}


# ---------------------------------------------------------------------------------------------
# Tasks, sizes, the model
# ---------------------------------------------------------------------------------------------


def task(name: str):
    from ...tasks import sequence

    return sequence.get(name)


def sizes_of(cfg: SequenceConfig, name: str) -> list[int]:
    """Evaluation sizes of a task: the configured ones, else the powers of two inside its training
    range and the task's evaluation sizes up to the first power of two at or above
    ``eval_factor`` × its largest training size (a task's default sizes are powers of two
    that far, whatever the factor; sizes given as a task option are kept as they are)."""
    if name in cfg.eval_sizes:
        return sorted({int(s) for s in cfg.eval_sizes[name]})
    t = task(name)
    lo, hi = t.train_sizes
    top = 1 << (cfg.eval_factor * hi - 1).bit_length()  # at least eval_factor x, a power of two
    inside = {2**k for k in range(max(0, lo - 1).bit_length(), hi.bit_length()) if lo <= 2**k <= hi}
    own = t.eval_sizes
    if "eval_sizes" not in t.options:
        own = default_eval_sizes(t.train_sizes, max(1, cfg.eval_factor))
    return sorted({s for s in own if s <= top} | inside)


def in_distribution(cfg: SequenceConfig, name: str) -> list[int]:
    """The evaluation sizes of task ``name`` (`sizes_of`) inside its training range: those at
    which ``converge`` checks it. None there raises ``ValueError``."""
    lo, hi = task(name).train_sizes
    inside = [s for s in sizes_of(cfg, name) if lo <= s <= hi]
    if not inside:
        raise ValueError(
            f"converge checks {name} at its evaluation sizes inside its training range {lo}-{hi}, "
            "and it has none there; add one to its evaluation sizes, or train without converge."
        )
    return inside


def catalogue(cfg: SequenceConfig, family: str, known: tuple[str, ...]) -> dict[str, Any]:
    """What a command's ``--list`` shows: every task of ``family`` (its one-line description,
    training sizes, and the evaluation sizes ``cfg`` would use) and the methods ``known``, each
    marked ``chosen`` when ``cfg`` runs it."""
    from ...tasks import sequence as tasks

    rows = []
    for name in tasks.available(family):
        t = task(name)
        doc = " ".join((type(t).__doc__ or "").split())
        first = re.match(r"(.+?\.)(?:\s|$)", doc)  # its first sentence
        rows.append(
            {
                "task": name,
                "chosen": name in cfg.tasks,
                "train_sizes": t.train_sizes,
                "eval_sizes": sizes_of(cfg, name),
                "about": first[1] if first else doc,
            }
        )
    methods_ = [{"method": m, "chosen": m in cfg.methods} for m in known]
    return {"tasks": rows, "methods": methods_}


def most_steps(cfg: SequenceConfig, name: str) -> int:
    """The most steps a run of task ``name`` trains: its steps (`steps_of`), times ``extend``
    where it trains until converged."""
    steps = steps_of(cfg, name)
    return round(steps * cfg.extend) if cfg.converge > 0 else steps


def seeds_of(cfg: SequenceConfig, method: str) -> int:
    """The seeds of ``method``: its entry of ``arm_seeds``, else ``seeds``."""
    return int((cfg.arm_seeds or {}).get(method, cfg.seeds))


def steps_of(cfg: SequenceConfig, name: str) -> int:
    """The training steps of task ``name``: its entry of ``task_steps``, else ``steps``."""
    return int((cfg.task_steps or {}).get(name, cfg.steps))


def train_length(t) -> int:
    """The longest sequence the decoder sees in training (tokens)."""
    return max(t.length(s) for s in range(t.train_sizes[0], t.train_sizes[1] + 1))


def evaluation_params(m: Method, t) -> dict[str, Any]:
    """The parameters of a method evaluated on another's models (``m.evaluate``): those of its
    formula that name the training length (`LENGTH_PARAMS`), set to the task's longest
    training sequence."""
    return {p: train_length(t) for p in LENGTH_PARAMS.get(m.evaluate or "", ())}


def method_params(m: Method, t) -> dict[str, Any]:
    params = dict(m.params)
    for p in m.length_params:
        params[p] = train_length(t)
    return params


# ---------------------------------------------------------------------------------------------
# One job: train one decoder, evaluate it with every method of its recipe
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    root: str
    task: str
    methods: tuple[Method, ...]  # same recipe
    seed: int  # the run seed (cfg.seed + index)
    config: dict[str, Any]
    #: the run folder whose trained model this job evaluates (``--models-from``, read only);
    #: None: the job trains its own in `folder`
    models: str | None = None

    @property
    def label(self) -> str:
        """How progress events name the job."""
        return f"{self.task}/{self.methods[0].recipe} s{self.seed}"

    @property
    def name(self) -> str:
        """How errors name the job (`sweep.job_label`): its label."""
        return self.label

    @property
    def folder(self) -> Path:
        """Where the job keeps its evaluations and rows (and its training, without ``models``)."""
        return self._under(self.root)

    @property
    def model_folder(self) -> Path:
        """Where the job's trained model is: `folder`, or that of the ``models`` run."""
        return self._under(self.models or self.root)

    def _under(self, root: str) -> Path:
        return Path(root) / "train" / self.task / slug(self.methods[0].recipe) / f"seed{self.seed}"


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in text)
