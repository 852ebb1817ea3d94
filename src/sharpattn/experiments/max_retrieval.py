"""Reproduce the max-retrieval experiment of Veličković et al., *Softmax is not Enough*.

App. A: train the set model (`SetAttention`) on sets of 5–16 items;
Sec. 4.1 / Table 1: evaluate it on 16 … 16,384 items with its own normalizer ("baseline") and
with adaptive temperature switched on at inference only (same parameters), over seeds, with a
paired t-test per size; Figures 2/7 (attention over the 16 largest items), 5 (entropy of
softmax_θ), 9 (logit spread vs the Proposition 3.1 bound); App. F: refit the temperature
polynomial (`fit_temperature`, Figure 6).

Run folder layout::

    RUN/config.json                 the configuration
    RUN/train/seeds{a}-{b}/checkpoint.safetensors   an ensemble of seeds a..b while training
    RUN/train/seeds{a}-{b}/model.safetensors        its final parameters (member s = seed a+s)
    RUN/train/seeds{a}-{b}/metrics.jsonl            per step: CE, the penalty, δ, its bound, Σw², per seed
    RUN/eval/<group>/n<size>/       the test sets' correctness per method and block (a cache)
    RUN/accuracy.json             accuracy (%) per method, seed and size
    RUN/table1.{md,csv,json}, RUN/*.png, RUN/summary.json, RUN/report.md

Everything around the experiment is the runner's (`runner`): the run folder, the seeds
trained together as one ensemble (`SetAttention.stack`), the loop and its resume, threads,
progress events; groups of seeds go to local processes or Ray through `sweep`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F

from .. import normalizers as nz
from ..diagnostics import logit_spread
from ..models import SetAttention
from ..tasks import sample_max_retrieval
from . import report
from .runner import (
    Clock,
    MetricsLog,
    Progress,
    RunFolder,
    Trainer,
    cores,
    emit,
    generator,
    numpy_generator,
    profile_settings,
    read_weights,
    seeded,
    threads,
    write_metrics,
)
from .runner import read_config as read_config_json
from .runs import available_memory, check_memory, read_json, write_atomic, write_json
from .stats import paired_comparison, reproduction_verdict

Tensor = torch.Tensor

PAPER_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Table 1 of the ICML version (accuracy %, averaged over ten seeds).
PAPER_TABLE1 = {
    "baseline": dict(
        zip(
            PAPER_SIZES,
            (98.6, 97.1, 94.3, 89.7, 81.3, 70.1, 53.8, 35.7, 22.6, 15.7, 12.4),
            strict=True,
        )
    ),
    "adaptive": dict(
        zip(
            PAPER_SIZES,
            (98.6, 97.1, 94.5, 89.9, 82.1, 72.5, 57.7, 39.4, 24.9, 17.5, 14.0),
            strict=True,
        )
    ),
    "p_value": dict(
        zip(
            PAPER_SIZES,
            (0.4, 0.4, 0.002, 2e-5, 2e-4, 3e-5, 1e-4, 6e-4, 0.02, 1e-3, 4e-3),
            strict=True,
        )
    ),
}


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

    seeds: int = 10
    steps: int = 100_000
    sizes: tuple[int, ...] = PAPER_SIZES
    method: str = "softmax"  # the normalizer trained with ("baseline")
    coefficients: str | list[float] = "icml"  # adaptive temperature at inference
    batch: int = 128
    lr: float = 1e-3
    l2: float = 1e-3  # λ of App. A.4's "L2 regularisation"; how it enters: ``regulariser``
    regulariser: str = "l2"  # a key of REGULARISERS
    min_items: int = 5
    max_items: int = 16
    test_sets: int = 10_000  # per size: standard error <= 0.5 points
    checkpoint_every: int = 1_000
    log_every: int = 100
    group: int = 10  # seeds trained together as one batched ensemble
    workers: int = 1  # groups trained in parallel local processes (or Ray tasks)
    threads: int | None = None  # torch threads per process (default: cores // workers)

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


_INIT, _DATA, _PROBE, _TEST, _FIGURE, _FIT, _SIZES, _SCATTER = range(8)
_TEST_SEED = 20250101  # test sets are shared by all seeds and methods (paired comparison)


#: peak bytes per member of a training ensemble at batch 128 and 16 items a set (activations,
#: gradients, Adam's state): 14 MiB measured (peak RSS growth of `train_group` from 10 to 40
#: members), twice that here
_MEMBER_BYTES = 32 << 20


def member_bytes(config: Config) -> int:
    """Training memory of one member of an ensemble, scaled from `_MEMBER_BYTES` by the
    batch's items (``batch × max_items``)."""
    return _MEMBER_BYTES * max(1, config.batch * config.max_items) // (128 * 16)


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
            if isinstance(old.get("group"), int) and old["group"] >= 1:
                return old["group"], f"the group of the run it resumes in {run}"
    per_worker = -(-config.seeds // config.workers)
    free = available_memory()
    bound = per_worker if free is None else max(1, free // (config.workers * member_bytes(config)))
    if per_worker <= bound:
        return per_worker, "all seeds together" if config.workers == 1 else "one per worker"
    return bound, f"as many as fit in the {free / 2**30:,.1f} GiB of memory available"


def build_model(config: Config, seed: int) -> SetAttention:
    """A freshly initialised model for ``seed`` (initialisation does not touch the global RNG)."""
    with seeded(seed, _INIT):
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


# ---------------------------------------------------------------------------------------------
# Training (App. A.4): the seeds of a group as one ensemble on the runner's Trainer
# ---------------------------------------------------------------------------------------------


def _is_bias(name: str) -> bool:
    return name.endswith("bias")


def make_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    """Adam on CE plus the penalty of ``config.regulariser`` (AdamW for "adamw").

    A penalty c·Σw² has gradient 2c·w, which is exactly what Adam's coupled ``weight_decay=2c``
    (not AdamW's) adds to every gradient, so the penalty costs no extra graph: 2λ for "l2", λ
    for "half_l2", 2λ on the weights and 0 on the biases for "l2_kernels". "adamw" has no
    penalty: each step shrinks every parameter by lr·λ after Adam's update (PyTorch's AdamW and
    optax's adamw alike). Adam is elementwise, so one Adam over an ensemble's stacked
    parameters is each member's own Adam."""
    lam, kind = config.l2, config.regulariser
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=lam, fused=True)
    decay = lam if kind == "half_l2" else 2 * lam
    named = list(model.named_parameters())
    free = [p for n, p in named if kind == "l2_kernels" and _is_bias(n)]
    decayed = [p for n, p in named if not (kind == "l2_kernels" and _is_bias(n))]
    param_groups = [{"params": decayed, "weight_decay": decay}]
    if free:
        param_groups.append({"params": free, "weight_decay": 0.0})
    return torch.optim.Adam(param_groups, lr=config.lr, fused=True)


@torch.no_grad()
def sum_of_squares(model: SetAttention, biases: bool = True) -> list[float]:
    """Σw² over the parameters (without the biases where ``biases`` is False), per member (one
    value for a single model)."""
    params = [p for n, p in model.named_parameters() if biases or not _is_bias(n)]
    if model.members is None:
        return [float(sum(p.double().pow(2).sum() for p in params))]
    return [float(v) for v in sum(p.double().pow(2).flatten(1).sum(1) for p in params)]


def l2_penalty(model: SetAttention, config: Config) -> list[float]:
    """The penalty term of ``config.regulariser`` in the training objective, per member (one
    value for a single model): λ·Σw² ("l2"), λ/2·Σw² ("half_l2"), λ·Σw² over the weight
    matrices ("l2_kernels"), 0 for "adamw" (its decay is not a term of the objective)."""
    kind = config.regulariser
    scale = {"l2": 1.0, "half_l2": 0.5, "l2_kernels": 1.0, "adamw": 0.0}[kind] * config.l2
    return [scale * v for v in sum_of_squares(model, biases=kind != "l2_kernels")]


@torch.no_grad()
def logit_spread_bound(
    model: SetAttention, x: Tensor, q: Tensor
) -> tuple[list[float], list[float]]:
    """Per member: the mean over sets of δ = max_i e_i − min_i e_i
    ([`logit_spread`][sharpattn.diagnostics.logit_spread]) and of Proposition 3.1's bound on it.

    With biases, e_i = (Q'y')ᵀ(K'h_i')/√d with Q' = [W_q | b_q], y' = [y; 1] (same for K, h_i),
    so δ <= 2·σmax(Q')·σmax(K')·‖y'‖·max_i ‖h_i'‖/√d (Prop. 3.1 applied to the augmented
    vectors). ``x``/``q`` carry the member dimension for an ensemble.
    """
    h, y = model.embed(x, q)
    delta = logit_spread(model.scores(x, q))  # (..., B)

    def augmented(lin):  # [W | b]: (..., d, d+1)
        return torch.cat((lin.weight, lin.bias.reshape(*lin.weight.shape[:-1], 1)), dim=-1)

    def with_one(t):
        return torch.cat((t, torch.ones_like(t[..., :1])), dim=-1)

    sq = torch.linalg.matrix_norm(augmented(model.query), ord=2)  # (...,)
    sk = torch.linalg.matrix_norm(augmented(model.key), ord=2)
    bound = (
        2
        * (sq * sk)[..., None]
        * with_one(y).norm(dim=-1)
        * with_one(h).norm(dim=-1).amax(-1)
        / math.sqrt(model.width)
    )  # (..., B)
    return delta.mean(-1).reshape(-1).tolist(), bound.mean(-1).reshape(-1).tolist()


def _stack_batches(batches) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(torch.stack([getattr(b, k) for b in batches]) for k in ("x", "q", "target"))


def trainer(
    run: Path, config: Config, seeds: list[int], progress: Progress | None = None
) -> Trainer:
    """The runner's Trainer for the seeds of one group, trained together as an ensemble.

    Member s starts from `build_model` (seed s) and draws its sets from its own stream;
    the number of items of each step comes from one run-wide stream, so every seed sees the same
    sizes and a seed trains to the same numbers alone or in any group (to float32 rounding).
    """
    model = SetAttention.stack([build_model(config, s) for s in seeds])
    data = [generator(s, _DATA) for s in seeds]
    sizes = generator(_TEST_SEED, _SIZES)
    probe: list[
        tuple[Tensor, Tensor, Tensor]
    ] = []  # drawn on first use (a finished run needs none)

    def batch(step: int):
        n = int(torch.randint(config.min_items, config.max_items + 1, (1,), generator=sizes))
        return _stack_batches([sample_max_retrieval(config.batch, n, g) for g in data])

    def loss(model: SetAttention, b) -> Tensor:
        x, q, target = b
        logits = model(x, q, check_finite=False)  # (S, B, C)
        ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        return ce.view(len(seeds), -1).mean(1)  # one CE per member

    def on_log(step: int, losses: list[float] | None) -> dict[str, Any]:
        """CE of the step's batch, the regulariser's penalty, their sum, and on a fixed probe batch of
        in-distribution sets the logit spread δ and its Prop. 3.1 bound (Figure 9); per member."""
        if not probe:
            gens = [generator(s, _PROBE) for s in seeds]
            probe.append(
                _stack_batches(
                    [sample_max_retrieval(config.batch, config.max_items, g) for g in gens]
                )
            )
        penalty = l2_penalty(model, config)
        delta, bound = logit_spread_bound(model, probe[0][0], probe[0][1])
        total = None if losses is None else [c + p for c, p in zip(losses, penalty, strict=True)]
        return {"seeds": seeds, "l2": penalty, "total": total, "delta": delta, "bound": bound,
                "sum_w2": sum_of_squares(model)}  # fmt: skip

    gens = {"sizes": sizes, **{f"data{s}": g for s, g in zip(seeds, data, strict=True)}}
    return Trainer(
        group_dir(run, seeds),
        model,
        make_optimizer(model, config),
        steps=config.steps,
        batch=batch,
        loss=loss,
        generators=gens,
        checkpoint_every=config.checkpoint_every,
        log_every=config.log_every,
        on_log=on_log,
        task=(f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}")
        + ("" if config.regulariser == "l2" else f", {config.regulariser}"),  # a study's bars
        progress=progress,
    )


def train_group(
    run: Path, config: Config, seeds: list[int], progress: Progress | None = None, stop_at=None
) -> dict[str, Any]:
    """Train (or resume, or load) the ensemble of ``seeds``; return the Trainer's state."""
    with threads(config.threads):
        return trainer(run, config, seeds, progress).run(stop_at=stop_at)


def load_ensemble(run: Path, config: Config, seeds: list[int]) -> SetAttention:
    """The trained ensemble of one group."""
    model = SetAttention.stack([build_model(config, s) for s in seeds])
    read_weights(group_dir(run, seeds) / "model.safetensors", model)
    return model.eval()


def load_model(run: Path, config: Config, seed: int) -> SetAttention:
    """The trained model of ``seed`` (a member of its group)."""
    if not 0 <= seed < config.seeds:
        raise ValueError(f"seed must be in 0..{config.seeds - 1}, got {seed}.")
    for g in groups(config):
        if seed in g:
            return load_ensemble(run, config, g).member(g.index(seed)).eval()
    raise AssertionError("unreachable")


def training_records(run: Path, config: Config) -> dict[int, list[dict[str, Any]]]:
    """Per seed: its metrics records (step, ce, l2, total, delta, bound, and Σw² over all
    parameters where the run logged it) from metrics.jsonl."""
    out: dict[int, list[dict[str, Any]]] = {}
    for g in groups(config):
        for rec in MetricsLog(group_dir(run, g) / "metrics.jsonl").read():
            for i, s in enumerate(rec["seeds"]):
                out.setdefault(s, []).append(
                    {
                        "step": rec["step"],
                        "ce": None if rec["loss"] is None else rec["loss"][i],
                        "l2": rec["l2"][i],
                        "loss": None if rec["total"] is None else rec["total"][i],
                        "delta": rec["delta"][i],
                        "bound": rec["bound"][i],
                        "sum_w2": rec["sum_w2"][i] if "sum_w2" in rec else None,
                    }
                )
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# Evaluation (Sec. 4.1, Table 1): every seed at once on one shared test set per size
# ---------------------------------------------------------------------------------------------

#: items per evaluation chunk of one member (activations of about 2 MB: the cache, not memory)
_CHUNK_ITEMS = 1 << 12
#: test sets per block: each block has its own stream, so any prefix of blocks is a test set
BLOCK = 1000
#: the largest test-set standard error of a cell's mean over seeds (points) the evaluation accepts
TARGET_SE = 0.5


#: peak bytes per item of a batch of sets through a member of the model (float32 features and
#: its width-sized activations): 1,085 measured (peak RSS growth of `correct_sets` on one
#: set of 2^20 items), about twice that here
_ITEM_BYTES = 4 * 128 * 4


def batch_bytes(size: int, sets: int, per_item: int = 0) -> int:
    """Peak memory of ``sets`` sets of ``size`` items through one member of the model, plus
    ``per_item`` bytes of the caller's own per item: the estimate every size is checked with
    (`check_sizes`)."""
    return sets * size * (_ITEM_BYTES + per_item)


def check_sizes(sizes, per_item: int = 0, chunk=None) -> None:
    """Refuse, before any work, sizes whose evaluation batches (``chunk(size)`` sets of a size;
    default: `test_batches`'s) would not fit in the memory available."""
    chunk = chunk or (lambda n: max(1, _CHUNK_ITEMS // n))
    size = max(sizes, key=lambda n: batch_bytes(n, chunk(n), per_item))
    need = batch_bytes(size, chunk(size), per_item)
    check_memory(need, f"a set of {size:,} items", "--sizes")


def test_batches(size: int, block: int, sets: int = BLOCK, chunk_sets: int | None = None):
    """Block ``block`` of the fixed test set of ``size`` (its first ``sets`` sets), in
    memory-bounded chunks. Blocks are independent streams shared by every seed and method."""
    g = generator(_TEST_SEED, size, _TEST, block)
    chunk = chunk_sets or max(1, _CHUNK_ITEMS // size)
    for start in range(0, sets, chunk):
        yield sample_max_retrieval(min(chunk, sets - start), size, g)


def eval_methods(config: Config) -> dict[str, tuple[str, dict[str, Any]]]:
    """Table 1's rows: the trained normalizer, and adaptive temperature at inference."""
    return {
        "baseline": (config.method, {}),
        "adaptive": ("adaptive", {"coefficients": config.coefficients}),
    }


def _method_key(method: str, params: dict[str, Any]) -> str:
    """A short stable name for (method, params); coefficients by value, not by file name."""
    params = dict(params)
    if "coefficients" in params:
        params["coefficients"] = list(nz.resolve_coefficients(params["coefficients"]))
    text = json.dumps([method, params], sort_keys=True)
    return f"{method}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


@torch.inference_mode()
def correct_sets(
    model: SetAttention,
    size: int,
    block: int,
    methods: dict[str, tuple[str, dict[str, Any]]],
    sets: int = BLOCK,
) -> dict[str, Tensor]:
    """Per method, which sets of test block ``block`` of ``size`` each member gets right:
    ``(S, sets)`` bool. Members run one after another on chunks of about ``_CHUNK_ITEMS`` items
    (cache-sized activations); each chunk is embedded once for every method.

    The answers go into tensors allocated up front: thousands of small result tensors kept
    between the megabyte-sized activations of large sets fragment glibc's heap so that it grew
    by about 1 MB per set at 16,384 items (13 GB by the end of a block)."""
    models = [model.member(s) for s in range(model.members)] if model.members else [model]
    out = {label: torch.zeros(len(models), sets, dtype=torch.bool) for label in methods}
    start = 0
    for b in test_batches(size, block, sets):
        stop = start + b.target.shape[0]
        for i, m in enumerate(models):
            qkv = m.qkv(*m.embed(b.x, b.q))
            for label, (method, params) in methods.items():
                att = m.attention(*qkv, method, check_finite=False, **params)
                out[label][i, start:stop] = m.readout(att).argmax(-1) == b.target
        start = stop
    return out


def _block_path(run: Path, seeds: list[int], size: int, block: int, key: str, sets: int) -> Path:
    return (
        group_dir(run, seeds).parent.parent
        / "eval"
        / group_dir(run, seeds).name
        / f"n{size}"
        / f"{key}.b{block}x{sets}.safetensors"
    )


def eval_block(
    run: Path, config: Config, seeds: list[int], size: int, block: int, methods
) -> dict[str, Tensor]:
    """Correctness ``(len(seeds), sets)`` per method of one group on one test block of
    ``sets = min(BLOCK, config.test_sets)`` sets, cached
    in RUN/eval/<group>/n<size>/ (one safetensors file per method and block)."""
    keys = {lb: _method_key(m, p) for lb, (m, p) in methods.items()}
    sets = min(BLOCK, config.test_sets)
    paths = {lb: _block_path(run, seeds, size, block, k, sets) for lb, k in keys.items()}
    todo = {lb: methods[lb] for lb, p in paths.items() if not p.is_file()}
    if todo:
        with threads(config.threads):
            model = load_ensemble(run, config, seeds)
            for lb, c in correct_sets(model, size, block, todo, sets).items():
                write_atomic(paths[lb], safetensors.torch.save({"correct": c.to(torch.uint8)}))
    out = {}
    for lb, p in paths.items():
        try:
            out[lb] = safetensors.torch.load_file(str(p))["correct"].bool()
        except Exception as e:  # a damaged cache file: name it
            raise ValueError(
                f"{p} is damaged ({e}); delete it and run the command again."
            ) from None
    return out


def _eval_job(job: dict[str, Any], progress: Progress | None = None) -> dict[str, Tensor]:
    config = Config(**job["config"])
    methods = {lb: (m, p) for lb, (m, p) in job["methods"].items()}
    return eval_block(Path(job["run"]), config, job["seeds"], job["size"], job["block"], methods)


def _run(fn, jobs, config: Config, ray: str | None, progress: Progress | None):
    if config.workers == 1 and ray is None:
        return [fn(job, progress) for job in jobs]
    from .sweep import run_jobs

    return run_jobs(fn, jobs, workers=config.workers, ray=ray, progress=progress)


def evaluate(
    run: Path,
    config: Config,
    methods: dict[str, tuple[str, dict[str, Any]]],
    progress: Progress | None = None,
    ray: str | None = None,
) -> dict[str, Any]:
    """Accuracy (%) per method, seed and size on a test set shared by every seed and method.

    The number of test sets per size is chosen so that the test-set standard error of each
    cell's mean over seeds stays <= ``TARGET_SE`` points: a first block of ``BLOCK`` sets, then
    as many blocks as the measured error asks for (SE² falls as 1/sets), up to
    ``config.test_sets``. SE = std over test sets of the seeds' mean correctness / √sets.
    """
    seeds, max_blocks = list(range(config.seeds)), max(1, config.test_sets // BLOCK)
    out: dict[str, Any] = {
        "accuracy": {lb: {s: {} for s in seeds} for lb in methods},
        "se_of_mean": {lb: {} for lb in methods},
        "test_sets": {},
    }
    wire = {lb: [m, p] for lb, (m, p) in methods.items()}
    for i, size in enumerate(config.sizes):
        emit(progress, "evaluation", f"n={size:,}", i, len(config.sizes))
        blocks: list[dict[str, Tensor]] = []  # per block: method -> (seeds, sets)
        want = 1
        while len(blocks) < want:
            jobs = [
                {
                    "run": str(run),
                    "config": asdict(config),
                    "seeds": g,
                    "size": size,
                    "block": k,
                    "methods": wire,
                }
                for k in range(len(blocks), want)
                for g in groups(config)
            ]
            results = _run(_eval_job, jobs, config, ray, progress)
            per = len(groups(config))
            for j in range(0, len(results), per):
                blocks.append(
                    {lb: torch.cat([r[lb] for r in results[j : j + per]]) for lb in methods}
                )
            se = max(_se(torch.cat([b[lb] for b in blocks], dim=1)) for lb in methods)
            if se > TARGET_SE and len(blocks) == 1:
                want = min(max_blocks, math.ceil((se / TARGET_SE) ** 2))
        for lb in methods:
            c = torch.cat([b[lb] for b in blocks], dim=1).double()  # (seeds, sets)
            for s in seeds:
                out["accuracy"][lb][s][size] = float(100 * c[s].mean())
            out["se_of_mean"][lb][size] = _se(c)
        out["test_sets"][size] = len(blocks) * min(BLOCK, config.test_sets)
    emit(progress, "evaluation", "done", len(config.sizes), len(config.sizes))
    return out


def _se(correct: Tensor) -> float:
    """Test-set standard error (points) of the seeds' mean accuracy: correctness (seeds, sets)."""
    per_set = correct.double().mean(0)
    return (
        float(100 * per_set.std() / math.sqrt(per_set.numel())) if per_set.numel() > 1 else math.nan
    )


# ---------------------------------------------------------------------------------------------
# Jobs: groups of seeds, in this process, local worker processes or Ray
# ---------------------------------------------------------------------------------------------


def _group_job(job: dict[str, Any], progress: Progress | None = None) -> dict[str, Any]:
    config = Config(**job["config"])
    return train_group(Path(job["run"]), config, job["seeds"], progress)


def train_all(
    run: Path, config: Config, progress: Progress | None = None, ray: str | None = None
) -> list[dict[str, Any]]:
    """Train (or resume) every group; ``config.workers`` local processes or Ray tasks."""
    return train_runs([(run, config)], config, progress, ray)


def train_runs(
    runs: list[tuple[Path, Config]],
    pool: Config,
    progress: Progress | None = None,
    ray: str | None = None,
) -> list[dict[str, Any]]:
    """Train (or resume) every group of every ``(run folder, config)`` of ``runs`` as one list
    of jobs on ``pool.workers`` local processes (or Ray tasks), so the runs share the workers;
    each group's state, in order."""
    jobs = [
        {"run": str(run), "config": asdict(config), "seeds": g}
        for run, config in runs
        for g in groups(config)
    ]
    return _run(_group_job, jobs, pool, ray, progress)


# ---------------------------------------------------------------------------------------------
# Table 1
# ---------------------------------------------------------------------------------------------


def table1(
    accuracy: dict[str, dict[int, dict[int, float]]],
    sizes,
    treatment: str = "adaptive",
    se: dict[str, dict[int, float]] | None = None,
    sets: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per size: ours (mean, std over seeds, paired t-test p) beside the paper's, and the
    gain over seeds (treatment − baseline, its 95 % interval, the gain detected with 80 % power
    and the verdict against the paper's gain where the paper found one, p ≤ 0.05; "–" where it
    did not). ``accuracy[method][seed][size]``; ``se[method][size]``: test-set standard error of
    the mean."""
    seeds = sorted(accuracy["baseline"])
    a = np.array([[accuracy["baseline"][s][n] for n in sizes] for s in seeds])
    b = np.array([[accuracy[treatment][s][n] for n in sizes] for s in seeds])
    cmp = paired_comparison(a, b)
    rows = []
    for j, n in enumerate(sizes):
        row = {
            "size": n,
            "seeds": len(seeds),
            "baseline_mean": cmp.mean_a[j],
            "baseline_std": cmp.std_a[j],
            f"{treatment}_mean": cmp.mean_b[j],
            f"{treatment}_std": cmp.std_b[j],
            "p_value": cmp.p_value[j],
            "paper_baseline": PAPER_TABLE1["baseline"].get(n),
            "paper_adaptive": PAPER_TABLE1["adaptive"].get(n),
            "paper_p_value": PAPER_TABLE1["p_value"].get(n),
        }
        pa, pb, pp = (PAPER_TABLE1[k].get(n) for k in ("baseline", "adaptive", "p_value"))
        paper_gain = None if pa is None else round(pb - pa, 1)
        claim = "–" if paper_gain is None else f"{paper_gain:+.1f}"
        v = reproduction_verdict(a[:, j], b[:, j], paper=claim, sign=1)
        row.update(gain=v.effect.mean, gain_low=v.effect.low, gain_high=v.effect.high,
                   detectable=v.detectable, paper_gain=paper_gain,
                   verdict=v.verdict if pp is not None and pp <= 0.05 else "–")  # fmt: skip
        if se is not None:
            row["test_se"] = max(se["baseline"][n], se[treatment][n])
        if sets is not None:
            row["test_sets"] = sets[n]
        rows.append(row)
    return rows


def verdict_table(rows: list[dict[str, Any]], label: str = "adaptive θ") -> str:
    """Markdown: per size, the gain over seeds with its 95 % interval, the gain detected with
    80 % power, the paper's gain and the verdict (where the paper claims a gain)."""

    def num(x: float) -> str:
        return "–" if x is None or not np.isfinite(x) else f"{x:+.1f}"

    return report.markdown_table(
        ["size", f"gain of {label} (ours)", "95 % interval (seeds)", "detectable (80 % power)",
         "gain (paper)", "verdict"],
        [[f"{r['size']:,}", num(r["gain"]),
          "–" if not np.isfinite(r["gain_low"]) else f"[{r['gain_low']:+.1f}, {r['gain_high']:+.1f}]",
          "–" if not np.isfinite(r["detectable"]) else f"{r['detectable']:.1f}",
          num(r["paper_gain"]), r["verdict"]] for r in rows],
        align="rrrrrl",
    )  # fmt: skip


def _fmt(mean, std) -> str:
    if std is None or not np.isfinite(std):
        return f"{mean:.1f}"
    return f"{mean:.1f} ± {std:.1f}"


def _fmt_p(p) -> str:
    return "n/a" if p is None or not np.isfinite(p) else f"{p:.2g}"


def paper_cell(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def write_table1(
    run: Path,
    rows: list[dict[str, Any]],
    name: str = "table1",
    treatment: str = "adaptive",
    label: str = "adaptive θ",
) -> str:
    """Write ``name``.md/.csv/.json into ``run``; return the markdown.

    With a ``treatment`` other than "adaptive" (the refit), rows that also carry "adaptive_mean"
    get a column for adaptive θ with the paper's coefficients too.
    """
    extra = treatment != "adaptive" and "adaptive_mean" in rows[0]
    se = "test_se" in rows[0]
    header = ["size", "baseline (ours)", "baseline (paper)"]
    header += ["adaptive θ (ours)"] if extra else []
    header += [f"{label} (ours)", "adaptive θ (paper)", "p (ours)", "p (paper)"]
    header += ["test sets", "test-set SE"] if se else []
    shown = []
    for r in rows:
        cells = [
            f"{r['size']:,}",
            _fmt(r["baseline_mean"], r["baseline_std"]),
            paper_cell(r["paper_baseline"]),
            *([_fmt(r["adaptive_mean"], r["adaptive_std"])] if extra else []),
            _fmt(r[f"{treatment}_mean"], r[f"{treatment}_std"]),
            paper_cell(r["paper_adaptive"]),
            _fmt_p(r["p_value"]),
            _fmt_p(r["paper_p_value"]),
            *([f"{r.get('test_sets', 0):,}", f"{r['test_se']:.2f}"] if se else []),
        ]
        shown.append(cells)
    md = report.markdown_table(header, shown, align="r" * len(header))
    write_atomic(run / f"{name}.md", md)
    write_atomic(run / f"{name}_verdicts.md", verdict_table(rows, label))
    cols = list(rows[0])
    write_atomic(run / f"{name}.csv", report.csv_text(cols, [[r[c] for c in cols] for r in rows]))
    write_json(run / f"{name}.json", [{k: _json_num(v) for k, v in r.items()} for r in rows])
    return md


def table_title(seeds: int) -> str:
    """The title of Table 1 as the command prints it."""
    return (
        "Max retrieval (Softmax is not Enough, Table 1): accuracy (%) by number of items, "
        f"mean ± sd over {seeds} seed{'s' if seeds != 1 else ''}"
    )


def table_note(rows: list[dict[str, Any]], seeds: int) -> str | None:
    """Why the table's ``p (ours)`` column says ``n/a`` where it does; None where it does not."""
    missing = [r for r in rows if r["p_value"] is None or not np.isfinite(r["p_value"])]
    if not missing:
        return None
    if seeds < 2:
        return (
            "p (ours) is n/a: the paired t-test over seeds needs at least two seeds and this run "
            "has one (the paper's: --seeds 10)."
        )
    return (
        "p (ours) is n/a where the t-test is undefined: every seed gave the same difference "
        "(e.g. both methods exact at the smallest sizes)."
    )


def _json_num(v):
    if isinstance(v, (float, np.floating)):
        return None if not np.isfinite(v) else float(v)
    return v


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def plot_accuracy(
    path: Path, rows: list[dict[str, Any]], extra: dict[str, list[float]] | None = None
) -> None:
    """Accuracy vs size (log x), ours with ±std bands and the paper's curves dashed."""
    sizes = [r["size"] for r in rows]
    with report.figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        for key, label, color in (("baseline", "baseline", "C0"), ("adaptive", "adaptive θ", "C1")):
            mean = np.array([r[f"{key}_mean"] for r in rows])
            std = np.nan_to_num(np.array([r[f"{key}_std"] for r in rows]))
            ax.plot(sizes, mean, "o-", color=color, label=f"{label} (ours)")
            ax.fill_between(sizes, mean - std, mean + std, color=color, alpha=0.2)
            paper = [
                (n, r[f"paper_{key}"])
                for n, r in zip(sizes, rows, strict=True)
                if r[f"paper_{key}"] is not None
            ]
            if paper:
                ax.plot(
                    *zip(*paper, strict=True),
                    "s--",
                    color=color,
                    alpha=0.6,
                    label=f"{label} (paper)",
                )
        for label, values in (extra or {}).items():
            ax.plot(sizes, values, "^-", color="C2", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("number of items n (trained on 5–16)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title("Max retrieval: accuracy vs set size")
        ax.grid(alpha=0.3)
        ax.legend()


@torch.inference_mode()
def plot_attention(
    path: Path, model: SetAttention, config: Config, max_size: int, sets: int = 32
) -> None:
    """Figures 2 and 7: weights of ``sets`` sets over their 16 largest-priority items (max
    rightmost), one panel per size 16, 32, …, ``max_size``; softmax above, adaptive below."""
    sizes = [16 * 2**i for i in range(int(math.log2(max(max_size, 16) / 16)) + 1)]
    g = generator(_TEST_SEED, _FIGURE)
    methods = eval_methods(config)
    with report.figure(
        path,
        2,
        len(sizes),
        figsize=(1.6 * len(sizes) + 1.8, 6),
        squeeze=False,
        dpi=110,
        layout="constrained",
    ) as (fig, axes):
        for j, n in enumerate(sizes):
            b = sample_max_retrieval(sets, n, g)
            top = b.priority.argsort(dim=-1)[:, -16:]  # (sets, 16), max rightmost
            for i, (label, (method, params)) in enumerate(methods.items()):
                _, w = model(b.x, b.q, method=method, return_weights=True, **params)
                ax = axes[i, j]
                im = ax.imshow(
                    w.gather(-1, top).cpu().numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1
                )
                ax.set_xticks([])
                ax.set_yticks([])
                if i == 0:
                    ax.set_title(f"n = {n:,}", fontsize=9)
                if j == 0:
                    ax.set_ylabel(
                        "softmax"
                        if label == "baseline" and method == "softmax"
                        else (method if label == "baseline" else "adaptive θ")
                    )
        fig.suptitle("Attention over the 16 largest items of 32 sets (max rightmost)")
        fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")


def fig5_boundaries(items: int = 10, floor: float | None = None) -> tuple[float, float]:
    """(λ*, θ*): the lines that split Figure 5 into its four regions.

    λ*: the λ > 0 where the logits a_i = λ^i (i = 1…items) are all equal (the caption's
    degenerate case), the positive real root of λ^(items−1) = 1: below it the logits fall with i
    and lie in (0, λ) (spread λ − λ^items < 1), above it they grow with i and their spread
    λ^items − λ explodes. θ*: the largest temperature adaptive temperature applies, 1/floor
    (Fig. 4: θ = 1/max(poly(H), floor), floor = 1 by default, the registry's): below it
    softmax_θ sharpens the logits, above it flattens them.
    """
    if items < 2:
        raise ValueError(f"items must be >= 2 (one logit has no spread), got {items}.")
    if floor is None:
        floor = next(p.default for p in nz.get("adaptive").params if p.name == "floor")
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}.")
    roots = np.roots([1.0] + [0.0] * (items - 2) + [-1.0])  # λ^(items−1) − 1
    (lam,) = [r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0]
    return float(lam), 1.0 / float(floor)


#: The four regions of Figure 5 (λ below/above λ*, θ below/above θ*).
FIG5_REGIONS = (
    ("λ < λ*, θ < θ*", "small spread, sharpened"),
    ("λ > λ*, θ < θ*", "growing spread, sharpened"),
    ("λ < λ*, θ > θ*", "small spread, flattened"),
    ("λ > λ*, θ > θ*", "growing spread, flattened"),
)


def entropy_landscape(items: int = 10, points: int = 200, top: float = 2.0):
    """(λ, θ, H): Figure 5's grid, H[θ, λ] the entropy of softmax_θ(a), a_i = λ^i, i = 1…items."""
    lam = torch.linspace(0.01, top, points, dtype=torch.float64)
    theta = torch.linspace(0.01, top, points, dtype=torch.float64)
    a = lam[:, None] ** torch.arange(1, items + 1, dtype=torch.float64)  # (λ, items)
    h = torch.stack([nz.entropy(nz.softmax(a, temperature=float(t))) for t in theta], dim=0)
    return lam.cpu().numpy(), theta.cpu().numpy(), h.cpu().numpy()


def region_entropies(items: int = 10, points: int = 200) -> list[dict[str, Any]]:
    """Mean, min and max entropy of Figure 5's grid in each of its four regions."""
    lam, theta, h = entropy_landscape(items, points)
    lam_star, theta_star = fig5_boundaries(items)
    out = []
    for (name, what), (lo_l, lo_t) in zip(
        FIG5_REGIONS, ((True, True), (False, True), (True, False), (False, False)), strict=True
    ):
        sel_l = lam < lam_star if lo_l else lam > lam_star
        sel_t = theta < theta_star if lo_t else theta > theta_star
        block = h[np.ix_(sel_t, sel_l)]
        out.append(
            {"region": name, "what": what, "mean": float(block.mean()),
             "min": float(block.min()), "max": float(block.max())}
        )  # fmt: skip
    return out


def plot_entropy_landscape(path: Path, items: int = 10) -> tuple[float, float]:
    """Figure 5: entropy of softmax_θ(a) for a_i = λ^i, i = 1…10, over (λ, θ), with its four
    regions marked by the lines λ = λ* and θ = θ* of `fig5_boundaries` (returned)."""
    lam, theta, h = entropy_landscape(items)
    lam_star, theta_star = fig5_boundaries(items)
    with report.figure(path, figsize=(6.5, 5), dpi=120) as (fig, ax):
        im = ax.pcolormesh(lam, theta, h, shading="auto", cmap="magma")
        fig.colorbar(im, ax=ax, label="entropy H (nats)")
        ax.axvline(lam_star, color="cyan", lw=1.2, ls="--")
        ax.axhline(theta_star, color="cyan", lw=1.2, ls="--")
        spots = (
            ((lam[0] + lam_star) / 2, (theta[0] + theta_star) / 2),
            ((lam_star + lam[-1]) / 2, (theta[0] + theta_star) / 2),
            ((lam[0] + lam_star) / 2, (theta_star + theta[-1]) / 2),
            ((lam_star + lam[-1]) / 2, (theta_star + theta[-1]) / 2),
        )
        for (name, what), (x, y) in zip(FIG5_REGIONS, spots, strict=True):
            ax.text(x, y, f"{name}\n{what}", color="cyan", ha="center", va="center", fontsize=7)
        ax.set_xlabel(f"λ  (logits a_i = λ^i, i = 1…{items}); λ* = {lam_star:g}: all equal")
        ax.set_ylabel(f"temperature θ; θ* = {theta_star:g}: adaptive θ's largest")
        ax.set_title(
            f"Entropy of softmax_θ over {items} logits (max log {items} = {math.log(items):.2f})"
        )
    return lam_star, theta_star


def plot_logit_spread(path: Path, records: list[list[dict[str, float]]]) -> None:
    """Figure 9: logit spread δ and its Proposition 3.1 bound over training (mean ± std over seeds)."""
    steps = np.array([m["step"] for m in records[0]])
    with report.figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        for key, label, color in (
            ("delta", "logit spread δ", "C0"),
            ("bound", "bound 2·σmax(Q)·σmax(K)·‖y‖·max‖x_i‖ (Prop. 3.1)", "C3"),
        ):
            v = np.array([[m[key] for m in rec] for rec in records])
            mean, std = v.mean(0), (v.std(0) if len(records) > 1 else np.zeros(v.shape[1]))
            ax.plot(steps, mean, color=color, label=label)
            ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("logits (sets of 16)")
        ax.set_title(
            f"Logit spread vs its upper bound ({len(records)} seed{'s' * (len(records) > 1)})"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------
# The whole reproduction
# ---------------------------------------------------------------------------------------------

#: Settings that change what a seed's training produces: a run folder keeps them fixed.
TRAINING_SETTINGS = ("steps", "method", "batch", "lr", "l2", "regulariser", "min_items",
                     "max_items", "log_every")  # fmt: skip
#: what a run folder written before a training setting existed was trained with
_BEFORE = {"regulariser": "l2"}


def open_run(out: str | Path, config: Config) -> Path:
    """The run folder ``out`` for ``config``: written, or checked to hold a run of the same
    `TRAINING_SETTINGS` (refused in one sentence otherwise; a folder from before the
    ``regulariser`` setting holds "l2")."""
    return RunFolder(out, "max-retrieval", asdict(config), identity=TRAINING_SETTINGS,
                     missing=_BEFORE).path  # fmt: skip


def read_config(run: Path) -> Config:
    return Config(**{**_BEFORE, **read_config_json(run, "max-retrieval")})


def reproduce(
    out: Path, config: Config, progress: Progress | None = None, ray: str | None = None
) -> dict[str, Any]:
    """Train and evaluate every seed (resuming what exists), then write tables, figures, report."""
    check_sizes(config.sizes)  # before the run folder is written
    run = open_run(out, config)
    clock = Clock()
    states = train_all(run, config, progress, ray)
    trained = clock.wall
    result = evaluate(run, config, eval_methods(config), progress, ray)
    rows = table1(
        result["accuracy"], config.sizes, se=result["se_of_mean"], sets=result["test_sets"]
    )
    write_table1(run, rows)
    write_json(run / "accuracy.json", result["accuracy"])
    evaluated = clock.wall
    plot_accuracy(run / "accuracy.png", rows)
    plot_attention(run / "attention.png", load_model(run, config, 0), config, max(config.sizes))
    plot_entropy_landscape(run / "entropy_landscape.png")
    plot_logit_spread(run / "logit_spread.png", list(training_records(run, config).values()))
    speeds = [
        st["steps_per_s"] * len(g)
        for st, g in zip(states, groups(config), strict=True)
        if st.get("steps_per_s")
    ]
    summary = {
        "elapsed_s": clock.wall,
        "train_s": trained,
        "eval_s": evaluated - trained,
        "steps_per_s": float(np.sum(speeds)) / config.seeds if speeds else None,
        "group": config.group,
        "threads": config.threads,
    }
    write_metrics(run, summary, "summary.json")
    write_report(run)
    return {"run": run, "rows": rows, **summary}


# ---------------------------------------------------------------------------------------------
# App. F: the temperature fit
# ---------------------------------------------------------------------------------------------

THETA_GRID = tuple(round(0.1 * i, 1) for i in range(1, 101))  # (0, 10] step 0.1


def optimal_temperature(e: Tensor, target: Tensor, grid=THETA_GRID) -> Tensor:
    """θ_opt per row: the grid θ maximising softmax(e/θ)[target] (first on ties), ``(B,)``.

    ``e`` ``(B, n)`` logits, ``target`` ``(B,)`` the item to retrieve.
    """
    thetas = torch.tensor(grid, dtype=torch.float64)
    e = e.to(torch.float64)
    z = e[None] / thetas[:, None, None]  # (G, B, n)
    log_p = z.gather(-1, target[None, :, None].expand(len(grid), -1, 1))[..., 0] - z.logsumexp(-1)
    return thetas[log_p.argmax(0)]  # (B,)


#: bytes per item of the fit's float64 logits over the θ grid (`optimal_temperature`: e/θ,
#: its exponentials for logsumexp, the result); with ``_ITEM_BYTES``, 2.3 times the 1,911 bytes
#: per item measured (peak RSS growth of `collect_fit_data` at n = 2^16)
_FIT_BYTES = 3 * 8 * len(THETA_GRID)


def fit_chunk(n: int) -> int:
    """Sets of ``n`` items the temperature fit takes at once (about 2^20 logits over the grid)."""
    return max(1, (1 << 20) // (n * len(THETA_GRID)))


def collect_fit_data(
    model: SetAttention, sizes, sets: int, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(H, 1/θ_opt) over sets whose max-priority item does not get the largest logit (App. F)."""
    hs, betas = [], []
    with torch.inference_mode():
        for n in sizes:
            chunk = fit_chunk(n)
            for start in range(0, sets, chunk):
                b = sample_max_retrieval(min(chunk, sets - start), n, generator)
                e = model.scores(b.x, b.q).to(torch.float64)  # (B, n)
                keep = e.argmax(-1) != b.argmax
                if not bool(keep.any()):
                    continue
                e, target = e[keep], b.argmax[keep]
                # H of softmax(e) as the adaptive normalizer computes it (reference code's eps).
                hs.append(nz.entropy(torch.softmax(e, -1), eps=1e-9).cpu().numpy())
                betas.append(1.0 / optimal_temperature(e, target).cpu().numpy())
    if not hs:
        raise ValueError("no set had its max item below another item's logit; nothing to fit.")
    return np.concatenate(hs), np.concatenate(betas)


def fit_temperature(
    run: Path,
    sizes=None,
    sets: int = 256,
    degree: int = 4,
    seeds: list[int] | None = None,
    evaluate_refit: bool = True,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Refit β(H) = 1/θ_opt (App. F) on the trained models of ``run``; write fit_temperature.json
    (which ``adaptive(coefficients=path)`` reads), Figure 6 and Table 1 with the refit."""
    run = Path(run)
    config = read_config(run)
    sizes = tuple(sizes or config.sizes)
    check_sizes(sizes, per_item=_FIT_BYTES, chunk=fit_chunk)  # before any work
    seeds = list(range(config.seeds)) if seeds is None else list(seeds)
    hs, betas = [], []
    for i, s in enumerate(seeds):
        emit(progress, "temperature fit", f"seed {s}", i, len(seeds))
        h, beta = collect_fit_data(load_model(run, config, s), sizes, sets, generator(s, _FIT))
        hs.append(h)
        betas.append(beta)
    emit(progress, "temperature fit", "done", len(seeds), len(seeds))
    h, beta = np.concatenate(hs), np.concatenate(betas)
    if len(h) <= degree:
        raise ValueError(
            f"only {len(h)} usable sets for a degree-{degree} fit; use more --sets or larger --sizes."
        )
    coefficients = np.polyfit(h, beta, degree)  # highest power first, as numpy.polyval
    path = run / "fit_temperature.json"
    write_json(
        path,
        {
            "coefficients": [float(c) for c in coefficients],
            "degree": degree,
            "samples": int(len(h)),
            "sizes": list(sizes),
            "sets_per_size": sets,
            "seeds": seeds,
            "theta_grid": [THETA_GRID[0], THETA_GRID[-1], 0.1],
            "paper_coefficients": list(nz.COEFFICIENTS["icml"]),
        },
    )
    nz.resolve_coefficients(str(path))  # what adaptive(coefficients=path) will read
    plot_fit(run / "fit_temperature.png", h, beta, coefficients)
    out: dict[str, Any] = {"path": path, "coefficients": coefficients, "samples": len(h)}
    if evaluate_refit:
        methods = {**eval_methods(config), "refit": ("adaptive", {"coefficients": str(path)})}
        result = evaluate(run, config, methods, progress)
        acc, se, sets = result["accuracy"], result["se_of_mean"], result["test_sets"]
        rows = table1(acc, config.sizes, treatment="refit", se=se, sets=sets)
        for r, base in zip(rows, table1(acc, config.sizes, se=se, sets=sets), strict=True):
            r["adaptive_mean"], r["adaptive_std"] = base["adaptive_mean"], base["adaptive_std"]
        write_table1(run, rows, name="table1_refit", treatment="refit", label="adaptive θ, refit")
        out["rows"] = rows
    write_report(run)
    return out


def plot_fit(path: Path, h: np.ndarray, beta: np.ndarray, coefficients) -> None:
    """Figure 6: (H, 1/θ_opt) samples, our degree-4 fit and the paper's polynomial."""
    with report.figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        rng = numpy_generator(_TEST_SEED, _SCATTER)  # which samples the figure draws
        idx = rng.choice(len(h), size=min(len(h), 4000), replace=False)
        ax.scatter(h[idx], beta[idx], s=4, alpha=0.3, color="gray", label=f"samples ({len(h):,})")
        grid = np.linspace(0, max(float(h.max()), 1.0), 300)
        ax.plot(grid, np.polyval(coefficients, grid), color="C0", lw=2, label="our fit")
        ax.plot(
            grid,
            np.polyval(nz.COEFFICIENTS["icml"], grid),
            "--",
            color="C3",
            lw=2,
            label="paper (ICML Fig. 6)",
        )
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_xlabel("entropy H of softmax(e)")
        ax.set_ylabel("1/θ_opt")
        ax.set_ylim(0, max(3.0, float(np.quantile(beta, 0.99))))
        ax.set_title("Adaptive temperature: polynomial fit of 1/θ_opt against H (App. F)")
        ax.grid(alpha=0.3)
        ax.legend()


# ---------------------------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------------------------


#: summary.json (timings of the latest invocation), as the report reads it
SUMMARY = {
    "elapsed_s": float,
    "train_s": float,
    "eval_s": float,
    "steps_per_s": (float, type(None)),
}


def write_report(run: Path) -> Path:
    """report.md from what the run folder holds (Table 1, refit table, figures, speed)."""
    run = Path(run)
    config = read_config(run)
    summary = (read_json(run / "summary.json", SUMMARY) if (run / "summary.json").is_file()
               else {})  # fmt: skip
    parts = [
        f"{config.seeds} seed(s) × {config.steps:,} Adam steps (lr {config.lr:g}, batch {config.batch}, "
        f"n ~ U{{{config.min_items}..{config.max_items}}}, regulariser `{config.regulariser}`: "
        f"{REGULARISERS[config.regulariser]}, λ = {config.l2:g}); trained normalizer "
        f"`{config.method}`; adaptive θ with coefficients `{config.coefficients}` at inference only. "
        f"{config.test_sets:,} test sets per size, the same for every seed and method; p: paired "
        "t-test over seeds (scipy `ttest_rel`); test-set SE: the standard error, over test sets, of "
        "the seeds' mean accuracy (the larger of the two columns).\n",
    ]
    if summary.get("steps_per_s"):
        parts.append(
            f"Training: {config.group} seed(s) per batched ensemble, {summary['steps_per_s']:.0f} "
            f"steps/s per seed. Wall time {summary['elapsed_s']:.0f} s: training "
            f"{summary['train_s']:.0f} s, evaluation {summary['eval_s']:.0f} s (this invocation; "
            "a resumed run counts only what it did).\n"
        )
    for name, title in (
        ("table1", "Table 1"),
        ("table1_refit", "Table 1 with the refitted temperature (App. F)"),
    ):
        if (run / f"{name}.md").is_file():
            parts.append(f"## {title}\n\n{(run / f'{name}.md').read_text()}")
        if (run / f"{name}_verdicts.md").is_file():
            parts.append(
                "Verdict over seeds, the unit that was randomised: the gain (accuracy points) "
                "with its 95 % t interval, the gain a paired t-test at 0.05 detects with 80 % "
                "power at the seeds' spread, and, where the paper found a gain (its p ≤ 0.05), "
                "reproduced / contradicted / not detectable at this power.\n\n"
                + (run / f"{name}_verdicts.md").read_text()
            )
    if (run / "fit_temperature.json").is_file():
        fit = read_json(run / "fit_temperature.json", {"coefficients": [float], "samples": int})
        coeffs = ", ".join(f"{c:.4g}" for c in fit["coefficients"])
        parts.append(
            f"Refitted β(H) = polyval([{coeffs}], H) from {fit['samples']:,} sets "
            f"(paper: {list(nz.COEFFICIENTS['icml'])}); file `fit_temperature.json`, usable as "
            "`adaptive(coefficients=path)`.\n"
        )
    regions = region_entropies()
    lam_star, theta_star = fig5_boundaries()
    parts.append(
        f"## Figure 5's four regions (λ* = {lam_star:g}, θ* = {theta_star:g})\n\n"
        + report.markdown_table(
            ["region", "logits / temperature", "mean H", "min H", "max H"],
            [
                [
                    r["region"],
                    r["what"],
                    f"{r['mean']:.3f}",
                    f"{r['min'] + 0.0:.3f}",
                    f"{r['max']:.3f}",
                ]
                for r in regions
            ],
        )  # fmt: skip
    )
    if (run / "corollary_b1.md").is_file():
        parts.append(
            "## Corollary B.1: {v_a, v_b, …, v_b} is misclassified once n is large\n\n"
            + (run / "corollary_b1.md").read_text()
        )
    for png, caption in (
        ("accuracy.png", "Accuracy vs set size, ours (±std) and the paper's."),
        (
            "attention.png",
            "Figures 2/7: attention over the 16 largest items of 32 sets; softmax above, adaptive θ below.",
        ),
        (
            "entropy_landscape.png",
            "Figure 5: entropy of softmax_θ over 10 logits a_i = λ^i, its four regions split at "
            "λ* (all logits equal) and θ* (the largest θ adaptive temperature applies).",
        ),
        (
            "logit_spread.png",
            "Figure 9: logit spread δ and the Proposition 3.1 bound during training.",
        ),
        ("fit_temperature.png", "Figure 6: the temperature fit, ours and the paper's."),
    ):
        if (run / png).is_file():
            parts.append(report.image(png, caption))
    return report.write_report(
        run, "Max retrieval (Veličković et al., *Softmax is not Enough*, App. A, Table 1)", parts
    )
