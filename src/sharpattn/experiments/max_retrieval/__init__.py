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

The modules: `config` (Config, profiles, seeds' groups and streams, the run folder),
`training`, `evaluation`, `tables` (Table 1 and its verdicts), `figures`, `fit` (App. F) and
`page` (report.md); this one runs them in order and re-exports their public names.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...lab.protocol import Result
from ...lab.runner import Clock, Progress, write_metrics
from ...lab.runs import write_json
from .config import (
    PAPER_SIZES,
    PAPER_TABLE1,
    PROFILES,
    REGULARISERS,
    TRAINING_SETTINGS,
    Config,
    build_model,
    check_groups,
    group_dir,
    groups,
    make_config,
    member_bytes,
    open_run,
    read_config,
    seeds_together,
)
from .evaluation import (
    BLOCK,
    TARGET_SE,
    batch_bytes,
    check_sizes,
    correct_sets,
    eval_block,
    eval_methods,
    evaluate,
    test_batches,
)
from .figures import (
    FIG5_REGIONS,
    entropy_landscape,
    fig5_boundaries,
    plot_accuracy,
    plot_attention,
    plot_entropy_landscape,
    plot_logit_spread,
    region_entropies,
)
from .fit import (
    THETA_GRID,
    collect_fit_data,
    fit_chunk,
    fit_temperature,
    optimal_temperature,
    plot_fit,
)
from .page import write_report
from .tables import paper_cell, table1, table_note, table_title, verdict_table, write_table1
from .training import (
    l2_penalty,
    load_ensemble,
    load_model,
    logit_spread_bound,
    make_optimizer,
    sum_of_squares,
    train_all,
    train_group,
    train_runs,
    trainer,
    training_records,
)

__all__ = [
    "default_folder",
    "plan",
    "prepare",
    "run_experiment",
    "batch_bytes",
    "BLOCK",
    "build_model",
    "check_groups",
    "check_memory",
    "check_sizes",
    "collect_fit_data",
    "Config",
    "correct_sets",
    "entropy_landscape",
    "eval_block",
    "eval_methods",
    "evaluate",
    "fig5_boundaries",
    "FIG5_REGIONS",
    "fit_chunk",
    "fit_temperature",
    "group_dir",
    "groups",
    "l2_penalty",
    "load_ensemble",
    "load_model",
    "logit_spread_bound",
    "make_config",
    "make_optimizer",
    "member_bytes",
    "open_run",
    "optimal_temperature",
    "paper_cell",
    "PAPER_SIZES",
    "PAPER_TABLE1",
    "plot_accuracy",
    "plot_attention",
    "plot_entropy_landscape",
    "plot_fit",
    "plot_logit_spread",
    "PROFILES",
    "read_config",
    "region_entropies",
    "REGULARISERS",
    "reproduce",
    "seeds_together",
    "sum_of_squares",
    "table1",
    "table_note",
    "table_title",
    "TARGET_SE",
    "test_batches",
    "THETA_GRID",
    "train_all",
    "train_group",
    "train_runs",
    "trainer",
    "training_records",
    "TRAINING_SETTINGS",
    "verdict_table",
    "write_report",
    "write_table1",
]


def reproduce(
    out: Path, config: Config, progress: Progress | None = None, ray: str | None = None
) -> dict[str, Any]:
    """Train and evaluate every seed (resuming what exists), then write tables, figures, report."""
    check_memory(config, ray)  # before the run folder is written
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


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------


def check_memory(config: Config, pool: str | None = None) -> None:
    """The evaluation's sizes and the ensembles trained at once, refused in one sentence before
    any work where they would not fit in the memory available (`check_sizes`, `check_groups`)."""
    check_sizes(config.sizes)
    check_groups(config, pool)


def prepare(config: Config, folder: str | Path, given: dict[str, Any]) -> tuple[Config, str | None]:
    """More seeds than the profile's, without ``--group``: trained together (`seeds_together`),
    not one by one; the line says how."""
    if given.get("seeds") is None or given.get("group") is not None:
        return config, None
    picked, why = seeds_together(config, folder)
    config = replace(config, group=picked)
    return config, (
        f"sharpattn reproduce max-retrieval: {config.seeds} seeds in "
        f"{len(groups(config))} ensemble(s) of up to {picked} ({why}; --group N to "
        "choose)."
    )


def plan(config: Config, profile: str) -> tuple[str, str, bool]:
    return (
        "reproduce max-retrieval",
        f"{len(groups(config))} training jobs of {config.group} seeds",
        False,
    )


def default_folder(config: Config, profile: str) -> str:
    return f"runs/max-retrieval-{profile}"


def run_experiment(
    folder: str | Path, config: Config, progress: Progress | None = None, pool: str | None = None
) -> Result:
    """`reproduce` as the protocol calls it (``pool``: a Ray address, else local processes)."""
    result = reproduce(Path(folder), config, progress, pool)
    run, speed = result["run"], result["steps_per_s"]
    note = table_note(result["rows"], config.seeds)
    closing = (
        (f"{note}\n" if note else "")
        + (f"training {speed:.0f} steps/s per seed; " if speed else "")
        + f"wrote {run}/report.md"
    )
    return Result(run, (("table1.md", table_title(config.seeds)),), ("report.md",), result, closing)
