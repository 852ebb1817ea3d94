"""Controlled studies on Bigram-Backcopy: one factor changed at a time, several seeds.

Each study is a base `RunConfig` and named *variants* (the fields they
change); every variant × seed is one run of the shared runner (`backcopy.train`) in
``out/runs/<variant>-s<seed>``, so a study resumes where it stopped and a changed configuration
is a new run. `run_study` trains them and writes ``report.md`` with one row per run (the
paper's claim beside our numbers) and a PNG of the BOS residual norm at layer 0's output.

Studies:

* ``relu-peak`` (item 5): why ReLU attention grows ‖Res_BOS‖ in the quick profile although
  Fig. 7c shows it flat: learning rate (3e-3 vs the paper's 3e-4, the latter also for 10× the
  steps: the paper's schedule), weight decay, layer 0's MLP, batch size, BOS's own
  next-token loss (``loss_from=1``); softmax beside it.
* ``sgd`` (item 6): SGD learning rates and momentum until backcopy is learned.
* ``fig7b`` (item 7): attn+mlp+attn+mlp+mlp with Adam; measures with layer 0 zeroed.
* ``structures`` (item 7, Fig. 11): which stacks of attn / mlp / TF layers form a BOS peak.
* ``simplified`` (item 7, App. C.3): not a transformer study; the simplified model of Theorem 2
  trained by Adam, in `simplified` (one run per seed, its own report).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...lab import report, runner
from ...lab.protocol import Result, option
from ...lab.runner import Clock, Progress, RunFolder, emit, write_metrics
from ...lab.stats import linear_fit
from ...tasks.bigram_backcopy import BigramBackcopy
from .config import CONVERGED, RunConfig
from .measures import measure
from .training import Run, eval_tokens, train, train_runs

#: the quick profile's sizes (backcopy.PROFILES["quick"]) for a three-layer run
QUICK_3L = dict(
    layers="tf,tf,tf",
    d_model=64,
    seq_len=64,
    batch=16,
    eval_batch=32,
    n_measure=24,
    checkpoint_every=100,
    steps=1200,
    method="softmax",
    optimizer="adam",
    lr=3e-3,
)


@dataclass(frozen=True)
class Study:
    what: str  # one sentence for the report
    base: dict
    variants: dict[str, dict]  # name -> RunConfig fields changed from base
    seeds: tuple[int, ...] = (0, 1)
    seeds_of: dict[str, tuple[int, ...]] | None = None  # per-variant seeds (costly variants)


STUDIES: dict[str, Study] = {
    "relu-peak": Study(
        "Fig. 7c: does ReLU attention trained with Adam grow ‖Res_BOS‖ at layer 0's output? One "
        "factor at a time from the quick profile's three-layer ReLU run.",
        QUICK_3L,
        {
            "relu-lr3e-3": {"method": "relu"},
            "softmax-lr3e-3": {},
            "relu-lr3e-3-attn0": {"method": "relu", "layers": "attn,tf,tf"},
            "relu-lr3e-3-wd0": {"method": "relu", "weight_decay": 0.0},
            "relu-lr3e-4": {"method": "relu", "lr": 3e-4},
            "relu-lr3e-3-batch64": {"method": "relu", "batch": 64},
            "relu-lr3e-3-loss1": {"method": "relu", "loss_from": 1},
            "softmax-lr3e-3-loss1": {"loss_from": 1},
            "relu-lr3e-4-10k": {"method": "relu", "lr": 3e-4, "steps": 10_000},
            "softmax-lr3e-4-10k": {"lr": 3e-4, "steps": 10_000},
            "softmax-lr3e-4-10k-loss1": {"lr": 3e-4, "steps": 10_000, "loss_from": 1},
        },
        seeds=(0,),
        seeds_of={
            "relu-lr3e-3": (0, 1),
            "softmax-lr3e-3": (0, 1),
            "relu-lr3e-3-loss1": (0, 1),
            "relu-lr3e-4-10k": (0, 1),
            "softmax-lr3e-4-10k": (0, 1),
        },
    ),
    "sgd": Study(
        "Item 6: an SGD run that learns backcopy (three layers, softmax), beside Adam. (Plain "
        "SGD at lr 1.0 diverges: the loss is NaN at step 30 with seed 0.)",
        {**QUICK_3L, "optimizer": "sgd", "lr": 0.03},
        {
            "sgd-0.03": {},
            "sgd-0.3": {"lr": 0.3},
            "sgd-0.03-m0.9": {"momentum": 0.9},
            "sgd-0.1-m0.9": {"lr": 0.1, "momentum": 0.9},
            "sgd-0.3-m0.9": {"lr": 0.3, "momentum": 0.9},
            "sgd-0.3-4k": {"lr": 0.3, "steps": 4000},
            "adam-3e-3": {"optimizer": "adam", "lr": 3e-3},
        },
        seeds=(0,),
    ),
    "fig7b": Study(
        "Fig. 7b: attn+mlp+attn+mlp+mlp trained with Adam; layer 0 (attn + mlp) zeroed.",
        {**QUICK_3L, "layers": "attn+mlp+attn+mlp+mlp"},
        {"adam-lr3e-3": {}, "adam-lr3e-4-10k": {"lr": 3e-4, "steps": 10_000}},
        seeds=(0, 1),
        seeds_of={"adam-lr3e-4-10k": (0,)},
    ),
    "no-bos": Study(
        "App. C.4: the one-layer model on the task without BOS (quick profile's 1L softmax run).",
        {**QUICK_3L, "layers": "tf", "lr": 1e-3, "steps": 1500},
        {"with-bos": {}, "no-bos": {"bos": False}},
        seeds=(0,),
    ),
    "structures": Study(
        "Fig. 11: the minimal stack that forms a BOS residual peak at layer 0's output (at the "
        "paper's AdamW 3e-4 for 10,000 steps: the quick lr 3e-3 forms no softmax peak).",
        {**QUICK_3L, "lr": 3e-4, "steps": 10_000},
        {
            "tf+tf+tf": {},
            "tf+tf+mlp": {"layers": "tf,tf,mlp"},
            "tf+tf": {"layers": "tf,tf"},
            "tf+mlp+mlp": {"layers": "tf,mlp,mlp"},
            "mlp+tf+tf": {"layers": "mlp,tf,tf"},
            "attn+tf+tf": {"layers": "attn,tf,tf"},
            "tf+attn+mlp": {"layers": "tf,attn,mlp"},
        },
        seeds=(0,),
    ),
}


#: every study ``run_study`` knows: the transformer studies above and App. C.3's simplified model
NAMES = (*STUDIES, "simplified")


def study_configs(
    name: str, seeds: int | None = None, variants: Sequence[str] | None = None
) -> dict[str, RunConfig]:
    """``{run name: RunConfig}`` of study ``name`` (``seeds``: the first that many seeds of
    every variant instead of the study's own; ``variants``: only these of the study's)."""
    if name not in STUDIES:
        raise ValueError(f"study must be one of {', '.join(NAMES)}, got {name!r}.")
    st = STUDIES[name]
    if variants is not None and not variants:
        raise ValueError(
            f"no variant of study {name} chosen (variants is empty); name at least one of "
            f"{', '.join(st.variants)}."
        )
    unknown = [v for v in variants or () if v not in st.variants]
    if unknown:
        raise ValueError(
            f"study {name} has no variant {unknown[0]!r}; its variants: {', '.join(st.variants)}."
        )
    out = {}
    for variant, changes in st.variants.items():
        if variants is not None and variant not in variants:
            continue
        own = (st.seeds_of or {}).get(variant, st.seeds)
        for seed in own if seeds is None else range(seeds):
            out[f"{variant}-s{seed}"] = RunConfig(**{**st.base, **changes, "seed": seed})
    return out


def residual_summary(run: Run, layer: int = 0) -> dict[str, float]:
    """The Fig. 7c numbers of a run: ‖Res_BOS‖ at ``layer``'s output at the start and end, the
    other tokens' mean, and the least-squares slope (per 1,000 steps) and R² of ‖Res_BOS‖ over
    the measurements at steps ≥ last/8 (as finding 4)."""
    m = run.metrics
    if f"layers.{layer}.res_bos" not in m[-1]:  # a run without BOS (App. C.4)
        keys = ("res_bos_0", "res_bos", "res_other", "res_peak", "slope_per_1k", "r2")
        return {
            **dict.fromkeys(keys, float("nan")),
            "bigram_excess": m[-1]["bigram_excess"],
            "backcopy_excess": m[-1]["backcopy_excess"],
        }
    steps = np.array([r["step"] for r in m], dtype=float)
    bos = np.array([r[f"layers.{layer}.res_bos"] for r in m])
    late = steps >= steps[-1] / 8
    slope, r2 = linear_fit(steps[late], bos[late])
    last = m[-1]
    return {
        "res_bos_0": float(bos[0]),
        "res_bos": float(bos[-1]),
        "res_other": last[f"layers.{layer}.res_other"],
        "res_peak": last[f"layers.{layer}.res_peak"],
        "slope_per_1k": slope * 1000,
        "r2": r2,
        "bigram_excess": last["bigram_excess"],
        "backcopy_excess": last["backcopy_excess"],
    }


def _fig7b_rows(runs: dict[str, Run], task) -> list[list]:
    rows = []
    for name, run in runs.items():
        ev = eval_tokens(run.cfg, task)
        for zeroed, zero in (("none", ()), ("layer 0", ("layers.0.attn", "layers.0.mlp"))):
            m = measure(run.model, task, ev, zero)
            rows.append(
                [
                    name,
                    zeroed,
                    m["layers.0.res_bos"],
                    m["layers.0.res_other"],
                    m["layers.1.attn.delta_logit"],
                    m["layers.1.attn.bos_weight"],
                    m["layers.1.attn.val_bos"],
                    m["layers.1.attn.val_other"],
                ]
            )
    return rows


FIG7B_HEADER = [
    "run",
    "zeroed",
    "‖Res_BOS‖ L0",
    "mean ‖Res_other‖ L0",
    "L1 Δlogit",
    "L1 BOS weight",
    "L1 ‖Val_BOS‖",
    "L1 mean ‖Val_other‖",
]


def run_study(
    out: str | Path,
    name: str,
    *,
    seeds: int | None = None,
    threads: int | None = 1,
    progress: Progress | None = None,
    task: BigramBackcopy | None = None,
    steps: int | None = None,
    variants: Sequence[str] | None = None,
    workers: int = 1,
    ray: str | None = None,
) -> tuple[Path, dict]:
    """Train (or resume) every run of study ``name`` (``variants``: only those) in ``out`` and
    write ``out/report.md``, ``out/results.json`` and ``out/residual.png``; returns the folder and
    the results. The runs are independent: ``workers`` > 1 trains them in a local process pool,
    ``ray`` as Ray tasks (`sweep.run_jobs`), then this process loads them. A folder keeps
    the runs of earlier invocations, so variants can be trained a few at a time; the report covers
    the ones asked for. ``simplified`` is `simplified.run` (``steps``: its
    training steps; the transformer studies fix theirs per variant)."""
    if name == "simplified":
        from . import simplified

        return simplified.run(
            out, seeds=seeds, steps=steps, threads=threads, progress=progress, task=task
        )
    if steps is not None:
        raise ValueError("--steps applies to the simplified study only.")
    task = task or BigramBackcopy.tiny_shakespeare()
    cfgs = study_configs(name, seeds, variants)
    report.require(cfgs, f"runs of study {name}")  # before the folder's files are touched
    record = {"study": name, "runs": {k: c.to_dict() for k, c in cfgs.items()}}
    folder = RunFolder(out, "backcopy-study", record, identity=("study",))
    clock = Clock()
    runs: dict[str, Run] = {}
    train_runs(folder, cfgs, task, threads, workers, ray, progress)
    with runner.threads(threads):  # trains here with one worker; else loads what the jobs trained
        for i, (run_name, cfg) in enumerate(cfgs.items()):
            emit(progress, name, "runs", i, len(cfgs), note=run_name)
            runs[run_name] = train(
                folder / "runs" / run_name, cfg, task, progress=progress, label=run_name
            )
        fig7b = _fig7b_rows(runs, task) if name == "fig7b" else None
    summary = {
        k: {**residual_summary(r), "seconds": r.seconds, "steps": r.steps_done}
        for k, r in runs.items()
    }
    results = {"study": name, "wall_seconds": clock.wall, "runs": summary}
    if fig7b is not None:
        results["fig7b"] = [dict(zip(FIG7B_HEADER, r, strict=True)) for r in fig7b]
    write_metrics(folder, results, "results.json")
    _write(folder.path, name, runs, summary, fig7b)
    return folder.path, results


def summary_markdown(results: dict) -> str:
    """The command's summary of a study: ‖Res_BOS‖ at layer 0 (start, end, peak, slope) and the
    excess risks per run."""
    keys = (
        "res_bos_0",
        "res_bos",
        "res_peak",
        "slope_per_1k",
        "r2",
        "bigram_excess",
        "backcopy_excess",
    )
    header = ["run", "start", "end", "peak", "slope /1k", "R²", "bigram exc.", "backcopy exc."]
    rows = [[name, *(f"{r[k]:.3g}" for k in keys)] for name, r in results["runs"].items()]
    return report.markdown_table(header, rows)


def _write(out: Path, name: str, runs: dict[str, Run], summary: dict, fig7b) -> Path:
    st = STUDIES[name]
    header = ["run", "layers", "attention", "optimizer", "lr", "momentum", "wd", "batch", "steps"]
    header += ["‖Res_BOS‖ start", "end", "mean ‖Res_other‖", "peak", "slope /1k steps", "R²"]
    header += ["bigram exc.", "backcopy exc.", "train s"]
    rows = []
    for k, r in runs.items():
        c, s = r.cfg, summary[k]
        rows.append(
            [
                k,
                c.layers,
                c.method,
                c.optimizer,
                c.learning_rate,
                c.momentum or 0,
                c.weight_decay if c.optimizer == "adam" else 0,
                c.batch,
                r.steps_done,
                s["res_bos_0"],
                s["res_bos"],
                s["res_other"],
                s["res_peak"],
                s["slope_per_1k"],
                s["r2"],
                s["bigram_excess"],
                s["backcopy_excess"],
                r.seconds,
            ]
        )
    with report.figure(out / "residual.png", figsize=(7, 4)) as (_, ax):
        ax.set_prop_cycle(color=report.pyplot().get_cmap("tab20").colors)
        for k, r in runs.items():
            if r.cfg.bos is False:  # no BOS, no BOS residual
                continue
            steps = [m["step"] for m in r.metrics]
            ax.plot(steps, [m["layers.0.res_bos"] for m in r.metrics], marker=".", label=k)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.set_ylabel("‖Res_BOS‖ at layer 0's output")
        ax.set_title(f"study {name}", fontsize=9)
        ax.legend(fontsize=6)
    sections = [
        f"{st.what}\n\nBase: {st.base}. `sharpattn reproduce backcopy-study {name}`. The paper "
        "(Fig. 7c, App. C.1: d = 256, N = 256, batch 512, AdamW 3e-4 or SGD 0.03, 10,000 steps): "
        "with softmax + Adam ‖Res_BOS‖ at layer 0 grows linearly; with SGD or with ReLU attention "
        f"it stays flat. Converged = both excess risks < {CONVERGED} nats."
        if name != "no-bos"
        else f"{st.what}\n\nBase: {st.base}. `sharpattn reproduce backcopy-study {name}`.",
        "## Runs\n\n"
        + report.markdown_table(header, rows, "llllrrrrr" + "r" * 9)
        + "\nSlope and R²: least squares of ‖Res_BOS‖ (layer 0) on the step over the "
        "measurements at steps ≥ last/8.",
        report.image("residual.png", "‖Res_BOS‖ at layer 0's output over training."),
    ]
    no_bos = {k: r for k, r in runs.items() if r.cfg.bos is False}
    if no_bos:
        cls = ("first", "trigger", "delimiter", "other", "uniform")
        sections.append(
            "## App. C.4: the task without BOS\n\n"
            + report.markdown_table(
                ["run", "step", *(f"weight per {c} key" for c in cls)],
                [
                    [
                        k,
                        r.metrics[-1]["step"],
                        *(r.metrics[-1][f"layers.0.attn.weight_{c}"] for c in cls),
                    ]
                    for k, r in no_bos.items()
                ],
            )
            + "\nMean attention weight a key of each class receives from non-trigger queries "
            "(every visible query-key pair); 'uniform' is the same mean for weights 1/n. The "
            "paper (Fig. 19): the zeroth token is not a sink; triggers and delimiters become "
            "sinks."
        )
    if fig7b is not None:
        sections.append(
            "## Fig. 7b: layer 0 zeroed\n\n"
            + report.markdown_table(FIG7B_HEADER, fig7b, "ll" + "r" * 6)
            + "\nThe paper: after zeroing layer 0 the BOS residual is no longer massive and the "
            "middle layer's BOS logit and value norm return to normal (no sink, no drain)."
        )
    return report.write_report(out, f"Bigram-Backcopy study: {name}", sections)


# --- the experiment protocol (`protocol.Experiment`) ------------------------------------------


@dataclass
class Options:
    """The command's options (`protocol`): the study, then what may change in it."""

    study: str = option("relu-peak", "", kind="argument", choices=NAMES, metavar="STUDY")
    seeds: int | None = option(
        None,
        "Seeds per variant (default: the study's own; simplified: 1).",
        kind="count",
        maximum="seeds",
        show_default=False,
    )
    steps: int | None = option(
        None,
        "Training steps of the simplified study (default 5,000).",
        kind="count",
        maximum="steps",
        show_default=False,
    )
    variants: tuple[str, ...] | None = option(
        None,
        "Only these of the study's variants, "
        "comma-separated (runs already in the folder are "
        "kept; the report covers the ones asked for).",
        kind="names",
        show_default=False,
    )
    threads: int | None = option(None, "", kind="threads")


def check(given: dict) -> None:
    """Options that do not apply to the study asked for: one sentence."""
    if given.get("steps") is not None and given["study"] != "simplified":
        raise ValueError("--steps applies to the simplified study only.")
    if given["study"] == "simplified" and (
        given.get("variants") or given.get("workers") or given.get("ray_address")
    ):
        raise ValueError("--variants, --workers and --ray apply to the transformer studies.")


@dataclass(frozen=True)
class StudyRun:
    """What `run_study` is called with."""

    study: str
    seeds: int | None = None
    steps: int | None = None
    variants: tuple[str, ...] | None = None
    threads: int | None = 1
    workers: int = 1


def configure(
    profile: str = "quick",
    *,
    study: str,
    seeds: int | None = None,
    steps: int | None = None,
    variants: Sequence[str] | None = None,
    workers: int | None = None,
    threads: int | None = 1,
) -> StudyRun:
    """The study's run (it has no profiles: each study fixes its own settings)."""
    variants = tuple(variants) if variants is not None else None
    return StudyRun(study, seeds, steps, variants, threads, workers or 1)


def plan(chosen: StudyRun, profile: str) -> tuple[str, str, bool]:
    return "reproduce backcopy-study", f"study {chosen.study}", False


def default_folder(chosen: StudyRun, profile: str) -> str:
    return f"runs/backcopy-study-{chosen.study}"


def run_experiment(
    folder: str | Path, chosen: StudyRun, progress: Progress | None = None, pool: str | None = None
) -> Result:
    run, results = run_study(
        folder,
        chosen.study,
        seeds=chosen.seeds,
        threads=chosen.threads,
        progress=progress,
        steps=chosen.steps,
        variants=chosen.variants,
        workers=chosen.workers,
        ray=pool,
    )
    if chosen.study == "simplified":
        from . import simplified

        printed = (
            simplified.summary_markdown(results),
            "App. C.3: the simplified model trained by Adam",
        )
    else:
        printed = (
            summary_markdown(results),
            f"Bigram-Backcopy study {chosen.study}: ‖Res_BOS‖ at layer 0",
        )
    return Result(Path(run), (), ("report.md",), results, printed=(printed,))
