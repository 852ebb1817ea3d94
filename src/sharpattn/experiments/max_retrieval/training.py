"""Max retrieval's training (App. A.4): the seeds of a group as one ensemble on the runner's
`Trainer`, its regularisers, the logit spread and its bound (Figure 9), and the jobs that train
every group."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...diagnostics import logit_spread
from ...lab.runner import MetricsLog, Progress, Trainer, generator, read_weights, threads
from ...models import SetAttention
from ...tasks import sample_max_retrieval
from .config import (
    STREAM_DATA,
    STREAM_PROBE,
    STREAM_SIZES,
    TEST_SEED,
    Config,
    build_model,
    group_dir,
    groups,
    run_jobs,
)

Tensor = torch.Tensor


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
    data = [generator(s, STREAM_DATA) for s in seeds]
    sizes = generator(TEST_SEED, STREAM_SIZES)
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
            gens = [generator(s, STREAM_PROBE) for s in seeds]
            probe.append(
                _stack_batches(
                    [sample_max_retrieval(config.batch, config.max_items, g) for g in gens]
                )
            )
        penalty = l2_penalty(model, config)
        delta, bound = logit_spread_bound(model, probe[0][0], probe[0][1])
        total = None if losses is None else [c + p for c, p in zip(losses, penalty, strict=True)]
        return {
            "seeds": seeds,
            "l2": penalty,
            "total": total,
            "delta": delta,
            "bound": bound,
            "sum_w2": sum_of_squares(model),
        }

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
    return run_jobs(_group_job, jobs, pool, ray, progress)
