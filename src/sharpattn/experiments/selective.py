"""`sharpattn reproduce selective`: the experiments of Zhang et al. (NeurIPS 2024), one per module.

1. `selective_graph`: the graph next-token task (Sec. 4.1, Fig. 3, Table 1, App. A).
2. `selective_denoise`: denoising (Sec. 4.3, Table 2).
3. `selective_lm`: a character language model (ours, in the shape of Tables 5-6 and Fig. 2).

The first two train ensembles of one-head models (`selective_common`). This module is the
command: its configuration and profiles, the paper-scale parameter overhead (Sec. 3), the run and
its report.

Everything runs on `runner`: RUN/config.json (a folder of another configuration is
refused), one resumable Trainer run per ensemble or model (RUN/graph/<readout>/, RUN/denoise/,
RUN/lm/<variant>/seed<s>/, each with metrics.jsonl, checkpoints and an evaluation.json), seeds
from ``runner.seed_int`` keyed by (seed, task, purpose), so re-running after ``kill -9`` ends with
the numbers of an uninterrupted run.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..attention import SelectiveConfig
from ..attention.selective import selective_parameter_count
from ..lab import report
from ..lab.protocol import Result, option
from ..lab.runner import Clock, Progress, RunFolder, profile_settings, threads, write_metrics
from ..lab.runs import write_atomic
from .selective_common import PAPER_FIG2, fig2_markdown
from .selective_denoise import PAPER as PAPER_DENOISE
from .selective_denoise import (
    DenoiseConfig,
    denoise_markdown,
    denoise_report,
    denoise_train,
    plot_denoise,
    summarize_denoise,
)
from .selective_graph import PAPER as PAPER_GRAPH
from .selective_graph import (
    GraphConfig,
    graph_markdown,
    graph_report,
    graph_train,
    graph_transition,
    plot_graph,
    summarize_graph,
)
from .selective_lm import (
    PAPER_LM,
    LMConfig,
    char_corpus,
    lm_markdown,
    lm_report,
    lm_train,
    lm_variant,
    load_text,
    plot_lm,
    summarize_lm,
)

# The paper's numbers, printed beside ours (and kept in metrics.json).
PAPER = {"graph": PAPER_GRAPH, "denoise": PAPER_DENOISE, "fig2": PAPER_FIG2}
TASKS = ("graph", "denoise", "lm")


# ---------------------------------------------------------------- parameter overhead


def _gpt_parameters(vocab, d, layers, context=None, tied=True) -> int:
    """A GPT-2 / GPT-NeoX block stack: embeddings, per layer LN·2 + qkv + out + 4d MLP, final LN."""
    per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d + 4 * d * d + d)
    embed = vocab * d * (1 if tied else 2) + (context * d if context else 0)
    return embed + layers * per_layer + 2 * d


PAPER_MODELS = {  # name: (base parameter count, d, heads, layers)
    "GPT-2 small": (_gpt_parameters(50257, 768, 12, context=1024, tied=True), 768, 12, 12),
    "Pythia-160m": (_gpt_parameters(50304, 768, 12, tied=False), 768, 12, 12),
}


def paper_scale_overhead() -> list[dict]:
    """New parameters of q+v selective temperatures (token + position) at the paper's model sizes:
    base (MLP, hidden d/2), weight sharing, feature-based (one scalar feature)."""
    variants = {
        "base": SelectiveConfig("qv"),
        "weight sharing": SelectiveConfig("qv", sharing=True),
        "feature-based": SelectiveConfig("qv", token="feature"),
    }
    paper = {"base": "≈5%", "weight sharing": "<0.5%", "feature-based": "<0.01%"}
    rows = []
    for model, (base, d, heads, layers) in PAPER_MODELS.items():
        for variant, cfg in variants.items():
            added = layers * selective_parameter_count(d, heads, config=cfg)
            rows.append(
                dict(
                    model=model,
                    variant=variant,
                    base_parameters=base,
                    added=added,
                    fraction=added / base,
                    paper=paper[variant],
                )
            )
    return rows


def overhead_markdown(rows) -> str:
    header = [
        "model",
        "variant (q + v, token + position)",
        "base parameters",
        "added",
        "overhead",
        "paper",
    ]
    body = [
        [
            r["model"],
            r["variant"],
            r["base_parameters"],
            r["added"],
            f"{100 * r['fraction']:.3g}%",
            r["paper"],
        ]
        for r in rows
    ]
    return report.markdown_table(header, body, "llrrrl")


# ---------------------------------------------------------------- the command's entry point


@dataclass
class ReproduceConfig:
    graph: GraphConfig = field(default_factory=GraphConfig)
    denoise: DenoiseConfig = field(default_factory=DenoiseConfig)
    lm: LMConfig = field(default_factory=LMConfig)
    tasks: tuple[str, ...] = TASKS
    seed: int = 0
    quick: bool = False
    threads: int | None = 1  # tiny models: a second thread only adds overhead on a shared CPU
    checkpoint_every: int = 500


# What a run folder keeps fixed: everything that changes a trained model or an evaluation.json.
# Tasks, threads and checkpoints may change between invocations; LM variants and seeds each have
# their own folder, so a run can gain some.
_FREE = {"tasks", "quick", "threads", "checkpoint_every", "lm.variants", "lm.seeds"}


def _identity(config: ReproduceConfig) -> list[str]:
    keys = [
        f"{part}.{f.name}"
        for part in ("graph", "denoise", "lm")
        for f in fields(getattr(config, part))
    ] + [f.name for f in fields(config)]
    return [k for k in keys if k not in _FREE and k not in ("graph", "denoise", "lm")]


# The --quick LM: the same model and context, few steps, one seed and the q/v/qv "both" rows
# (tiny Shakespeare at 0.27 s per batch-8 step on one busy core: the whole quick profile must stay
# under 5 minutes on 2 cores).
QUICK_LM_VARIANTS = ("vanilla", "q · both", "v · both", "qv · both")


#: the profiles, as ReproduceConfig's settings: --paper is its defaults (the paper's); --quick
#: has fewer steps, seeds and σ's and a larger learning rate (stated)
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "graph": GraphConfig(steps=3000, seeds=3, lr=1e-3, readouts=("classifier",)),
        "denoise": DenoiseConfig(
            steps=1500, seeds=3, lr=1e-3, sigmas=(0.1, 0.3), eval_samples=8000
        ),
        "lm": LMConfig(
            steps=100, batch=8, warmup=10, seeds=1, eval_tokens=8192, variants=QUICK_LM_VARIANTS
        ),
        "quick": True,
    },
    "paper": {},
}


def quick_config(seed: int = 0) -> ReproduceConfig:
    """The --quick profile's configuration."""
    return ReproduceConfig(**profile_settings(PROFILES, "quick", {"seed": seed}))


def make_config(
    profile: str = "paper",
    *,
    seed: int = 0,
    seeds: int | None = None,
    steps: int | None = None,
    sigmas=None,
    tasks: str = ",".join(TASKS),
    text: str | None = None,
    lm_steps: int | None = None,
    lm_variants: str | None = None,
    threads: int | None = 1,
    checkpoint_every: int = 500,
) -> ReproduceConfig:
    """The configuration of a profile (a key of PROFILES) with the command's overrides: seeds
    and steps apply to every part (``lm_steps`` overrides the LM's), ``sigmas[0]`` becomes the
    main σ, ``lm_variants`` and ``tasks`` are comma-separated."""
    config = ReproduceConfig(**profile_settings(PROFILES, profile, {"seed": seed}))
    g, d, lm = config.graph, config.denoise, config.lm
    if seeds is not None:
        g, d, lm = (replace(c, seeds=seeds) for c in (g, d, lm))
    if steps is not None:
        g, d = replace(g, steps=steps), replace(d, steps=steps)
    if sigmas is not None:
        d = replace(d, sigmas=tuple(sigmas), main_sigma=sigmas[0])
    lm_steps = steps if lm_steps is None else lm_steps
    if lm_steps is not None:
        lm = replace(lm, steps=lm_steps, warmup=min(lm.warmup, lm_steps))
    if lm_variants is not None:
        names = [v for v in lm_variants.split(",") if v.strip()]
        lm = replace(lm, variants=tuple(dict.fromkeys(map(lm_variant, names))))
    if text is not None:
        lm = replace(lm, text=text)
    parts = tuple(dict.fromkeys(t.strip() for t in tasks.split(",") if t.strip()))
    return replace(
        config,
        graph=g,
        denoise=d,
        lm=lm,
        tasks=parts,
        threads=threads,
        checkpoint_every=checkpoint_every,
    )


@dataclass
class Options:
    """The command's options (`protocol`): ``make_config`` applies them to a profile's
    nested configuration (seeds and steps to every part)."""

    seed: int = option(0, "First seed.", kind="seed")
    seeds: int | None = option(
        None,
        "Seeds per setting (overrides the profile).",
        kind="count",
        maximum="seeds",
        show_default=False,
    )
    steps: int | None = option(
        None,
        "Adam steps per task (and per LM run unless --lm-steps is given).",
        kind="count",
        maximum="steps",
        show_default=False,
    )
    sigmas: tuple[float, ...] | None = option(
        None,
        "Denoising noise levels σ, e.g. 0.1,0.3.",
        kind="floats",
        maximum="noise",
        show_default=False,
    )
    tasks: str = option(
        ",".join(TASKS), "Which parts to run: graph, denoise, lm (comma-separated)."
    )
    text: str | None = option(
        None,
        "Text for the language model (default: the first 100 KB of "
        "tiny Shakespeare, shipped with the package; the documented "
        "--paper numbers used the whole 1.1 MB corpus: pass it here).",
        kind="file",
        show_default=False,
    )
    lm_steps: int | None = option(
        None, "LM training steps.", kind="count", maximum="steps", show_default=False
    )
    lm_variants: str | None = option(
        None,
        "LM variants, e.g. vanilla,q:both,qv:token (default: "
        "all twelve, k:both and kqv:both included; --quick: "
        "four).",
        kind="text",
        show_default=False,
    )
    checkpoint_every: int = option(500, "", kind="checkpoint")
    threads: int | None = option(None, "", kind="threads")


#: the options that only one part uses, by part
_PART_OPTIONS = {"lm": ("text", "lm_steps", "lm_variants"), "denoise": ("sigmas",)}


def check(given: dict[str, Any]) -> None:
    """An option for a part that ``--tasks`` leaves out (``--text`` without lm): one sentence,
    rather than an option silently unused."""
    tasks = given.get("tasks")
    chosen = set(TASKS) if tasks is None else {t.strip() for t in tasks.split(",")}
    for part, names in _PART_OPTIONS.items():
        unused = [name for name in names if name in given and part not in chosen]
        if unused:
            flag = "--" + unused[0].replace("_", "-")
            raise ValueError(f"{flag} applies to the {part} task, which --tasks leaves out.")


def trainings(config: ReproduceConfig) -> int:
    """How many trainings ``config`` runs: one ensemble per graph readout, one for denoising,
    one run per LM variant and seed (of the tasks it names)."""
    per_task = {
        "graph": len(config.graph.readouts),
        "denoise": 1,
        "lm": len(config.lm.variants) * config.lm.seeds,
    }
    return sum(per_task.get(t, 0) for t in config.tasks)


TABLE_TITLES = {  # RUN/<name>.md: what the command prints, in this order
    "graph": "Graph next-token task (Sec. 4.1, Table 1)",
    "denoise": "Denoising (Sec. 4.3, Table 2)",
    "lm": "Character LM on tiny Shakespeare (ours, not the paper's numbers)",
    "overhead": "Parameter overhead (Sec. 3)",
}


def run(
    out: str | Path,
    config: ReproduceConfig,
    progress: Progress | None = None,
    stop_at: int | None = None,
) -> tuple[Path, dict | None]:
    """Train (resuming what exists) and evaluate everything; write the tables, metrics.json,
    plots and report.md into the run folder ``out``.

    ``progress`` receives the runner's events. ``stop_at`` stops every training at that step as
    a crash would (tests): the result is then None and re-running resumes.
    """
    bad = sorted(set(config.tasks) - set(TASKS))
    if bad or not config.tasks:
        raise ValueError(
            f"tasks must be some of {', '.join(TASKS)}, got {', '.join(bad) or 'none'}."
        )
    if "lm" in config.tasks and not config.lm.variants:
        raise ValueError("lm variants names no variant; name at least one, or leave out lm.")
    text = load_text(config.lm.text) if "lm" in config.tasks else None  # fail before training
    folder = RunFolder(out, "reproduce selective", asdict(config), identity=_identity(config))
    with threads(config.threads):
        return folder.path, _run(folder.path, config, progress, text, stop_at)


def _slug(variant: str) -> str:
    """A folder name for an LM variant: "qv · both" -> "qv-both"."""
    return re.sub(r"[^a-z]+", "-", variant).strip("-")


def _run(run_dir: Path, config: ReproduceConfig, progress, text, stop_at) -> dict | None:
    gc, dc, lc, tasks = config.graph, config.denoise, config.lm, config.tasks
    every = dict(progress=progress, stop_at=stop_at, checkpoint_every=config.checkpoint_every)
    clock = Clock()
    result = dict(tasks=list(tasks), overhead=paper_scale_overhead(), paper=PAPER)
    tables = {"overhead": overhead_markdown(result["overhead"])}

    if "graph" in tasks:
        graph_seeds = [config.seed + i for i in range(gc.seeds)]
        graph_runs, graph_rows = [], []
        p_star = graph_transition(gc.n)
        for readout in gc.readouts:
            runs = graph_train(run_dir / "graph" / readout, gc, graph_seeds, readout, **every)
            if runs is None:
                return None
            rows = [dict(r, readout=readout) for r in summarize_graph(runs, gc.variants)]
            example = {r["variant"]: r["p_hat"] for r in runs if r["seed"] == graph_seeds[0]}
            plot_graph(rows, p_star.tolist(), example, run_dir / f"graph_{readout}.png")
            graph_runs += runs
            graph_rows += rows
        result.update(graph=graph_rows, graph_runs=graph_runs)
        tables["graph"] = graph_markdown(graph_rows)
        result["graph_seconds"] = clock.wall

    if "denoise" in tasks:
        section = Clock()
        denoise_seeds = [config.seed + i for i in range(dc.seeds)]
        denoise_runs = denoise_train(run_dir / "denoise", dc, denoise_seeds, **every)
        if denoise_runs is None:
            return None
        denoise_rows = summarize_denoise(denoise_runs)
        plot_denoise(denoise_rows, run_dir / "denoise.png")
        result.update(denoise=denoise_rows, denoise_runs=denoise_runs)
        tables["denoise"] = denoise_markdown(denoise_rows, dc.main_sigma)
        result["denoise_seconds"] = section.wall

    if "lm" in tasks:
        section = Clock()
        train, val, vocab = char_corpus(text)
        lm_runs = []
        for seed in range(config.seed, config.seed + lc.seeds):
            for variant in lc.variants:
                folder = run_dir / "lm" / _slug(variant) / f"seed{seed}"
                r = lm_train(folder, lc, train, val, len(vocab), variant, seed, **every)
                if r is None:
                    return None
                lm_runs.append(r)
        lm_rows = summarize_lm(lm_runs, lc.variants, lc.eval_contexts)
        plot_lm(lm_rows, list(lc.eval_contexts), run_dir / "lm.png")
        result.update(
            lm=lm_rows,
            lm_runs=lm_runs,
            lm_vocab=len(vocab),
            paper_lm=PAPER_LM,
            lm_train_chars=len(train),
            lm_val_chars=len(val),
        )
        tables["lm"] = lm_markdown(lm_rows, lc.eval_contexts)
        if all("spikiness" in r for r in lm_rows):
            tables["lm"] += "\n" + fig2_markdown(lm_rows, "lm")
        result["lm_seconds"] = section.wall

    for name, md in tables.items():
        write_atomic(run_dir / f"{name}.md", md)
    result["seconds"] = clock.wall
    write_metrics(run_dir, result)
    write_report(run_dir, result, config)
    return result


def write_report(run_dir: Path, result: dict, config: ReproduceConfig) -> Path:
    """RUN/report.md: each part's settings, table, caveats and figure."""
    gc, dc, lc = config.graph, config.denoise, config.lm
    parts = [
        f"""Profile: {"quick" if config.quick else "full"}; tasks {", ".join(result["tasks"])};
{result["seconds"]:.0f} s. These are our numbers from our runs; the paper's are printed beside
them.
"""
    ]
    if "graph" in result:
        parts.append(graph_report(result, gc))
    if "denoise" in result:
        parts.append(denoise_report(result, dc))
    if "lm" in result:
        parts.append(lm_report(result, lc))
    parts.append(f"""## Parameter overhead (Sec. 3, App. B.2)

Temperatures on q and v with token and position terms, at the paper's model shapes (MLP hidden
width d/2, our choice: the paper does not give it).

{overhead_markdown(result["overhead"])}""")
    title = "Selective attention: reproductions (Zhang et al., NeurIPS 2024)"
    return report.write_report(run_dir, title, parts)


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------


def plan(config: ReproduceConfig, profile: str) -> tuple[str, str, bool]:
    """The cost key and the work, as a long profile announces it."""
    return "reproduce selective", f"{trainings(config)} trainings", False


def default_folder(config: ReproduceConfig, profile: str) -> str:
    return f"runs/selective-{profile}"


def run_experiment(
    folder: str | Path,
    config: ReproduceConfig,
    progress: Progress | None = None,
    pool: str | None = None,
) -> Result:
    """`run` as the protocol calls it: every part's table that ran, then the overhead."""
    path, result = run(folder, config, progress)
    tables = tuple(
        (f"{name}.md", title)
        for name, title in TABLE_TITLES.items()
        if (path / f"{name}.md").is_file() and (name in result or name == "overhead")
    )
    closing = (
        f"{result['seconds']:.0f} s. Our numbers, the paper's beside them; see "
        f"{path}/report.md for what each column means and why some of the paper's "
        "numbers cannot be compared."
    )
    return Result(path, tables, ("report.md",), result, closing)
