"""``sharpattn reproduce clrs-llm``: *Softmax is not Enough* §4.2 / Fig. 8 by fine-tuning a
pretrained decoder (SmolLM2-135M-Instruct, offline) on CLRS-Text.

The paper fine-tunes Gemma 2B on the CLRS-Text algorithms with and without adaptive temperature,
applied in training *and* at inference, and plots accuracy against problem size in and beyond the
training sizes. Here, per seed, two fine-tunings of the same pretrained model with identical
budgets: low-rank adapters (`adapters`: LoRA of rank ``rank`` on every layer's q, k, v and
o projections, the rest frozen) trained for ``steps`` AdamW steps on the same batches, one with
softmax attention and one with adaptive temperature in every layer (``sharpattn.hf.apply(net,
"adaptive")`` before training, so the adapters learn under it). The adapters start equal (drawn
from the seed alone) and the batches are drawn from the seed alone, so the two runs differ only in
the attention.

Data: the CLRS-Text prompts of `sharpattn.tasks.clrs_text` (``ClrsTask.text``: ``algo:\\n
key: [...]\\npred:\\n`` then the answer), keys ``0 … values-1``. A training example is an algorithm
of ``tasks`` and a size in ``train_sizes`` drawn uniformly; the loss is the cross-entropy of the
answer's tokens and the end-of-text token that closes it (the question is not scored).

Evaluation: ``prompts`` test prompts per algorithm and size, the same for both methods and every
seed, at the training sizes and beyond them up to ``eval_factor`` × the largest. Exact match: the
answer and its end-of-text token are each the model's most likely next token given the prompt
and the answer so far; this is exactly when greedy decoding produces the answer and stops
(checked against ``generate`` in the tests), computed in one forward pass. Answer-token accuracy:
the share of those tokens that are right. Paired tests (`stats`): over test prompts (each
prompt's score averaged over seeds) and over seeds (each seed's accuracy).

Each fine-tuning is a `Trainer` run in ``seed<s>/<method>/`` of the run folder,
training and checkpointing only the adapters (and the method's own parameters; adaptive
temperature has none), so a re-run resumes it after ``kill -9``; each evaluation is stored once.

The modules: `config`, `data` (prompts, batches, scores) and `page` (tables, verdicts,
report.md); this one fine-tunes and evaluates every seed and re-exports their public names.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...integrations.pretrained import quiet_transformers
from ...lab import runner
from ...lab.protocol import Result
from ...lab.report import require
from ...lab.runner import Clock, Progress, RunFolder, Trainer, emit, generator, write_metrics
from ...lab.runs import damaged, read_json, write_json
from .. import adapters
from ..clrs import summarize
from .config import (
    IDENTITY,
    IGNORE,
    METHODS,
    PROFILES,
    SCORES,
    STREAM_TEST,
    STREAM_TRAIN,
    Config,
    check_memory,
    make_config,
    seeds_of,
    task,
)
from .data import (
    answer_logits,
    collate,
    draw,
    encode,
    prompt_and_answer,
    score,
    test_prompts,
)
from .page import (
    in_distribution,
    per_size,
    pooled_beyond,
    seed_verdicts,
    write,
)

__all__ = [
    "Config",
    "IDENTITY",
    "IGNORE",
    "METHODS",
    "PROFILES",
    "SCORES",
    "STREAM_TEST",
    "STREAM_TRAIN",
    "TRAINING",
    "answer_logits",
    "check_memory",
    "collate",
    "draw",
    "encode",
    "fine_tune",
    "in_distribution",
    "make_config",
    "per_size",
    "pooled_beyond",
    "prompt_and_answer",
    "run",
    "run_experiment",
    "plan",
    "default_folder",
    "score",
    "seed_verdicts",
    "seeds_of",
    "task",
    "test_prompts",
    "write",
]


@quiet_transformers()  # loading and running the model: its warnings silenced, then restored
def run(
    out: str | Path, cfg: Config, progress: Progress | None = None, *, net=None, tok=None
) -> tuple[Path, dict[str, Any]]:
    """Fine-tune (or resume) both methods for every seed, evaluate, write the report. ``net`` /
    ``tok``: a causal LM and its tokenizer (tests); by default ``cfg.model``."""
    adapters.require_peft()
    check_memory(cfg)  # before the model is loaded or any test prompt made
    clock = Clock()
    with runner.threads(cfg.threads) as n_threads:
        ts = {name: task(name, cfg) for name in cfg.tasks}
        if net is None:
            from ...integrations.pretrained import load_pretrained

            net, tok = load_pretrained(cfg.model)
        tests = {
            (name, size): test_prompts(t, size, cfg, tok)
            for name, t in ts.items()
            for size in cfg.sizes
        }
        limit = getattr(net.config, "max_position_embeddings", None)
        (name, size), longest = max(
            ((k, max(len(q) + len(a) for q, a in v)) for k, v in tests.items()),
            key=lambda kv: kv[1],
        )
        if limit is not None and longest > int(limit):
            raise ValueError(
                f"{name} at size {size} needs {longest} tokens, beyond the model's "
                f"context ({limit}); choose smaller sizes."
            )
        # written once the inputs are known to fit: a refused run leaves no folder behind
        folder = RunFolder(
            out, "clrs-llm", {**asdict(cfg), "threads": n_threads}, identity=IDENTITY
        )
        rows, scores, training = [], {}, {}
        for s in seeds_of(cfg):
            for method in METHODS:
                arm = copy.deepcopy(net)  # every fine-tuning starts from the pretrained weights
                res = fine_tune(
                    folder.sub(f"seed{s}", method), arm, method, s, cfg, ts, tok, tests, progress
                )
                del arm
                training[f"{method} seed {s}"] = res["training"]
                for (name, size), sc in res["scores"].items():
                    scores[(name, method, s, size)] = sc
                    rows.append(
                        {
                            "task": name,
                            "method": method,
                            "seed": s,
                            "size": size,
                            "acc": float(np.mean(sc["exact"])),
                            "token_acc": sum(sc["right"]) / sum(sc["tokens"]),
                        }
                    )
        require(rows, "evaluations")
        spans = {name: cfg.train_sizes for name in cfg.tasks}
        metrics = {
            "rows": rows,
            "summary": summarize(rows, list(cfg.tasks), list(METHODS), spans),
            "sizes": per_size(scores, cfg),
            "training": training,
            "wall_seconds": clock.wall,
            "cpu_seconds": clock.cpu,
            "threads": n_threads,
        }
        write_metrics(folder, metrics)
        write(folder.path, cfg, metrics)
        return folder.path, metrics


#: a finished fine-tuning's summary, kept beside its evaluations (what the report needs of it)
TRAINING = {
    "seconds": (float, type(None)),
    "steps_per_s": (float, type(None)),
    "first_loss": (float, type(None)),
    "last_loss": (float, type(None)),
    "adapter_parameters": int,
    "method_parameters": int,
}


def _whole(path: Path, sc: dict[str, list[int]], pairs: list) -> dict[str, list[int]]:
    """An evaluation's scores, refused as damaged unless they hold every prompt of ``pairs``."""
    if not len(sc["exact"]) == len(sc["right"]) == len(sc["tokens"]) == len(pairs):
        raise damaged(path, f"it holds {len(sc['exact'])} prompts, not {len(pairs)}")
    return sc


def fine_tune(
    where: Path,
    net,
    method: str,
    s: int,
    cfg: Config,
    ts: dict,
    tok,
    tests: dict,
    progress: Progress | None,
) -> dict[str, Any]:
    """One fine-tuning (resumed or loaded if done) and its evaluations. A folder that holds the
    summary ``training.json`` and every evaluation is finished: it is read, not loaded, so a
    run folder packed without its weights (a record) resumes without training again."""
    evals = {key: where / f"eval_{key[0]}_n{key[1]}_p{cfg.prompts}.json" for key in tests}
    summary = where / "training.json"
    if summary.is_file() and all(p.is_file() for p in evals.values()):
        scores = {key: _whole(p, read_json(p, SCORES), tests[key]) for key, p in evals.items()}
        return {"training": read_json(summary, TRAINING), "scores": scores}
    holder = adapters.prepare(net, method, {}, cfg.rank, s)
    pad = int(tok.eos_token_id)
    data = generator(s, STREAM_TRAIN)  # the same batches for every method of a seed
    tasks_ = list(ts.values())

    def batch(step: int) -> dict[str, torch.Tensor]:
        return collate(
            [encode(tok, *prompt_and_answer(t, row)) for t, row in draw(tasks_, cfg, data)], pad
        )

    def loss(_holder, b: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, targets = answer_logits(net, b)
        return torch.nn.functional.cross_entropy(logits, targets)

    trainer = Trainer(
        where,
        holder,
        torch.optim.AdamW(holder.parameters(), lr=cfg.lr),
        steps=cfg.steps_of(method),
        batch=batch,
        loss=loss,
        generators={"data": data},
        checkpoint_every=cfg.checkpoint_every,
        log_every=max(1, cfg.steps // 20),
        task=f"{method} seed {s}",
        progress=progress,
        clip_grad_norm=1.0,
    )
    state = trainer.run()
    holder.eval()
    scores = {}
    for i, (key, pairs) in enumerate(tests.items()):
        path = evals[key]
        sc = runner.once(path, functools.partial(score, net, pairs, pad, cfg.eval_batch), SCORES)
        scores[key] = _whole(path, sc, pairs)
        emit(progress, f"evaluate {method} seed {s}", f"{key[0]} n={key[1]}", i + 1, len(tests))
    curve = [r for r in trainer.metrics.read() if r.get("loss") is not None]
    params = dict(holder.named_parameters())
    training = {
        "seconds": state.get("seconds"),
        "steps_per_s": state.get("steps_per_s"),
        "first_loss": curve[0]["loss"][0] if curve else None,
        "last_loss": curve[-1]["loss"][0] if curve else None,
        "adapter_parameters": sum(p.numel() for n, p in params.items() if adapters.is_adapter(n)),
        "method_parameters": sum(
            p.numel() for n, p in params.items() if not adapters.is_adapter(n)
        ),
    }
    write_json(summary, training)
    return {"training": training, "scores": scores}


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------


def plan(cfg: Config, profile: str) -> tuple[str, str, bool]:
    """The cost key, the work as a long profile announces it, and whether options changed the
    profile's work (those that leave it alone, checkpoints and threads, do not)."""
    plain = make_config(profile, checkpoint_every=cfg.checkpoint_every, threads=cfg.threads)
    steps = f"{cfg.steps} steps" + (
        f" ({cfg.adaptive_steps} for adaptive)" if cfg.adaptive_steps else ""
    )
    jobs = f"{len(METHODS) * cfg.seeds} fine-tunings of {steps}"
    return "reproduce clrs-llm", jobs, cfg != plain


def default_folder(cfg: Config, profile: str) -> str:
    return f"runs/clrs-llm-{profile}"


def run_experiment(
    folder: str | Path, cfg: Config, progress: Progress | None = None, pool: str | None = None
) -> Result:
    """`run` as the protocol calls it (``pool``: one process; the fine-tunings run in turn)."""
    path, metrics = run(folder, cfg, progress)
    return Result(
        path, (("clrs_llm.md", None),), ("report.md", "metrics.json", "fig8.png"), metrics
    )
