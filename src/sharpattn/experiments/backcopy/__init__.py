"""Bigram-Backcopy: train tiny transformers, measure sinks / drains / peaks, check the findings.

Guo et al., *Active-Dormant Attention Heads*, Sections 2-3 and Appendices B-C. One training run
is one `Trainer` run in its own folder (config.json, metrics.jsonl measured at
log-spaced steps, checkpoints, resume); `reproduce` trains the runs of the report, checks
the findings and writes report.md with tables and PNGs.

Measures (small functions in `measures`, on the model's captured internals; BOS is position 0):

* excess risk per kind of query: the exact expected cross-entropy under the true next-token
  distribution minus the Bayes risk, i.e. the mean KL(true ‖ model), split into *bigram*
  (non-trigger query) and *backcopy* (trigger query);
* Δlogit = mean over non-trigger queries n of s(n, BOS) − mean_{1≤i≤n} s(n, i), s the
  pre-normalizer score q·k/√d_head (paper Fig. 4 caption);
* attention weight on BOS (non-trigger and trigger queries) and on the previous position
  (trigger queries);
* ‖Val_BOS‖ vs mean ‖Val_other‖ and the value drain ‖Val_BOS‖ / mean ‖Val_other‖
  (``diagnostics.metrics.value_drain``), Val_j = ‖O_h·V_h·LN(h)_j‖ per head as
  ``diagnostics.capture`` records it (what token j adds to the residual when attended);
* sink mass of BOS, Ā_BOS = mean weight on BOS over every query (``diagnostics.metrics.sink_mass``);
* ‖Res_BOS‖ − mean ‖Res_other‖ at each layer's output (App. B.1), and the residual peak
  ‖Res_BOS‖ / mean ‖Res_other‖ (``diagnostics.metrics.residual_peak``).

The internals come from `sharpattn.diagnostics.capture`; only the task-specific measures
(risks, Δlogit over non-trigger queries, weights by kind of query) are defined here.

The modules: `config` (a run's settings, the report's runs and profiles), `measures`,
`training`, `findings` (the paper's seven, checked), `figures`; this one opens the run folder,
trains the runs, checks the findings and writes report.md, and re-exports those modules' public
names. Beside them: `theory` (the simplified model's gradient flow and Prop. B.0),
`simplified_model` and `simplified` (App. C.3's model trained by Adam, its own study) and
`studies` (variants of the runs over seeds, `sharpattn reproduce backcopy-study`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...lab import memory, report, runner
from ...lab.protocol import Result, option
from ...lab.runner import Clock, Progress, RunFolder, emit, write_metrics
from ...tasks.bigram_backcopy import BigramBackcopy
from .config import (
    CONVERGED,
    DEFAULT_LR,
    OPTIMIZERS,
    PROFILES,
    RUNS,
    STREAM_BETA0,
    STREAM_DATA,
    STREAM_EVAL,
    STREAM_INIT,
    RunConfig,
    Training,
    log_steps,
    profile_config,
)
from .figures import (
    token_label,
    write_figures,
)
from .findings import (
    Finding,
    bos_value_rank,
    converged_step,
    finding_1,
    finding_2,
    finding_3,
    finding_4,
    finding_5,
    finding_6,
    finding_7,
    findings_markdown,
    series,
    sink_logit_concentration,
)
from .measures import (
    DELIMITERS,
    internals,
    interventions,
    key_class_weights,
    measure,
    measure_no_bos,
    query_mask,
)
from .training import (
    Run,
    build_model,
    eval_tokens,
    initialise,
    make_optimizer,
    next_token_loss,
    run_trainer,
    task_trainer,
    train,
    train_job,
    train_runs,
    trainer,
)

Tensor = torch.Tensor

__all__ = [
    "Invocation",
    "Options",
    "configure",
    "check_memory",
    "default_folder",
    "plan",
    "run_experiment",
    "CONVERGED",
    "DEFAULT_LR",
    "DELIMITERS",
    "OPTIMIZERS",
    "PROFILES",
    "RUNS",
    "STREAM_BETA0",
    "STREAM_DATA",
    "STREAM_EVAL",
    "STREAM_INIT",
    "Finding",
    "Run",
    "RunConfig",
    "Training",
    "bos_value_rank",
    "build_model",
    "converged_step",
    "eval_tokens",
    "finding_1",
    "finding_2",
    "finding_3",
    "finding_4",
    "finding_5",
    "finding_6",
    "finding_7",
    "findings_markdown",
    "initialise",
    "internals",
    "interventions",
    "key_class_weights",
    "log_steps",
    "make_optimizer",
    "measure",
    "measure_no_bos",
    "next_token_loss",
    "open_folder",
    "profile_config",
    "query_mask",
    "reproduce",
    "run_trainer",
    "series",
    "sink_logit_concentration",
    "task_trainer",
    "token_label",
    "train",
    "train_job",
    "train_runs",
    "trainer",
    "write_figures",
    "write_report",
]


def open_folder(
    out: str | Path, profile: str, seed: int, threads: int | None = None
) -> tuple[RunFolder, dict[str, RunConfig]]:
    """The reproduction's run folder and its runs' configurations; a folder holding another
    profile or seed (or another experiment) is refused in one sentence."""
    cfgs = {name: profile_config(profile, name, seed) for name in RUNS}
    record = {"profile": profile, "seed": seed, "threads": threads}
    record["runs"] = {name: cfg.to_dict() for name, cfg in cfgs.items()}
    return RunFolder(out, "backcopy", record, identity=("profile", "seed")), cfgs


def reproduce(
    out: str | Path,
    *,
    profile: str = "paper",
    seed: int = 0,
    threads: int | None = 1,
    progress: Progress | None = None,
    task: BigramBackcopy | None = None,
    workers: int = 1,
    ray: str | None = None,
) -> tuple[Path, list[Finding]]:
    """Train the report's runs (resuming any that exist in ``out``), check the five findings
    and write ``out/report.md`` with its PNGs. ``threads``: torch CPU threads per run (1 is
    fastest on a busy 2-core machine; ``None``: every core). The runs are independent:
    ``workers`` > 1 trains them in a local process pool, ``ray`` as Ray tasks
    (`sweep.run_jobs`), longest first; then this process loads them."""
    task = task or BigramBackcopy.tiny_shakespeare()
    check_memory(Invocation(profile, seed, threads, workers), ray, task)
    folder, cfgs = open_folder(out, profile, seed, threads)
    clock = Clock()
    train_runs(folder, cfgs, task, threads, workers, ray, progress)
    with runner.threads(threads) as n_threads:
        runs = {
            name: train(folder / "runs" / name, cfg, task, progress=progress, label=name)
            for name, cfg in cfgs.items()
        }
        soft, relu = runs["1L-softmax-adam"], runs["1L-relu-adam"]
        ev = eval_tokens(soft.cfg, task)
        emit(progress, "findings", "interventions", 0, 3)
        inter = interventions(soft.model, task, ev)
        emit(progress, "findings", "Theorem 2", 1, 3)
        with Clock() as ode:
            f5, theory = finding_5(task)
        f7, b0 = finding_7()
        findings = [
            finding_1(soft, task, ev, inter),
            finding_2(soft),
            finding_3(relu, soft),
            finding_4(*(runs[n] for n in ("3L-softmax-adam", "3L-softmax-sgd", "3L-relu-adam"))),
            f5,
            finding_6(soft, task, ev),
            f7,
        ]
        emit(progress, "findings", "figures", 2, 3)
        write_figures(folder.path, runs, inter, theory, task, ev[0])
        with report.figure(folder / "prop_b0.png", figsize=(6, 3.5)) as (_, ax):
            for name, m in b0.items():
                ax.plot(m, label=f"{name} (lr 0.3)")
            ax.set_xlabel("step t")
            ax.set_ylabel("m")
            ax.set_title("Prop. B.0 / Fig. 15: dm = log t / (√t m³)", fontsize=9)
            ax.legend(fontsize=7)
        emit(progress, "findings", "done", 3, 3)
    results = {
        "profile": profile,
        "threads": n_threads,
        "wall_seconds": clock.wall,
        "ode_seconds": ode.wall,
        "runs": {
            n: {
                "train_seconds": r.seconds,
                "steps": r.steps_done,
                "steps_per_second": r.steps_done / r.seconds if r.seconds else None,
                "final": r.metrics[-1],
            }
            for n, r in runs.items()
        },
        "interventions": inter,
        "findings": [asdict(f) for f in findings],
    }
    write_metrics(folder, results, "results.json")
    write_report(folder.path, runs, inter, findings, results, task)
    return folder.path, findings


def write_report(out: Path, runs: dict[str, Run], inter, findings, results, task) -> Path:
    """report.md: settings, the runs, each finding with its verdict, numbers, table and PNGs."""
    c, profile = runs["1L-softmax-adam"].cfg, results["profile"]
    intro = (
        "Reproduction of Guo et al., *Active-Dormant Attention Heads* (Sections 2-3, App. B-C) "
        f"with `sharpattn reproduce backcopy --{profile}`.\n\n"
        f"Profile **{profile}**: d = {c.d_model}, one head per layer, sequences of {c.seq_len} "
        f"tokens (BOS first), batch {c.batch} fresh sequences per step, steps and learning "
        f"rates per run in the table, AdamW betas {c.betas} weight decay {c.weight_decay}, plain "
        f"SGD lr {DEFAULT_LR['sgd']:g}; measurements on {c.eval_batch} fixed sequences at "
        f"{c.n_measure} log-spaced steps. Task: V = {task.V} characters of tiny Shakespeare + BOS, "
        f"triggers {', '.join(repr(task.chars[i]) for i in task.triggers)}. Torch threads: "
        f"{results['threads']}. Training time recorded in the runs: "
        f"{sum(r.seconds for r in runs.values()):.0f} s in all; this invocation took "
        f"{results['wall_seconds']:.0f} s of wall time (runs already trained are loaded, not "
        f"retrained; gradient-flow integration {results['ode_seconds']:.1f} s)."
    )
    header = ["run", "layers", "attention", "optimizer", "lr", "steps", "train s", "steps/s"]
    rows = [
        [n, r.cfg.layers, r.cfg.method, r.cfg.optimizer, r.cfg.learning_rate, r.steps_done]
        + [r.seconds, r.steps_done / r.seconds if r.seconds else None]
        + [r.metrics[-1]["bigram_excess"], r.metrics[-1]["backcopy_excess"]]
        for n, r in runs.items()
    ]
    runs_table = report.markdown_table(
        header + ["bigram excess", "backcopy excess"], rows, "l" * 4 + "r" * 6
    )
    risks = ("bigram_risk", "bigram_excess", "backcopy_risk", "backcopy_excess")
    dynamics = {
        "bigram_excess": "bigram exc.",
        "backcopy_excess": "backcopy exc.",
        "layers.0.attn.bos_weight": "BOS weight",
        "layers.0.attn.delta_logit": "Δlogit",
        "layers.0.attn.val_bos": "‖Val_BOS‖",
        "layers.0.attn.val_other": "mean ‖Val_other‖",
    }
    three = [runs[n].metrics for n in ("3L-softmax-adam", "3L-softmax-sgd", "3L-relu-adam")]
    res_keys = ("layers.0.res_bos", "layers.0.res_peak")
    extras = {
        1: [
            report.markdown_table(
                ["zeroed", *(k.replace("_", " ") for k in risks)],
                [[r["zeroed"], *(r[k] for k in risks)] for r in inter],
            ),
            report.image("attention.png", "Fig. 2b / 7a: attention maps of one sequence."),
            report.image("value_norms.png", "Fig. 2c: value-state norms per position."),
            report.image("interventions.png", "Fig. 4a: excess risks with a sublayer zeroed."),
        ],
        2: [
            report.markdown_table(
                ["step", *dynamics.values()],
                [[m["step"], *(m[k] for k in dynamics)] for m in runs["1L-softmax-adam"].metrics],
            ),
            report.image("dynamics.png", "Fig. 4b / 7a: dynamics of the one-layer runs, rescaled."),
        ],
        4: [
            report.markdown_table(
                ["step"]
                + [f"{n} {q}" for n in ("Adam", "SGD", "ReLU Adam") for q in ("‖Res_BOS‖", "peak")],
                [
                    [ms[0]["step"], *(m[k] for m in ms for k in res_keys)]
                    for ms in zip(*three, strict=False)
                ],
            ),
            report.image("residual_peak.png", "Fig. 7c: BOS residual state at layer 0's output."),
        ],
        5: [report.image("theorem2.png", "Theorem 2: the simplified model's gradient flow.")],
        7: [report.image("prop_b0.png", "Prop. B.0 / Fig. 15: Adam vs SGD on the scalar m.")],
    }
    sections = [
        intro,
        "## Runs\n\n" + runs_table + "\nExcess risk = expected cross-entropy under the true "
        "next-token distribution minus the exact Bayes risk (nats), over non-trigger (bigram) "
        "and trigger (backcopy) queries.",
        "## Findings",
    ]
    for f in findings:
        sections += [
            f"### {f.number}. {f.title}: **{f.verdict}**\n\n{f.text}",
            *extras.get(f.number, []),
        ]
    notes = [
        "Δlogit uses the scores the normalizer sees, q·k/√d_head; 'BOS weight' is averaged over "
        "non-trigger queries; for ReLU attention, whose rows do not sum to one, the finding uses "
        "BOS's share of the row total.",
        "The medium profile keeps the paper's optimiser settings and step count (AdamW lr "
        "3e-4, SGD 0.03, 10,000 steps) with d = 128, 128 tokens and batch 32."
        if profile == "medium"
        else "The quick profile is smaller than the paper's and takes larger AdamW steps (lr per run "
        "in the table: 1e-3 for one layer, 3e-3 for three layers, whose residual peak takes the "
        "paper ~10^4 steps) so that the mechanisms appear within 10^3 steps on a CPU; the paper "
        "profile uses the paper's settings (App. C.1, AdamW lr 3e-4)."
        if profile == "quick"
        else "Paper profile: the paper's settings (App. C.1).",
    ]
    sections.append("## Notes\n\n" + "".join(f"- {n}\n" for n in notes))
    title = "Bigram-Backcopy: attention sinks, value drains and residual peaks"
    return report.write_report(out, title, sections)


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------


@dataclass
class Options:
    """The command's options (`protocol`); the profiles fix everything else (`PROFILES`)."""

    seed: int = option(
        0, "Seed of every run (initialisation, batches, evaluation sequences).", kind="seed"
    )
    threads: int | None = option(None, "", kind="threads")


@dataclass(frozen=True)
class Invocation:
    """What `reproduce` is called with."""

    profile: str
    seed: int = 0
    threads: int | None = 1
    workers: int = 1


def configure(
    profile: str = "quick", *, seed: int = 0, workers: int | None = None, threads: int | None = 1
) -> Invocation:
    return Invocation(profile, seed, threads, workers or 1)


def check_memory(
    inv: Invocation, pool: str | None = None, task: BigramBackcopy | None = None
) -> None:
    """Refuse in one sentence, before any model is built, a reproduction whose largest run
    (`memory.estimate`: trained on batches of ``batch`` sequences of ``seq_len`` tokens,
    evaluated on ``eval_batch`` of them) needs more memory than this machine has available, once
    on each worker process that trains at the same time (Ray's jobs run elsewhere: one is
    counted)."""
    task = task or BigramBackcopy.tiny_shakespeare()
    jobs = []
    for name in RUNS:
        cfg = profile_config(inv.profile, name, inv.seed)
        tc = cfg.model_config(task)
        shape = memory.Shape(
            tc.d_model, tc.n_heads, len(tc.layers), tc.vocab_size, tc.n_out, positions=tc.max_len
        )
        job = memory.estimate(
            shape, train=(cfg.batch, cfg.seq_len), evaluate=(cfg.eval_batch, cfg.seq_len)
        )
        jobs.append((job.peak, job, cfg, len(tc.layers)))
    _, job, cfg, layers = max(jobs, key=lambda j: j[0])
    at_once = 1 if pool is not None else min(inv.workers, len(jobs))
    what = (
        f"training a decoder of {layers} layers of width {cfg.d_model} on batches of "
        f"{cfg.batch} sequences of {cfg.seq_len} tokens"
    )
    lower = {"paper": "--medium or --quick", "medium": "--quick"}.get(inv.profile)
    smaller = f"settings ({lower})" if lower else "settings"
    if at_once > 1:
        what += f" in each of {at_once} worker processes at once"
        smaller += " or --workers"
    memory.check(job, at_once, what, smaller)


def plan(inv: Invocation, profile: str) -> tuple[str, str, bool]:
    return "reproduce backcopy", f"{len(RUNS)} training runs", False


def default_folder(inv: Invocation, profile: str) -> str:
    return f"runs/backcopy-{profile}"


def run_experiment(
    folder: str | Path, inv: Invocation, progress: Progress | None = None, pool: str | None = None
) -> Result:
    run, findings = reproduce(
        folder,
        profile=inv.profile,
        seed=inv.seed,
        threads=inv.threads,
        progress=progress,
        workers=inv.workers,
        ray=pool,
    )
    printed = ((findings_markdown(findings), "Bigram-Backcopy findings (Guo et al.)"),)
    return Result(Path(run), (), ("report.md and its PNGs",), {}, printed=printed)
