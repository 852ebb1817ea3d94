"""Train one decoder per job and evaluate it with every method of its recipe; the sweep over jobs,
here, on a process pool or on Ray."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...lab import memory, runner, runs
from ...lab.runner import Progress, RunFolder, emit
from ...normalizers import get, plugin
from ...normalizers.families import HookError
from .choices import SLOW, STREAM_DATA, STREAM_INIT, Method, resolve
from .config import (
    IDENTITY,
    MISSING_IDENTITY,
    Job,
    SequenceConfig,
    evaluation_params,
    in_distribution,
    method_params,
    most_steps,
    seeds_of,
    sizes_of,
    slug,
    steps_of,
    task,
    train_length,
)
from .evaluation import EVALUATION, SKIPPED, check_accuracy, eval_name, evaluate
from .rows import read_rows, row_problem, rows_file, rows_record


def build_model(cfg: SequenceConfig, m: Method, t, seed: int):
    """The decoder of one run, initialised from its seed."""
    from ...models.transformer import Transformer, TransformerConfig

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
    with runner.seeded(seed, STREAM_INIT):
        return Transformer(tc)


def switch(model: torch.nn.Module, method: str, **params) -> None:
    """Evaluate ``model`` with another normalizer (one without learnable parameters, e.g.
    ``adaptive`` on a softmax-trained model)."""
    from ...attention import MultiheadAttention

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


def run_job(
    job: Job, progress: Progress | None = None, where: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Train (or resume, or load) the job's decoder and evaluate it; one row per method × size,
    each with the training's seconds and steps (``train_seconds``, ``train_steps``: fewer than
    the task's where ``converge`` stopped it, `check_accuracy`). ``where`` (if given) is kept
    at the training step, check or evaluated size being run (for `run_job_or_failure`'s
    sentence).

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
        data = runner.generator(job.seed, STREAM_DATA)
        lo, hi = t.train_sizes
        steps = steps_of(cfg, job.task)  # the schedule's; the run may go on to `most_steps`
        until = None
        if cfg.converge > 0:
            inside = in_distribution(cfg, job.task)

            def until(step: int) -> bool:  # solved at every in-distribution size, or plateaued
                where["at"] = f"in the convergence check at training step {step}"
                acc = min(check_accuracy(model, t, inside, cfg, job.seed).values())
                history = _checked(job.folder, step, acc)
                stuck = plateaued(history, step, steps, cfg.plateau, cfg.plateau_gain)
                return acc >= cfg.converge or stuck

        def batch(step: int):
            where["at"] = f"at training step {step + 1}"
            size = int(torch.randint(lo, hi + 1, (1,), generator=data))
            return t.batch(size, cfg.batch, data)

        def schedule(step: int) -> float:  # linear warm-up, cosine to 10%, then 10%
            if step < cfg.warmup:
                return (step + 1) / cfg.warmup
            if step >= steps:  # a run still converging trains on at the final rate
                return 0.1
            x = (step - cfg.warmup) / max(1, steps - cfg.warmup)
            return 0.1 + 0.45 * (1 + math.cos(math.pi * x))

        trainer = runner.Trainer(
            job.folder,
            model,
            optimizer,
            steps=most_steps(cfg, job.task),
            batch=batch,
            loss=loss_fn,
            generators={"data": data},
            checkpoint_every=cfg.checkpoint_every,
            log_every=max(1, steps // 20),
            task=label,
            progress=progress,
            lr_schedule=schedule,
            clip_grad_norm=1.0,
            until=until,
            check_every=cfg.check_every,
        )
        if job.models is None:
            state = trainer.run()
        else:  # another run's model, read only
            state = runner.read_weights(final, model)
        rows = []
        sizes = sizes_of(cfg, job.task)
        for m in job.methods:
            if m.evaluate is not None:
                switch(model, m.evaluate, **evaluation_params(m, t))
            zeros = 0  # consecutive sizes beyond training at exact-match 0 (the stopping rule)
            for i, size in enumerate(sizes):
                row = {
                    "task": job.task,
                    "method": m.name,
                    "seed": job.seed,
                    "size": size,
                    "train_seconds": state.get("seconds"),
                    "train_steps": state.get("step"),
                }
                if cfg.stop_zeros and zeros >= cfg.stop_zeros:
                    rows.append({**row, **SKIPPED, "length": int(t.length(size))})
                    continue
                emit(progress, label, f"eval {m.name} n={size}", i, len(sizes))
                where["at"] = f"in evaluation at size {size}"
                path = job.folder / "eval" / slug(m.evaluate or m.train) / eval_name(cfg, size)
                path.parent.mkdir(parents=True, exist_ok=True)
                result = runner.once(path, lambda s=size: evaluate(model, t, s, cfg), EVALUATION)
                problem = row_problem({**result, "skipped": False}, cfg)
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


#: a converging job's check accuracies ([{"step", "acc"}], `_checked`): the plateau rule's
#: memory across a resume, and in a record, when each run converged
CHECKS = "checks.json"


def _checked(folder: Path, step: int, acc: float) -> list[dict[str, Any]]:
    """The job's check history (`CHECKS`) with this check's accuracy as its last entry. Entries
    from this step on are a run's that was interrupted and resumed from an earlier
    checkpoint: they are replaced, so the history is the one an uninterrupted run has."""
    path = Path(folder) / CHECKS
    history = runner.read_json(path, list) if path.is_file() else []
    history = [h for h in history if h["step"] < step] + [{"step": step, "acc": acc}]
    runner.write_json(path, history)
    return history


def plateaued(
    history: list[dict[str, Any]], step: int, steps: int, patience: int, gain: float = 0.05
) -> bool:
    """The plateau rule (``SequenceConfig.plateau``): the schedule's ``steps`` done, and the
    last ``patience`` checks of ``history`` have not raised the best accuracy of the checks
    before them by ``gain`` or more (False with ``patience`` 0 or too few checks)."""
    if patience < 1 or step < steps or len(history) <= patience:
        return False
    before = max(h["acc"] for h in history[:-patience])
    return max(h["acc"] for h in history[-patience:]) < before + gain


def run_job_or_failure(job: Job, progress: Progress | None = None) -> list[dict[str, Any]]:
    """`run_job`, except that a job training a plug-in (``module:name``) that fails in it
    (raises, gives a NaN or infinite weight, or the loss becomes NaN or infinite) returns one
    row per method, ``{"task", "method", "seed", "failed": sentence}``, instead of raising: its
    rows are not written (a re-run resumes it from what it saved) and the sweep goes on with the
    other jobs (`failures` separates them). Any other error is raised as before."""
    where: dict[str, Any] = {}
    try:
        return run_job(job, progress, where)
    except (plugin.PluginFailed, HookError, FloatingPointError) as err:
        mine = [m.train for m in job.methods if plugin.is_spec(m.train)]
        if not mine:
            raise
        what = (
            err.clause
            if isinstance(err, HookError)
            else str(err)
            if isinstance(err, plugin.PluginFailed)
            else "the loss became NaN or infinite"
        )
        sentence = (
            f"method {mine[0]!r} failed on task {job.task} (seed {job.seed}) "
            f"{where.get('at', 'while loading')}: {what}"
        )
        emit(progress, job.label, "done", 1, 1)
        return [
            {"task": job.task, "method": m.name, "seed": job.seed, "failed": sentence}
            for m in job.methods
        ]


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
        if cfg.converge:
            in_distribution(cfg, name)  # nothing to check it at: one sentence before any work
        for group in groups:
            for s in range(max(seeds_of(cfg, m.name) for m in group)):
                out.append(
                    Job(str(root), name, tuple(group), cfg.seed + s, cfg.to_dict(), cfg.models)
                )
    # tasks with more steps first (a stable sort keeps the order above within a budget)
    return sorted(out, key=lambda j: -steps_of(cfg, j.task))


def check_models(
    cfg: SequenceConfig, experiment: str, todo: list[Job] = (), out: str | Path | None = None
) -> None:
    """With ``cfg.models``: that folder is a run of ``experiment`` trained as ``cfg`` would
    train (`IDENTITY`), other than ``out``, and holds a trained model for every job of
    ``todo`` that has no rows in ``out`` yet (or, a record without its weights, that job's rows);
    else one sentence naming what is missing. It is only read: nothing is written there."""
    if cfg.models is None:
        return
    from ...lab.runner import read_config

    if out is not None and Path(out).resolve() == Path(cfg.models).resolve():
        raise ValueError(
            f"--models-from names the run folder itself ({cfg.models}); give another --out, or "
            "no --models-from to train and evaluate in this folder."
        )
    stored = {**MISSING_IDENTITY, **read_config(cfg.models, experiment)}
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


def job_memory(cfg: SequenceConfig, name: str) -> memory.Estimate:
    """The memory of a job of task ``name`` (`memory.estimate`): its decoder trained on batches
    of its longest training sequence and evaluated on batches at its largest size."""
    t = task(name)
    shape = memory.Shape(cfg.d_model, cfg.heads, cfg.layers, t.vocab_size)
    longest = t.length(max(sizes_of(cfg, name)))
    return memory.estimate(
        shape, train=(cfg.batch, train_length(t)), evaluate=(cfg.eval_batch, longest)
    )


def check_memory(cfg: SequenceConfig, ray: str | None = None) -> None:
    """Refuse in one sentence, before any model is built or test sequence made, a sweep whose
    largest job (`job_memory`) needs more memory than this machine has available, once on each
    worker process that runs at the same time (Ray's jobs run elsewhere: one is counted)."""
    estimates = {name: job_memory(cfg, name) for name in cfg.tasks}
    name = max(estimates, key=lambda n: estimates[n].peak)
    job, t = estimates[name], task(name)
    at_once = 1 if ray is not None else min(cfg.workers, len(jobs("", cfg)))
    params = memory.Shape(cfg.d_model, cfg.heads, cfg.layers, t.vocab_size).parameters
    decoder = f"a decoder of {cfg.layers} layers of width {cfg.d_model:,} ({params:,} parameters)"
    if job.largest == "evaluation":
        size = max(sizes_of(cfg, name))
        what = f"evaluating {decoder} on {name} at size {size:,} ({t.length(size):,} tokens)"
        options = ["--eval-factor", "--d-model"]
    else:
        what, options = f"training {decoder}", ["--d-model", "--layers"]
    if at_once > 1:
        what += f" in each of {at_once} worker processes at once"
        options.append("--workers")
    memory.check(job, at_once, what, ", ".join(options[:-1]) + " or " + options[-1])


def sweep(
    out: str | Path,
    experiment: str,
    cfg: SequenceConfig,
    progress: Progress | None = None,
    ray: str | None = None,
) -> tuple[RunFolder, list[dict[str, Any]]]:
    """Run every job of ``cfg`` into run folder ``out`` (resuming); return the rows, a failed
    plug-in's jobs among them as marked rows (`failures` separates them)."""
    from ...lab.sweep import run_jobs

    todo = jobs(out, cfg)  # unknown tasks or methods: one sentence before the folder is written
    check_memory(cfg, ray)
    check_models(cfg, experiment, todo, out)
    folder = RunFolder(out, experiment, cfg.to_dict(), identity=IDENTITY, missing=MISSING_IDENTITY)
    finished = {j.label for j in todo if rows_file(j, cfg).is_file()}  # a resumed sweep's
    results = run_jobs(
        run_job_or_failure,
        todo,
        workers=cfg.workers,
        ray=ray,
        progress=_overall(progress, experiment, len(todo), finished),
    )
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
