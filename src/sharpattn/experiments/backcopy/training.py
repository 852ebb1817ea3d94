"""Bigram-Backcopy's training runs: the model, its optimizer, the runner's `Trainer` with the
measures at log-spaced steps, and the jobs that train many runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ...lab import runner
from ...lab.runner import Progress, RunFolder, Trainer, generator, seeded
from ...models.transformer import (
    Transformer,
    parse_layers,
)
from ...tasks.bigram_backcopy import BigramBackcopy
from .config import STREAM_DATA, STREAM_EVAL, STREAM_INIT, M, RunConfig, log_steps
from .measures import measure, measure_no_bos

Tensor = torch.Tensor


# ----- training -------------------------------------------------------------------------------
def make_optimizer(cfg: RunConfig, model: Transformer) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.AdamW(
            model.parameters(),
            lr=cfg.learning_rate,
            betas=cfg.betas,
            eps=1e-8,
            weight_decay=cfg.weight_decay,
        )
    return torch.optim.SGD(model.parameters(), lr=cfg.learning_rate, momentum=cfg.momentum or 0.0)


def initialise(cfg, make: Callable[[], M]) -> M:
    """``make()`` (a model's construction) with the global RNG seeded from the initialisation
    stream of run ``cfg`` (its ``seed``), then restored."""
    with seeded(cfg.seed, STREAM_INIT):
        return make()


def build_model(cfg: RunConfig, task: BigramBackcopy) -> Transformer:
    """The run's freshly initialised model (seeded; the global RNG is left alone)."""
    return initialise(cfg, lambda: Transformer(cfg.model_config(task)))


def eval_tokens(cfg: RunConfig, task: BigramBackcopy) -> Tensor:
    """The run's fixed evaluation sequences (a stream of their own: never a training batch)."""
    return task.sample(cfg.eval_batch, cfg.seq_len, generator=generator(cfg.seed, STREAM_EVAL))


def next_token_loss(model: Transformer, x: Tensor, loss_from: int = 0) -> Tensor:
    """Mean cross-entropy of the next token at every position of ``x`` ``[B, T + 1]`` from
    position ``loss_from`` on (1: BOS's own prediction of the first token does not count)."""
    logits = model(x[:, :-1])[:, loss_from:]
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1 + loss_from :].flatten())


@dataclass
class Run:
    """A trained (or partly trained) run: its folder, config, model and measurements (also the
    simplified model's runs, `simplified`)."""

    dir: Path
    cfg: RunConfig
    model: Transformer
    metrics: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    steps_done: int = 0


def task_trainer(
    run_dir: str | Path,
    experiment: str,
    cfg,
    task: BigramBackcopy,
    model: Callable[[], torch.nn.Module],
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    loss: Callable[[torch.nn.Module, Tensor], Tensor],
    measure: Callable[[torch.nn.Module, BigramBackcopy, Tensor], dict],
    log_at: list[int],
    drop: int = 0,
    progress: Progress | None = None,
    label: str = "",
) -> Trainer:
    """The runner's Trainer for one run of configuration ``cfg`` (a `RunConfig` or the
    simplified model's: ``seed``, ``steps``, ``batch``, ``seq_len``, ``eval_batch``,
    ``checkpoint_every``) on ``task``, in a run folder of ``experiment`` (a folder holding a run
    of another configuration, ``checkpoint_every`` aside, is refused). ``model()`` builds the
    model, ``optimizer(model)`` its optimizer; the batches are fresh sequences of
    ``seq_len + 1`` tokens from the run's data stream (checkpointed), after cutting the first
    ``drop`` tokens of each; ``measure(model, task, tokens)`` on the run's evaluation sequences
    at the steps ``log_at`` goes into metrics.jsonl. With the same seed, batch and length, every
    model sees the same batches and evaluation sequences."""
    config = {
        **cfg.to_dict(),
        "task": {"chars": "".join(task.chars), "n_triggers": task.n_triggers},
    }
    identity = [k for k in config if k != "checkpoint_every"]
    folder = RunFolder(run_dir, experiment, config, identity=identity)
    net = model()
    data = generator(cfg.seed, STREAM_DATA)
    tokens = eval_tokens(cfg, task)
    return Trainer(
        folder.path,
        net,
        optimizer(net),
        steps=cfg.steps,
        batch=lambda step: task.sample(cfg.batch, cfg.seq_len + 1 + drop, generator=data)[:, drop:],
        loss=loss,
        generators={"data": data},
        checkpoint_every=cfg.checkpoint_every,
        log_at=log_at,
        on_log=lambda step, losses: measure(net, task, tokens),
        task=label or folder.path.name,
        progress=progress,
    )


def trainer(
    run_dir: str | Path,
    cfg: RunConfig,
    task: BigramBackcopy,
    progress: Progress | None = None,
    label: str = "",
) -> Trainer:
    """The runner's Trainer for one run (`task_trainer`): every measure at log-spaced
    steps; without BOS (App. C.4) each sequence loses its first token."""
    drop = 0 if cfg.bos is None or cfg.bos else 1
    return task_trainer(
        run_dir,
        "backcopy-training",
        cfg,
        task,
        model=lambda: build_model(cfg, task),
        optimizer=lambda m: make_optimizer(cfg, m),
        loss=lambda m, x: next_token_loss(m, x, cfg.loss_from or 0),
        measure=measure if drop == 0 else measure_no_bos,
        log_at=log_steps(cfg.steps, cfg.n_measure),
        drop=drop,
        progress=progress,
        label=label,
    )


def train(
    run_dir: str | Path,
    cfg,
    task: BigramBackcopy | None = None,
    *,
    stop_at: int | None = None,
    progress: Progress | None = None,
    label: str = "",
    make: Callable[..., Trainer] | None = None,
) -> Run:
    """Train (or resume, or load) the run in ``run_dir``; ``stop_at`` stops after that many
    steps in all, as a crash would. Same config, same numbers, interrupted or not. ``make``
    builds the run's Trainer from ``(run_dir, cfg, task, progress, label)``: `trainer`
    by default (the simplified model passes its own)."""
    t = (make or trainer)(run_dir, cfg, task or BigramBackcopy.tiny_shakespeare(), progress, label)
    return run_trainer(t, cfg, stop_at)


def train_job(job: tuple, progress: Progress | None) -> float:
    """A sweep job ``(folder, label, cfg, task, threads)``: train (or resume) one run in its
    folder; its training seconds."""
    path, label, cfg, task, threads = job
    with runner.threads(threads):
        return train(path, cfg, task, progress=progress, label=label).seconds


def train_runs(
    folder: RunFolder,
    cfgs: dict[str, RunConfig],
    task: BigramBackcopy,
    threads: int | None,
    workers: int = 1,
    ray: str | None = None,
    progress: Progress | None = None,
) -> None:
    """With ``workers`` > 1 or ``ray``: train the runs ``cfgs`` under ``folder/runs`` as parallel
    jobs, the most expensive first (blocks × steps × batch × tokens × width); else nothing (the
    caller trains them in order, which resumes or loads each)."""
    if workers <= 1 and ray is None:
        return
    from ...lab.sweep import run_jobs

    def cost(c: RunConfig) -> int:
        return len(parse_layers(c.layers)) * c.steps * c.batch * c.seq_len * c.d_model

    order = sorted(cfgs, key=lambda n: -cost(cfgs[n]))
    jobs = [(folder / "runs" / n, n, cfgs[n], task, threads) for n in order]
    run_jobs(train_job, jobs, workers=workers, ray=ray, progress=progress)


def run_trainer(t: Trainer, cfg, stop_at: int | None = None) -> Run:
    """Run (or resume, or load) the Trainer ``t`` of a run of configuration ``cfg``; its Run."""
    state = t.run(stop_at=stop_at)
    return Run(t.folder, cfg, t.model, t.metrics.read(), state["seconds"], state["step"])
