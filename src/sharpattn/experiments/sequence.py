"""Size generalisation on sequence tasks: a tiny decoder per task × method × seed, trained at small
sizes and evaluated at sizes up to 64× larger.

The engine of ``sharpattn reproduce clrs`` (*Softmax is not Enough* §4.2 / Fig. 8 in small:
softmax against adaptive temperature applied in training and at inference, on CLRS-Text-style
algorithm tasks) and of ``sharpattn leaderboard`` (every trainable normalizer of the registry,
and the module options, on the same tasks, seeds and budget).

One **job** is (task, training recipe, seed): it trains one decoder on the runner
(`Trainer`: resume, checkpoints, seeded batches) and
evaluates it with every method that shares the recipe (``adaptive (inference)`` is the softmax
model evaluated with adaptive temperature, so it costs no training). Jobs run here, on a local
process pool or on Ray (`run_jobs`).

Evaluation is teacher-forced exact match: a sequence counts as solved when every answer token is
the model's most likely next token (for a deterministic answer that is what greedy decoding
produces), measured on the same test sequences for every method and seed (paired tests). Long
inputs go through ``attend(impl="auto")``: the fused or chunked paths, never a full score matrix
beyond the chunk size.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..normalizers import available, get, plugin
from ..tasks.sequence import default_eval_sizes
from . import runner, runs
from .runner import Progress, RunFolder, emit

#: the position schemes of a sweep's decoder (`TransformerConfig.positions` without a learned
#: table, which could not run beyond its length): RoPE, NoPE, ALiBi on every head, and NAPE
#: (ALiBi on half of the heads, NoPE on the others)
POSITIONS = ("rotary", "none", "alibi", "nape")

#: seeds of the data streams (runner.generator(seed, purpose, ...))
_INIT, _DATA, _TEST = 1, 2, 3


@dataclass(frozen=True)
class Method:
    """A row of the leaderboard: how its decoder is trained and how it is evaluated.

    ``train``: the registry normalizer in every attention layer during training; ``evaluate``:
    the normalizer at evaluation (None: the same); ``params``: fixed normalizer parameters;
    ``length_params``: parameters set to the longest training sequence (methods whose formula
    names the training length); ``selective`` / ``gate``: module options
    (`TransformerConfig`)."""

    name: str
    train: str
    evaluate: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    length_params: tuple[str, ...] = ()
    selective: str | None = None
    gate: str | None = None

    @property
    def recipe(self) -> str:
        """The training recipe: methods with the same recipe share one trained model."""
        parts = [self.train, *(f"{k}={v}" for k, v in self.params)]
        parts += [f"selective={self.selective}"] if self.selective else []
        parts += [f"gate={self.gate}"] if self.gate else []
        return ",".join(parts)


#: registry methods that cannot be trained by gradient descent, and why
UNTRAINABLE = {"hardmax": "argmax has zero gradient almost everywhere"}
#: training time relative to softmax where it is much longer (leaderboard --quick, measured:
#: entmax's bisection 6x, the other sorting-based normalizers 1.4-2.2x); orders the jobs
SLOW = {"entmax": 6.0, "entmax15": 2.2, "sparsemax": 1.8, "asentmax": 1.4, "topk": 1.4,
        "stick_breaking": 1.2}  # fmt: skip
#: fixed parameters whose value is the longest training sequence (see `Method`)
LENGTH_PARAMS = {"logn": ("train_length",), "llama4_temperature": ("floor_scale",)}


def methods() -> dict[str, Method]:
    """Every method of the leaderboard: each trainable registry normalizer, adaptive temperature
    at inference only (on the softmax model), selective temperatures and gated attention."""
    out: dict[str, Method] = {}
    for name in available():
        if name in UNTRAINABLE or plugin.is_spec(name):  # a plug-in runs where it is named
            continue
        out[name] = Method(name, name, length_params=LENGTH_PARAMS.get(name, ()))
    out["adaptive (inference)"] = Method("adaptive (inference)", "softmax", evaluate="adaptive")
    for which in ("q", "v", "qv"):
        out[f"selective_{which}"] = Method(f"selective_{which}", "softmax", selective=which)
    if _has_gate():
        out["gated"] = Method("gated", "softmax", gate="headwise")
    return out


def _has_gate() -> bool:
    from ..models.transformer import TransformerConfig

    return "gate" in TransformerConfig.__dataclass_fields__


def resolve(names: list[str] | tuple[str, ...] | None) -> list[Method]:
    """The methods called ``names`` (None: every one); unknown names: one sentence."""
    known = methods()
    if names is None:
        return list(known.values())
    for n in names:
        if plugin.is_spec(n) and n not in known:  # imported and probed where not yet loaded
            plugin.ensure(n)
            known[n] = Method(n, n)
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(
            f"unknown leaderboard method(s) {', '.join(map(repr, bad))}; known: {', '.join(known)}."
        )
    return [known[n] for n in names]


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
    #: another run folder of the same command whose trained models this sweep evaluates, read
    #: only (its training settings must be these, and it must hold a trained model for every
    #: job; evaluations and rows go to this run's folder); None: this one's
    models: str | None = None

    def __post_init__(self):
        self.tasks, self.methods = tuple(self.tasks), tuple(self.methods)
        if not self.tasks or not self.methods:
            raise ValueError("a sweep needs at least one task and one method.")
        for name in ("seeds", "steps", "batch", "d_model", "heads", "layers", "eval_factor",
                     "eval_sets", "eval_batch", "eval_min", "checkpoint_every", "workers",
                     "threads"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}.")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads}).")
        for name, steps in (self.task_steps or {}).items():
            if not isinstance(steps, int) or steps < 1:
                raise ValueError(f"task_steps[{name!r}] must be an integer >= 1, got {steps!r}.")
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


def profile_config(profiles: dict[str, dict[str, Any]], profile: str, family: str,
                   overrides: dict[str, Any]) -> SequenceConfig:  # fmt: skip
    """A command's configuration: its ``profile`` (a key of ``profiles``), then ``overrides``
    (None values ignored); no tasks given means every task of ``family``, no methods every
    method of the leaderboard."""
    from ..tasks import sequence as tasks

    values = runner.profile_settings(profiles, profile, overrides)
    if values.get("tasks") is None:
        values["tasks"] = tuple(tasks.available(family))
    if values.get("methods") is None:
        values["methods"] = tuple(methods())
    cfg = SequenceConfig(**values)
    resolve(cfg.methods)  # unknown methods or tasks: one sentence, before --list or any work
    for name in cfg.tasks:
        task(name)
    return cfg


#: what defines the trained models (a folder of another value of these is refused)
IDENTITY = ("seed", "steps", "task_steps", "batch", "lr", "weight_decay", "warmup", "d_model", "heads",
            "layers", "positions")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Tasks, sizes, the model
# ---------------------------------------------------------------------------------------------


def task(name: str):
    from ..tasks import sequence

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


def catalogue(cfg: SequenceConfig, family: str, known: tuple[str, ...]) -> dict[str, Any]:
    """What a command's ``--list`` shows: every task of ``family`` (its one-line description,
    training sizes, and the evaluation sizes ``cfg`` would use) and the methods ``known``, each
    marked ``chosen`` when ``cfg`` runs it."""
    from ..tasks import sequence as tasks

    rows = []
    for name in tasks.available(family):
        t = task(name)
        doc = " ".join((type(t).__doc__ or "").split())
        first = re.match(r"(.+?\.)(?:\s|$)", doc)  # its first sentence
        rows.append({"task": name, "chosen": name in cfg.tasks, "train_sizes": t.train_sizes,
                     "eval_sizes": sizes_of(cfg, name), "about": first[1] if first else doc})  # fmt: skip
    methods_ = [{"method": m, "chosen": m in cfg.methods} for m in known]
    return {"tasks": rows, "methods": methods_}


def steps_of(cfg: SequenceConfig, name: str) -> int:
    """The training steps of task ``name``: its entry of ``task_steps``, else ``steps``."""
    return int((cfg.task_steps or {}).get(name, cfg.steps))


def train_length(t) -> int:
    """The longest sequence the decoder sees in training (tokens)."""
    return max(t.length(s) for s in range(t.train_sizes[0], t.train_sizes[1] + 1))


def method_params(m: Method, t) -> dict[str, Any]:
    params = dict(m.params)
    for p in m.length_params:
        params[p] = train_length(t)
    return params


def build_model(cfg: SequenceConfig, m: Method, t, seed: int):
    """The decoder of one run, initialised from its seed."""
    from ..models.transformer import Transformer, TransformerConfig

    options: dict[str, Any] = {}
    if m.gate is not None:
        options["gate"] = m.gate
    tc = TransformerConfig(
        vocab_size=t.vocab_size,
        n_out=t.vocab_size,
        d_model=cfg.d_model,
        n_heads=cfg.heads,
        layers=("tf",) * cfg.layers,
        method=m.train,
        method_params=method_params(m, t),
        positions=cfg.positions,
        selective=m.selective,
        **options,
    )
    with runner.seeded(seed, _INIT):
        return Transformer(tc)


def switch(model: torch.nn.Module, method: str, **params) -> None:
    """Evaluate ``model`` with another normalizer (one without learnable parameters, e.g.
    ``adaptive`` on a softmax-trained model)."""
    from ..attention import MultiheadAttention

    entry = get(method)
    if entry.learnable:
        raise ValueError(f"cannot switch a trained model to {method!r}: it has learnable params.")
    for module in model.modules():
        if isinstance(module, MultiheadAttention):
            if len(module.normalizer_params):
                raise ValueError("cannot switch a model whose normalizer has learnable params.")
            module.method, module.method_params = entry.name, dict(params)


def loss_fn(model, b) -> torch.Tensor:
    logits = model(b.tokens)
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), b.targets.flatten(), ignore_index=-100
    )


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
        return Path(root) / "train" / self.task / _slug(self.methods[0].recipe) / f"seed{self.seed}"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in text)


def run_job(job: Job, progress: Progress | None = None, where: dict[str, Any] | None = None
            ) -> list[dict[str, Any]]:  # fmt: skip
    """Train (or resume, or load) the job's decoder and evaluate it; one row per method × size.
    ``where`` (if given) is kept at the training step or evaluated size being run (for
    `run_job_or_failure`'s sentence).

    A finished job's rows are kept in its folder (`rows_file`), named by what decides them.
    A job folder holding rows and none of the trainer's files (weights, checkpoint, training log:
    a published run's record, carried without them) is finished: its rows are returned once they
    pass `read_rows` (damaged rows are named, or evaluated again where ``job.models`` has
    the model). Where any training file is there, the job is checked and resumed from those
    files as always (a damaged one is named; deleting the weights retrains). With
    ``job.models``, the trained model is read from that run and never trained or written there
    (a record of that run without its weights: its rows of this job, checked).
    """
    cfg = SequenceConfig(**job.config)
    t = task(job.task)
    m0 = job.methods[0]
    label = job.label
    where = {} if where is None else where
    done = rows_file(job, cfg)
    final = job.model_folder / runner.TRAINING_FILES[0]
    if done.is_file() and not runner.has_training_files(job.folder):
        try:
            rows = read_rows(done, job, cfg)
        except ValueError:
            if job.models is None or not final.is_file():  # nothing to compute them from
                raise
            rows = None  # evaluated again on the other run's model
        if rows is not None:
            emit(progress, label, "done", 1, 1)
            return rows
    if job.models is not None and not final.is_file():  # the other run's record: its rows
        rows = read_rows(job.model_folder / done.name, job, cfg)
        runner.write_json(done, rows_record(job, cfg, rows))
        emit(progress, label, "done", 1, 1)
        return rows
    for m in job.methods:  # a worker process imports the plug-ins itself
        if plugin.is_spec(m.train):
            plugin.ensure(m.train)
    with runner.threads(cfg.threads):
        model = build_model(cfg, m0, t, job.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        data = runner.generator(job.seed, _DATA)
        lo, hi = t.train_sizes
        steps = steps_of(cfg, job.task)

        def batch(step: int):
            where["at"] = f"at training step {step + 1}"
            size = int(torch.randint(lo, hi + 1, (1,), generator=data))
            return t.batch(size, cfg.batch, data)

        def schedule(step: int) -> float:  # linear warm-up, then cosine to 10%
            if step < cfg.warmup:
                return (step + 1) / cfg.warmup
            x = (step - cfg.warmup) / max(1, steps - cfg.warmup)
            return 0.1 + 0.45 * (1 + math.cos(math.pi * x))

        trainer = runner.Trainer(
            job.folder,
            model,
            optimizer,
            steps=steps,
            batch=batch,
            loss=loss_fn,
            generators={"data": data},
            checkpoint_every=cfg.checkpoint_every,
            log_every=max(1, steps // 20),
            task=label,
            progress=progress,
            lr_schedule=schedule,
            clip_grad_norm=1.0,
        )
        if job.models is None:
            state = trainer.run()
        else:  # another run's model, read only
            state = runner.read_weights(final, model)
        rows = []
        sizes = sizes_of(cfg, job.task)
        for m in job.methods:
            if m.evaluate is not None:
                switch(model, m.evaluate)
            zeros = 0  # consecutive sizes beyond training at exact-match 0 (the stopping rule)
            for i, size in enumerate(sizes):
                row = {"task": job.task, "method": m.name, "seed": job.seed, "size": size,
                       "train_seconds": state.get("seconds")}  # fmt: skip
                if cfg.stop_zeros and zeros >= cfg.stop_zeros:
                    rows.append({**row, **SKIPPED, "length": int(t.length(size))})
                    continue
                emit(progress, label, f"eval {m.name} n={size}", i, len(sizes))
                where["at"] = f"in evaluation at size {size}"
                path = job.folder / "eval" / _slug(m.evaluate or m.train) / _eval_name(cfg, size)
                path.parent.mkdir(parents=True, exist_ok=True)
                result = runner.once(path, lambda s=size: evaluate(model, t, s, cfg), EVALUATION)
                problem = _row_problem({**result, "skipped": False}, cfg)
                if problem is not None:
                    raise runs.damaged(path, problem.replace("row", "it", 1))
                rows.append({**row, **result, "skipped": False})
                beyond = size > t.train_sizes[1]
                zero = result["acc"] == 0 and result["sets"] >= min(cfg.eval_min, cfg.eval_sets)
                zeros = zeros + 1 if beyond and zero else 0
            if m.evaluate is not None:
                switch(model, m.train, **method_params(m, t))
        record = rows_record(job, cfg, rows)
        runner.write_json(done, record, if_changed=True)  # a re-run that changed nothing: kept
        emit(progress, label, "done", len(sizes), len(sizes))
    return rows


def run_job_or_failure(job: Job, progress: Progress | None = None) -> list[dict[str, Any]]:
    """`run_job`, except that a job training a plug-in (``module:name``) that fails in it
    (raises, gives a NaN or infinite weight, or the loss becomes NaN or infinite) returns one
    row per method, ``{"task", "method", "seed", "failed": sentence}``, instead of raising: its
    rows are not written (a re-run resumes it from what it saved) and the sweep goes on with the
    other jobs (`failures` separates them). Any other error is raised as before."""
    where: dict[str, Any] = {}
    try:
        return run_job(job, progress, where)
    except (plugin.PluginFailed, FloatingPointError) as err:
        mine = [m.train for m in job.methods if plugin.is_spec(m.train)]
        if not mine:
            raise
        what = (
            str(err) if isinstance(err, plugin.PluginFailed) else "the loss became NaN or infinite"
        )
        sentence = (
            f"method {mine[0]!r} failed on task {job.task} (seed {job.seed}) "
            f"{where.get('at', 'while loading')}: {what}"
        )
        emit(progress, job.label, "done", 1, 1)
        return [{"task": job.task, "method": m.name, "seed": job.seed, "failed": sentence}
                for m in job.methods]  # fmt: skip


def failures(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """A sweep's rows without its failed jobs' (`run_job_or_failure`), and one clause per
    failed method: the first failure in job order and how many of its jobs failed."""
    failed: dict[str, list[str]] = {}
    for r in rows:
        if "failed" in r:
            failed.setdefault(r["method"], []).append(r["failed"])
    jobs_of: dict[str, set] = {}
    for r in rows:
        jobs_of.setdefault(r["method"], set()).add((r["task"], r["seed"]))
    clauses = [f"{v[0]} ({len(v)} of its {len(jobs_of[m])} jobs failed)" for m, v in failed.items()]
    return [r for r in rows if "failed" not in r], clauses


def rows_file(job: Job, cfg: SequenceConfig) -> Path:
    """Where a finished job keeps its rows: named by its methods, sizes and evaluation budget
    (what else decides them, the training, is the run folder's identity)."""
    digest = hashlib.sha256(json.dumps(_rows_key(job, cfg), sort_keys=True).encode()).hexdigest()
    return job.folder / f"rows-{digest[:12]}.json"


def _rows_key(job: Job, cfg: SequenceConfig) -> dict[str, Any]:
    return {"methods": [asdict(m) for m in job.methods], "sizes": sizes_of(cfg, job.task),
            "eval": _eval_name(cfg, 0), "stop_zeros": cfg.stop_zeros}  # fmt: skip


def job_identity(job: Job, cfg: SequenceConfig) -> dict[str, Any]:
    """What decides a job's rows: its task, seed, methods, sizes and evaluation budget, and the
    training settings of its model (as JSON gives them back)."""
    c = cfg.to_dict()
    training = {k: c[k] for k in IDENTITY if k not in ("steps", "task_steps")}
    training["steps"] = steps_of(cfg, job.task)
    key = {"task": job.task, "seed": job.seed, **_rows_key(job, cfg), "training": training}
    return json.loads(json.dumps(key))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _digest(identity: Any, rows: Any) -> str:
    """sha256 of the canonical JSON of a job's identity and its rows."""
    return hashlib.sha256(_canonical({"job": identity, "rows": rows}).encode()).hexdigest()


def rows_record(job: Job, cfg: SequenceConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A rows file's content: the job's identity (`job_identity`), its rows and the digest
    of both (`read_rows` checks it)."""
    identity = job_identity(job, cfg)
    return {"job": identity, "rows": rows, "digest": _digest(identity, rows)}


#: one row of a job (what `run_job` returns per method and size)
ROW = {"task": str, "method": str, "seed": int, "size": int, "acc": float, "token_acc": float,
       "sets": int, "length": int, "skipped": bool}  # fmt: skip
#: a rows file (`rows_record`)
ROWS_RECORD = {"job": {str: None}, "rows": [ROW], "digest": str}


def read_rows(path: str | Path, job: Job, cfg: SequenceConfig) -> list[dict[str, Any]]:
    """The rows of ``job`` stored at ``path``, checked: a record of `rows_record` whose
    digest matches its content and whose job is ``job``, or a bare list of rows (the format
    before digests, which published records use); either way every row must be of this job
    (task, seed, each method at each size once, in order) with accuracies in [0, 1] and counts
    of its budget. Anything else raises ``ValueError`` naming the file and what to do."""
    path = Path(path)
    fix = ("delete it and run the command again to evaluate that job anew (trained anew where "
           "its model is gone), or restore it from the run's record")  # fmt: skip
    value = runs.read_json(path, ({str: None}, list), fix)
    if isinstance(value, dict):
        problem = runs.mismatch(value, ROWS_RECORD)
        if problem is None:
            mine = job_identity(job, cfg)
            differ = [k for k in sorted(mine.keys() | value["job"].keys())
                      if _canonical(mine.get(k)) != _canonical(value["job"].get(k))]  # fmt: skip
            if value["digest"] != _digest(value["job"], value["rows"]):
                problem = "its digest does not match its content: it was edited or cut short"
            elif differ:
                problem = (
                    f"it holds another job's rows (its {', '.join(differ)} differ from this job's)"
                )
        rows = value.get("rows")
    else:
        rows, problem = value, runs.mismatch(value, [ROW])
    problem = problem or _rows_problem(rows, job, cfg)
    if problem is not None:
        raise runs.damaged(path, problem, fix)
    return rows


def _rows_problem(rows: list[dict[str, Any]], job: Job, cfg: SequenceConfig) -> str | None:
    """Why ``rows`` (each of the shape `ROW`) are not ``job``'s, or None."""
    if not rows:
        return "it holds no rows"
    want = [(m.name, s) for m in job.methods for s in sizes_of(cfg, job.task)]
    for i, r in enumerate(rows):
        if (r["task"], r["seed"]) != (job.task, job.seed):
            return (f"row {i} is of {r['task']} seed {r['seed']}, not of this job's "
                    f"{job.task} seed {job.seed}: another job's rows")  # fmt: skip
        if i >= len(want) or (r["method"], r["size"]) != want[i]:
            expected = f"{want[i][0]} at size {want[i][1]}" if i < len(want) else "no row"
            return (f"row {i} is {r['method']} at size {r['size']} where this job has "
                    f"{expected}: another job's rows")  # fmt: skip
        problem = _row_problem(r, cfg)
        if problem is not None:
            return problem.replace("row", f"row {i}", 1)
    if len(rows) < len(want):
        return f"it has no row for {want[len(rows)][0]} at size {want[len(rows)][1]}"
    return None


def _row_problem(r: dict[str, Any], cfg: SequenceConfig) -> str | None:
    """Why one row's numbers cannot be a measurement of this budget, or None."""
    if not (math.isfinite(r["acc"]) and 0 <= r["acc"] <= 1):
        return f"row has acc {r['acc']}, not an accuracy in [0, 1]"
    if r["skipped"]:  # the stopping rule's: no sequences, counted as 0
        return None if r["acc"] == 0 and r["sets"] == 0 else "row is skipped but has a measurement"
    if not (math.isfinite(r["token_acc"]) and 0 <= r["token_acc"] <= 1):
        return f"row has token_acc {r['token_acc']}, not an accuracy in [0, 1]"
    if not 1 <= r["sets"] <= cfg.eval_sets:
        return f"row counts {r['sets']} test sequences where this budget draws 1-{cfg.eval_sets}"
    if "answer_acc" in r:  # rows written before the failure analysis have neither field
        a = r["answer_acc"]
        if not (isinstance(a, (int, float)) and math.isfinite(a) and 0 <= a <= 1):
            return f"row has answer_acc {a}, not an accuracy in [0, 1]"
    if "failures" in r:
        f = r["failures"]
        if not (isinstance(f, dict) and set(f) == set(FAILURES)
                and all(isinstance(v, int) and v >= 0 for v in f.values())):  # fmt: skip
            return f"row has failures {f!r}, not a count of each of {', '.join(FAILURES)}"
    return None


def _eval_name(cfg: SequenceConfig, size: int) -> str:
    """The cache file of one size's evaluation, named by what decides its test sequences
    (``--eval-sets`` and the sampling rule may change between invocations)."""
    if cfg.eval_se > 0:
        return f"n{size}.se{cfg.eval_se:g}-{cfg.eval_min}-{cfg.eval_sets}-{cfg.eval_batch}.json"
    return f"n{size}.sets{cfg.eval_sets}.json"


#: a size the stopping rule did not evaluate: counted as exact-match 0 (token accuracy unknown)
SKIPPED = {"acc": 0.0, "token_acc": float("nan"), "sets": 0, "skipped": True}


def standard_error(solved: int, seqs: int) -> float:
    """The Agresti-Coull standard error of an accuracy of ``solved`` out of ``seqs``: that of
    (solved + 2) / (seqs + 4), which is not 0 at 0 or 1 as the plain one is."""
    p = (solved + 2) / (seqs + 4)
    return math.sqrt(p * (1 - p) / (seqs + 4))


def enough(solved: int, seqs: int, cfg: SequenceConfig) -> bool:
    """Whether a size's evaluation may stop after ``seqs`` test sequences, ``solved`` of them
    right: always at ``eval_sets``; with adaptive sampling (``eval_se`` > 0) once at least
    ``eval_min`` are in and the standard error is at most ``eval_se``."""
    if seqs >= cfg.eval_sets:
        return True
    if cfg.eval_se <= 0:
        return False
    return seqs >= cfg.eval_min and standard_error(solved, seqs) <= cfg.eval_se


def test_sets(t, size: int, cfg: SequenceConfig):
    """The test sequences of a size, in batches: the same for every method and seed."""
    gen = runner.generator(cfg.seed, _TEST, task_key(t.name), size)
    left = cfg.eval_sets
    while left > 0:
        n = min(cfg.eval_batch, left)
        left -= n
        yield t.batch(size, n, gen)


def task_key(name: str) -> int:
    """A seed key from the task's name (its first 8 bytes: the current names differ there; two
    names that did not would share test-set streams, not test sets, as their tasks differ)."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") >> 1


#: what `evaluate` returns (its cached files are checked against it; evaluations cached before
#: `FAILURE_KEYS` were recorded lack them, and still load)
EVALUATION = {"acc": float, "token_acc": float, "sets": int, "length": int}
#: the kinds of wrong prediction at a scored position that `evaluate` counts (``failures``):
#: ``wrong_token``, another token of the task's answer alphabet (`answer_tokens`: on
#: flip_flop, the wrong bit); ``non_answer``, a token outside it that is not EOS (a command, a
#: filler, a special token); ``early_end``, EOS where an answer token was due;
#: ``missing_end``, anything but EOS where the answer should end
FAILURES = ("wrong_token", "non_answer", "early_end", "missing_end")
#: the fields of a row that `evaluate` adds beyond `EVALUATION` (rows written before them
#: lack them): ``answer_acc``, the accuracy on the answer tokens alone (EOS aside: on
#: flip_flop, the answer bit), and ``failures``, {kind: count} over the scored positions
FAILURE_KEYS = ("answer_acc", "failures")


@torch.inference_mode()
def evaluate(model, t, size: int, cfg: SequenceConfig) -> dict[str, Any]:
    """Exact-match accuracy (every answer token right), answer-token accuracy (every scored
    position, EOS included), accuracy on the answer tokens alone (``answer_acc``, EOS aside)
    and a tally of what the model predicted where it was wrong (``failures``, `FAILURES`) at
    one size."""
    from ..tasks.sequence import EOS

    model.eval()
    solved = tokens = right = seqs = answers = answers_right = 0
    kinds = dict.fromkeys(FAILURES, 0)
    alphabet = torch.zeros(max(t.vocab_size, EOS + 1), dtype=torch.bool)
    alphabet[list(t.answer_tokens())] = True
    for b in test_sets(t, size, cfg):  # a prefix of the same stream: paired across methods
        pred = model(b.tokens).argmax(-1)
        scored = b.targets != -100
        ok = (pred == b.targets) | ~scored
        solved += int(ok.all(-1).sum())
        seqs += b.tokens.shape[0]
        right += int((ok & scored).sum())
        tokens += int(scored.sum())
        end = b.targets == EOS
        answer, wrong = scored & ~end, ~ok
        answers += int(answer.sum())
        answers_right += int((answer & ok).sum())
        due = wrong & answer  # wrong where an answer token was due
        in_alphabet = alphabet[pred.clamp(0, len(alphabet) - 1)] & (pred < len(alphabet))
        kinds["missing_end"] += int((wrong & end).sum())
        kinds["early_end"] += int((due & (pred == EOS)).sum())
        kinds["wrong_token"] += int((due & (pred != EOS) & in_alphabet).sum())
        kinds["non_answer"] += int((due & (pred != EOS) & ~in_alphabet).sum())
        if enough(solved, seqs, cfg):
            break
    model.train()
    return {"acc": solved / seqs, "token_acc": right / max(1, tokens),
            "answer_acc": answers_right / max(1, answers), "failures": kinds, "sets": seqs,
            "length": int(t.length(size))}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def jobs(root: str | Path, cfg: SequenceConfig) -> list[Job]:
    chosen = resolve(cfg.methods)
    recipes: dict[str, list[Method]] = {}
    for m in chosen:
        recipes.setdefault(m.recipe, []).append(m)
    # the slowest recipes first, so the last jobs of a pool are short ones and its workers finish
    # together
    groups = sorted(recipes.values(), key=lambda g: -SLOW.get(g[0].train, 1.0))
    out = []
    for name in cfg.tasks:
        task(name)  # unknown task: one sentence before any work
        for group in groups:
            for s in range(cfg.seeds):
                out.append(Job(str(root), name, tuple(group), cfg.seed + s, cfg.to_dict(),
                               cfg.models))  # fmt: skip
    # tasks with more steps first (a stable sort keeps the order above within a budget)
    return sorted(out, key=lambda j: -steps_of(cfg, j.task))


def check_models(cfg: SequenceConfig, experiment: str, todo: list[Job] = (),
                 out: str | Path | None = None) -> None:  # fmt: skip
    """With ``cfg.models``: that folder is a run of ``experiment`` trained as ``cfg`` would
    train (`IDENTITY`), other than ``out``, and holds a trained model for every job of
    ``todo`` that has no rows in ``out`` yet (or, a record without its weights, that job's rows);
    else one sentence naming what is missing. It is only read: nothing is written there."""
    if cfg.models is None:
        return
    from .runner import read_config

    if out is not None and Path(out).resolve() == Path(cfg.models).resolve():
        raise ValueError(
            f"--models-from names the run folder itself ({cfg.models}); give another --out, or "
            "no --models-from to train and evaluate in this folder."
        )
    stored = read_config(cfg.models, experiment)
    mine = cfg.to_dict()
    differ = [k for k in IDENTITY if k in stored and stored[k] != mine[k]]
    if differ:
        detail = ", ".join(f"{k} {stored[k]} there, {mine[k]} here" for k in differ)
        raise ValueError(
            f"{cfg.models} trained its models with other settings ({detail}): give the same "
            "profile and options, or no --models-from."
        )
    missing: dict[tuple[str, str], list[int]] = {}
    for j in todo:
        final, rows = j.model_folder / runner.TRAINING_FILES[0], rows_file(j, cfg)
        if not (final.is_file() or rows.is_file() or (j.model_folder / rows.name).is_file()):
            what = (j.task, ", ".join(m.name for m in j.methods))
            missing.setdefault(what, []).append(j.seed)
    if missing:
        detail = "; ".join(
            f"{names} on {name} (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))})"
            for (name, names), seeds in missing.items()
        )
        raise ValueError(
            f"{cfg.models} has no trained model for {detail}: train them there first (the same "
            f"command with --out {cfg.models}), or leave them out of the tasks, methods and seeds."
        )


def sweep(
    out: str | Path,
    experiment: str,
    cfg: SequenceConfig,
    progress: Progress | None = None,
    ray: str | None = None,
) -> tuple[RunFolder, list[dict[str, Any]]]:
    """Run every job of ``cfg`` into run folder ``out`` (resuming); return the rows, a failed
    plug-in's jobs among them as marked rows (`failures` separates them)."""
    from .sweep import run_jobs

    todo = jobs(out, cfg)  # unknown tasks or methods: one sentence before the folder is written
    check_models(cfg, experiment, todo, out)
    folder = RunFolder(out, experiment, cfg.to_dict(), identity=IDENTITY)
    finished = {j.label for j in todo if rows_file(j, cfg).is_file()}  # a resumed sweep's
    results = run_jobs(run_job_or_failure, todo, workers=cfg.workers, ray=ray, progress=_overall(
        progress, experiment, len(todo), finished))  # fmt: skip
    rows = [r for rs in results for r in rs]
    return folder, rows


def _overall(
    progress: Progress | None, name: str, total: int, finished: set[str] = frozenset()
) -> Progress | None:
    """One bar for a sweep of many jobs: jobs done out of ``total``, the latest event of any job
    as its note (a bar per job would be dozens of lines). The jobs labelled in ``finished``
    (done before this sweep started: a resumed run) are counted from the start, so the time
    left is estimated from the pace of the jobs this sweep runs, not from reading old rows."""
    if progress is None:
        return None
    done = [len(finished)]
    emit(progress, name, "jobs", done[0], total)

    def forward(ev: dict[str, Any]) -> None:
        if ev.get("phase") == "done" and ev.get("task") not in finished:
            done[0] += 1
        loss = f" loss {ev['loss']:.3f}" if ev.get("loss") is not None else ""
        note = f"{ev.get('task')} {ev.get('phase')} {ev.get('step')}/{ev.get('total')}{loss}"
        emit(progress, name, "jobs", done[0], total, note=note)

    return forward


# ---------------------------------------------------------------------------------------------
# Measures over seeds
# ---------------------------------------------------------------------------------------------


def area(sizes: list[int], acc: list[float]) -> float:
    """Normalised area under accuracy against log size (1 = solved at every size): the
    trapezoid rule on log2 size, divided by the log2 range. One size: its accuracy."""
    if len(sizes) == 1:
        return float(acc[0])
    x = np.log2(np.asarray(sizes, dtype=float))
    y = np.asarray(acc, dtype=float)
    return float(np.trapezoid(y, x) / (x[-1] - x[0]))


def per_seed(rows, key) -> dict[tuple, dict[int, float]]:
    """{(task, method): {seed: key(rows of that task, method, seed)}}."""
    groups: dict[tuple, dict[int, list]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["method"]), {}).setdefault(r["seed"], []).append(r)
    return {k: {s: key(sorted(v, key=lambda r: r["size"])) for s, v in g.items()}
            for k, g in groups.items()}  # fmt: skip


def auc_of(rows) -> float:
    return area([r["size"] for r in rows], [r["acc"] for r in rows])


__all__ = ["Method", "SequenceConfig", "area", "failures", "jobs", "methods", "resolve", "run_job",
           "run_job_or_failure", "sweep"]  # fmt: skip


def _mean(values: list[float]) -> float:
    """The mean of the finite ``values`` (a size the stopping rule skipped has no token
    accuracy); NaN where there is none."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def stopping(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How often the stopping rule fired: ``runs`` (task, method, seed) in all, ``stopped`` of
    them with skipped sizes, ``cells`` evaluated, ``skipped`` cells, and ``sequences`` drawn."""
    runs = {(r["task"], r["method"], r["seed"]) for r in rows}
    stopped = {(r["task"], r["method"], r["seed"]) for r in rows if r.get("skipped")}
    skipped = sum(bool(r.get("skipped")) for r in rows)
    return {"runs": len(runs), "stopped": len(stopped), "cells": len(rows) - skipped,
            "skipped": skipped, "sequences": sum(int(r["sets"]) for r in rows)}  # fmt: skip


def measures(rows: list[dict[str, Any]], spans: dict[str, tuple[int, int]] | None = None
             ) -> dict[tuple[str, str], dict[int, dict[str, float]]]:  # fmt: skip
    """{(task, method): {seed: measures}} with ``auc`` (`area` of accuracy over the
    evaluated sizes), ``id`` (mean accuracy at the sizes inside the task's training range),
    ``ood`` (mean accuracy beyond it), ``largest`` (accuracy at the largest size), and
    ``id_token`` / ``ood_token`` (the same means of answer-token accuracy). ``spans``: training
    ranges {task: (lo, hi)} where they are not the tasks' own."""
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["method"], r["seed"]), []).append(r)
    for (name, method, seed), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["size"])
        hi = _span(name, spans)[1]
        inside = [r["acc"] for r in rs if r["size"] <= hi]
        beyond = [r["acc"] for r in rs if r["size"] > hi]
        tok_in = [r["token_acc"] for r in rs if r["size"] <= hi]
        tok_out = [r["token_acc"] for r in rs if r["size"] > hi]
        out.setdefault((name, method), {})[seed] = {
            "auc": area([r["size"] for r in rs], [r["acc"] for r in rs]),
            "id": _mean(inside),
            "ood": _mean(beyond),
            "largest": rs[-1]["acc"],
            "id_token": _mean(tok_in),
            "ood_token": _mean(tok_out),
        }
    return out


def compare(per: dict[int, dict[str, float]], base: dict[int, dict[str, float]], key: str):
    """Mean ± sd of ``key`` over seeds and the paired t-test p-value against ``base`` (seeds
    both have; NaN with fewer than two)."""
    from .stats import paired_comparison

    seeds = sorted(set(per) & set(base))
    a = np.array([[base[s][key]] for s in seeds]) if seeds else np.zeros((0, 1))
    b = np.array([[per[s][key]] for s in seeds]) if seeds else np.zeros((0, 1))
    values = np.array([per[s][key] for s in sorted(per)])
    sd = float(values.std(ddof=1)) if len(values) > 1 else float("nan")
    p = float(paired_comparison(a, b).p_value[0]) if len(seeds) >= 2 else float("nan")
    return float(values.mean()), sd, p


def curves(rows, name: str) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """{method: (sizes, mean accuracy, sd)} of one task, over seeds."""
    by: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        if r["task"] == name:
            by.setdefault(r["method"], {}).setdefault(r["size"], []).append(r["acc"])
    out = {}
    for method, d in by.items():
        sizes = sorted(d)
        out[method] = (
            sizes,
            [float(np.mean(d[s])) for s in sizes],
            [float(np.std(d[s], ddof=1)) if len(d[s]) > 1 else 0.0 for s in sizes],
        )
    return out


def _span(name: str, spans: dict[str, tuple[int, int]] | None) -> tuple[int, int]:
    """The training range of task ``name``: its entry of ``spans``, else the task's own."""
    return tuple((spans or {}).get(name) or task(name).train_sizes)


def plot_curves(path: Path, rows, names: list[str], methods_: list[str], title: str,
                colors: dict[str, str] | None = None,
                spans: dict[str, tuple[int, int]] | None = None) -> None:  # fmt: skip
    """One panel per task: accuracy against size (log scale), a line per method (± sd over seeds
    as a band when there are at most four methods), the training range shaded (the shape of
    *Softmax is not Enough* Fig. 8; ``spans`` as in `measures`); the legend has a panel of
    its own where the grid has one free, else a column beside the grid. Every method has its
    own colour, line style and marker (`report.method_styles`, in the order of `methods`, so a
    method looks the same in every figure); ``colors`` overrides a method's colour."""
    from .report import figure, method_styles

    cols = min(4, len(names))
    nrows = math.ceil(len(names) / cols)
    spare_panel = len(names) % cols != 0  # the legend's own panel, else a column of its own
    ncol = 1 + len(methods_) // 14  # legend columns
    side = 0.0 if spare_panel else 1.7 * ncol  # inches for the legend's column
    size = (3.8 * cols + side, 3.0 * nrows + 0.4)
    with figure(path, nrows, cols, figsize=size, squeeze=False) as (fig, axes):
        styles = method_styles(methods_, catalogue=list(methods()))
        for method, color in (colors or {}).items():
            if method in styles:
                styles[method]["color"] = color
        bands = len(methods_) <= 4
        for i, name in enumerate(names):
            ax = axes[i // cols][i % cols]
            lo, hi = _span(name, spans)
            ax.axvspan(lo, hi, color="0.9", zorder=0)
            data = curves(rows, name)
            for method in methods_:
                if method not in data:
                    continue
                sizes, mean, sd = data[method]
                style = styles[method]
                ax.plot(sizes, mean, ms=3.5, lw=1.2, label=method, **style)
                color = style["color"]
                if bands:
                    low = [m - s for m, s in zip(mean, sd, strict=True)]
                    high = [m + s for m, s in zip(mean, sd, strict=True)]
                    ax.fill_between(sizes, low, high, alpha=0.12, color=color, lw=0)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("size", fontsize=8)
            ax.set_ylabel("exact-match accuracy", fontsize=8)
        for k in range(len(names), nrows * cols):
            axes[k // cols][k % cols].axis("off")
        handles, labels = axes[0][0].get_legend_handles_labels()
        if spare_panel:
            spare = axes[len(names) // cols][len(names) % cols]
            spare.legend(handles, labels, loc="center", fontsize=7, ncol=1 + len(labels) // 14,
                         title=title, title_fontsize=8, frameon=False)  # fmt: skip
        else:  # beside the grid, in the width added for it
            from matplotlib.layout_engine import TightLayoutEngine

            fig.set_layout_engine(TightLayoutEngine(rect=(0, 0, 1 - side / size[0], 0.97)))
            fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False,
                       bbox_to_anchor=(1.0, 0.5), ncol=ncol)  # fmt: skip
            fig.suptitle(title, fontsize=9)
