"""``sharpattn reproduce selective-llm``: selective temperatures fine-tuned on a frozen pretrained
decoder, Zhang et al.'s Table 3 in small.

The paper (§5.1, App. A) fine-tunes GPT-2, Pythia and Llama with Selective Self-Attention (SSA:
token- and position-aware temperatures on queries and values) — every weight trained, AdamW at
1e-6, 3.5M tokens, days on 4-8 GPUs — and reports lower perplexity than the same fine-tuning
without SSA. Here, on a 2-core CPU: SmolLM2-135M with its weights *frozen* and only the
temperatures trained ([`sharpattn.hf.apply`][sharpattn.integrations.hf.apply] ``(net, "selective", targets="qv")``, base SSA
with the MLP token term, or ``sharing=True`` for the paper's weight sharing), for ``steps`` AdamW
steps on windows of ``context`` tokens drawn from a training slice of text. Then the perplexity of
held-out windows at 1×, 2× and 4× that context, for the unpatched model and the fine-tuned one on
the same windows, with a paired t-test over windows (`stats`).

The temperatures start as an identity (τ = 1 + c₀·log n, c₀ ≈ 5e-6, token term 0), so the step-0
model is the unpatched one to float32 rounding (checked and reported). The runner's
`Trainer` trains a module holding only the temperatures, so its checkpoints are
megabytes, not the 540 MB model; re-running resumes.

The matched study (``--lora RANK``, `run_matched`) removes the confound of comparing a
trained model with an untrained one: per seed, LoRA adapters of that rank (`adapters`) on
every layer's attention projections are fine-tuned twice with the same budget (the same initial
adapters, windows and steps), once with softmax and once with the selective temperatures added
and trained with them; the report compares the two (paired over windows and over seeds) beside
the unpatched model.

Text: `llm.heldout_text` (tinyshakespeare from the checkout's ``shared/`` when present,
else Python's own docstrings); its first ``train_fraction`` trains, the rest is held out.

The modules: `config`, `training` (the text's split, the temperatures, the loss, the
evaluation) and `page` (summaries, verdicts, report.md); this one runs the study and the matched
study and re-exports their public names.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ...integrations.pretrained import quiet_transformers
from ...lab import runner
from ...lab.protocol import Result
from ...lab.runner import Clock, Progress, RunFolder, Trainer, generator, write_metrics
from .. import adapters
from ..llm import heldout_text, window_nll
from .config import (
    IDENTITY,
    MATCHED_IDENTITY,
    MATCHED_SEEDS,
    PROFILES,
    STREAM_EVAL,
    STREAM_INIT,
    STREAM_TRAIN,
    Config,
    check_memory,
    make_config,
)
from .page import (
    nll_change,
    plot_perplexity,
    reference,
    summarize,
    summarize_matched,
    write,
    write_matched,
)
from .training import (
    evaluate,
    lm_loss,
    optimizer,
    position_coefficients,
    split,
    temperatures,
    window_batches,
)

__all__ = [
    "ARMS",
    "Config",
    "IDENTITY",
    "MATCHED_IDENTITY",
    "MATCHED_SEEDS",
    "PROFILES",
    "STREAM_EVAL",
    "STREAM_INIT",
    "STREAM_TRAIN",
    "arm_params",
    "evaluate",
    "lm_loss",
    "make_config",
    "nll_change",
    "optimizer",
    "plot_perplexity",
    "position_coefficients",
    "reference",
    "run",
    "run_experiment",
    "check",
    "check_memory",
    "plan",
    "default_folder",
    "run_matched",
    "split",
    "summarize",
    "summarize_matched",
    "temperatures",
    "window_batches",
    "write",
    "write_matched",
]


@quiet_transformers()  # loading and running the model: its warnings silenced, then restored
def run(
    out: str | Path,
    cfg: Config,
    progress: Progress | None = None,
    *,
    net=None,
    ids: torch.Tensor | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Train the temperatures (or resume), evaluate both models, write the report; with
    ``cfg.lora``, the matched study (`run_matched`). ``net`` / ``ids``: a causal LM and
    its token ids (tests); by default ``cfg.model`` and its tokenizer on
    `llm.heldout_text`."""
    from ... import hf

    check_memory(cfg)  # before the model is loaded
    if cfg.lora:
        return run_matched(out, cfg, progress, net=net, ids=ids)
    clock = Clock()
    with runner.threads(cfg.threads) as n_threads:
        net, train_ids, windows, folder, base = _begin(
            out, "selective-llm", IDENTITY, cfg, net, ids, n_threads, progress
        )

        # the temperatures' initialisation draws from the global generator: seeded, so two runs
        # (and a resumed one) start from the same temperatures
        with runner.seeded(cfg.seed, STREAM_INIT):
            hf.apply(net, "selective", targets=cfg.targets, sharing=cfg.sharing, terms=cfg.terms)
        holder = temperatures(net)
        # the identity at initialisation: the patched model before training
        start = window_nll(net, windows[:1], cfg.context)[0]
        trainable = sum(p.numel() for p in holder.parameters())
        data = generator(cfg.seed, STREAM_TRAIN)
        net.eval()  # no dropout; only the temperatures have gradients
        trainer = Trainer(
            folder.sub("train"),
            holder,
            optimizer(holder, cfg),
            steps=cfg.steps,
            batch=window_batches(train_ids, cfg, data),
            loss=lm_loss(net),
            generators={"data": data},
            checkpoint_every=cfg.checkpoint_every,
            log_every=max(1, cfg.steps // 20),
            task="temperatures",
            progress=progress,
        )
        state = trainer.run()
        holder.eval()
        tuned = evaluate(net, windows, folder.sub("train", "tuned"), "selective", cfg, progress)
        metrics = summarize(cfg, base, tuned)
        metrics.update(
            {
                "step0_nll_change": start - base[str(cfg.context)][0],
                "trainable_parameters": trainable,
                "model_parameters": sum(p.numel() for p in net.parameters()) - trainable,
                "position_coefficient": position_coefficients(holder),
                "train_seconds": state.get("seconds"),
                "train_steps_per_s": state.get("steps_per_s"),
                "wall_seconds": clock.wall,
                "cpu_seconds": clock.cpu,
                "threads": n_threads,
                "training_curve": [r for r in trainer.metrics.read() if r.get("loss") is not None],
            }
        )
        write_metrics(folder, metrics)
        write(folder.path, cfg, metrics)
        return folder.path, metrics


def _begin(
    out: str | Path,
    experiment: str,
    identity: tuple[str, ...],
    cfg: Config,
    net,
    ids,
    n_threads: int,
    progress: Progress | None,
):
    """What both studies start from: the model (``cfg.model`` unless given; frozen), the
    training tokens, the held-out windows (checked against the model's context), the run folder
    (written once the inputs are known to fit: a refused run leaves no folder behind) and the
    unpatched model's window NLLs."""
    if net is None:
        from ...integrations.pretrained import load_pretrained

        net, tok = load_pretrained(cfg.model)
        ids = tok(heldout_text(), return_tensors="pt")["input_ids"][0]
    if ids is None:
        raise ValueError("pass the token ids with the model.")
    limit = getattr(net.config, "max_position_embeddings", None)
    if limit is not None and max(cfg.lengths) > int(limit):
        raise ValueError(f"length {max(cfg.lengths)} is beyond the model's context ({limit}).")
    train_ids, windows = split(ids, cfg)
    folder = RunFolder(out, experiment, {**asdict(cfg), "threads": n_threads}, identity=identity)
    for p in net.parameters():
        p.requires_grad_(False)
    base = evaluate(net, windows, folder.sub("base"), "unpatched", cfg, progress)
    return net, train_ids, windows, folder, base


#: the matched study's two fine-tunings: (name, attention method); the temperatures' options
#: come from the configuration
ARMS = (("softmax", "softmax"), ("selective", "selective"))


def arm_params(method: str, cfg: Config) -> dict[str, Any]:
    """The ``hf.apply`` options of an arm of the matched study."""
    if method != "selective":
        return {}
    return {"targets": cfg.targets, "sharing": cfg.sharing, "terms": cfg.terms}


@quiet_transformers()  # loading and running the model: its warnings silenced, then restored
def run_matched(
    out: str | Path,
    cfg: Config,
    progress: Progress | None = None,
    *,
    net=None,
    ids: torch.Tensor | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The matched study: per seed, LoRA adapters of rank ``cfg.lora`` fine-tuned on the same
    windows with softmax and with selective temperatures (trained too), from the same initial
    adapters (`adapters.prepare`); held-out perplexity of both and of the unpatched model
    at every length, paired over windows and over seeds."""
    adapters.require_peft()
    clock = Clock()
    with runner.threads(cfg.threads) as n_threads:
        net, train_ids, windows, folder, base = _begin(
            out, "selective-llm-lora", MATCHED_IDENTITY, cfg, net, ids, n_threads, progress
        )
        nll: dict[str, dict[int, dict[str, list[float]]]] = {name: {} for name, _ in ARMS}
        training, coefficients = {}, {}
        for s in range(cfg.seed, cfg.seed + cfg.seeds):
            for name, method in ARMS:
                arm = copy.deepcopy(net)  # every fine-tuning starts from the pretrained weights
                holder = adapters.prepare(arm, method, arm_params(method, cfg), cfg.lora, s)
                data = generator(s, STREAM_TRAIN)  # the same windows for both arms of a seed
                trainer = Trainer(
                    folder.sub(f"seed{s}", name),
                    holder,
                    optimizer(holder, cfg),
                    steps=cfg.steps,
                    batch=window_batches(train_ids, cfg, data),
                    loss=lm_loss(arm),
                    generators={"data": data},
                    checkpoint_every=cfg.checkpoint_every,
                    log_every=max(1, cfg.steps // 20),
                    task=f"{name} seed {s}",
                    progress=progress,
                )
                state = trainer.run()
                holder.eval()
                nll[name][s] = evaluate(
                    arm, windows, folder.sub(f"seed{s}", name), f"{name} seed {s}", cfg, progress
                )
                params = dict(holder.named_parameters())
                training[f"{name} seed {s}"] = {
                    "seconds": state.get("seconds"),
                    "steps_per_s": state.get("steps_per_s"),
                    "adapter_parameters": sum(
                        p.numel() for n, p in params.items() if adapters.is_adapter(n)
                    ),
                    "temperature_parameters": sum(
                        p.numel() for n, p in params.items() if not adapters.is_adapter(n)
                    ),
                }
                if method == "selective":
                    coefficients[s] = position_coefficients(temperatures(arm))
                del arm, holder
        metrics = summarize_matched(cfg, base, nll)
        metrics.update(
            {
                "training": training,
                "position_coefficient": coefficients,
                "model_parameters": sum(p.numel() for p in net.parameters()),
                "wall_seconds": clock.wall,
                "cpu_seconds": clock.cpu,
                "threads": n_threads,
            }
        )
        write_metrics(folder, metrics)
        write_matched(folder.path, cfg, metrics)
        return folder.path, metrics


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------


#: the learning rate that a ``--terms`` value leaves unused: the token terms' (``--lr``) without
#: them, the position parameter's without it
_UNUSED_RATE = {"position": "lr", "token": "position_lr"}


def check(given: dict[str, Any]) -> None:
    """Options that apply only to the matched study, given without ``--lora``, and a learning
    rate of a term that ``--terms`` leaves out: one sentence."""
    for name in ("seeds", "lora_lr"):
        if name in given and "lora" not in given:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} applies to the matched study: add --lora RANK.")
    unused = _UNUSED_RATE.get(given.get("terms", "both"))
    if unused in given:
        flag = "--" + unused.replace("_", "-")
        raise ValueError(f"{flag} is unused with --terms {given['terms']}: leave it out.")


def plan(cfg: Config, profile: str) -> tuple[str, str, bool]:
    """The cost key of the command as configured and its work, as a long profile announces it
    (the cost quoted is the profile's as measured)."""
    matched = cfg.lora > 0
    trainings = 2 * cfg.seeds if matched else 1
    command = "reproduce selective-llm" + (" --lora" if matched else "")
    return command, f"{trainings} training{'s' * (trainings > 1)} of {cfg.steps} steps", False


def default_folder(cfg: Config, profile: str) -> str:
    return f"runs/selective-llm-{'lora-' * (cfg.lora > 0)}{profile}"


def run_experiment(
    folder: str | Path, cfg: Config, progress: Progress | None = None, pool: str | None = None
) -> Result:
    """`run` as the protocol calls it (``pool``: one process; the study has no jobs to spread)."""
    path, metrics = run(folder, cfg, progress)
    return Result(
        path, (("report.md", None),), ("report.md", "metrics.json", "perplexity.png"), metrics
    )
