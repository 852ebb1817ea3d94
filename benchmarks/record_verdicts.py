"""Every verdict over seeds of the published reproductions, recomputed from their records.

The records in docs/records keep every evaluation a run made (not its weights), so the reports'
comparisons can be recomputed without training: this script unpacks a record into a temporary
folder and runs the report's own functions on its evaluation files. Each page's comparisons are
one family, Holm-corrected (`stats.reproduction_verdicts`); "detectable" is the difference a
paired t-test finds with 80 % power at the level named beside it (α = 0.05 for one comparison,
Holm's strictest threshold α/m for a family of m).

* ``clrs-llm``, ``clrs-llm-offfloor``, ``clrs-llm-4-16``: per algorithm and size beyond
  training, adaptive against softmax over seeds in exact match and answer tokens
  (`clrs_llm.seed_verdicts`, one Holm family per measure), in distribution
  (`clrs_llm.in_distribution`) and pooled beyond training per algorithm
  (`clrs_llm.pooled_beyond`, Holm over the algorithms), on docs/records/clrs-llm-paper.tar.gz,
  clrs-llm-offfloor.tar.gz and clrs-llm-4-16.tar.gz;
* ``max-retrieval``: Table 1 (`max_retrieval.table1`: the gain over seeds per size, Holm over
  the sizes where the paper claims a gain) on docs/records/max-retrieval-paper.tar.gz;
  ``regularisers``: the same for each reading of the regulariser study
  (max-retrieval-regularisers.tar.gz);
* ``selective-llm``: `selective_llm.summarize_matched` (the NLL change over seeds and held-out
  windows, both samples, with its interval, the 80 %-power detectable change and the verdict
  against the paper's row for the arm, `selective_llm.reference`; beside it the interval over
  seeds alone), the variance components, and what the same seeds on 64 windows would detect
  (`stats.crossed_detectable`), on docs/records/selective-llm-lora-paper.tar.gz;
  ``selective-llm-sharing``: the same on the weight-sharing run's record,
  docs/records/selective-llm-lora-sharing-paper.tar.gz;
* ``leaderboard-nape``, ``leaderboard-far``, ``leaderboard-sb-shift``, ``leaderboard-power``: a
  leaderboard record's comparisons against softmax (`leaderboard.rank`, Holm over the methods,
  overall and per task; what the run can detect) and each cell's test sampling against its
  seeds' spread (`sequence.test_sampling`), on docs/records/leaderboard-nape.tar.gz,
  leaderboard-flip-flop-far.tar.gz, leaderboard-sb-shift.tar.gz and leaderboard-power.tar.gz;
* ``backcopy-seeds``: each Bigram-Backcopy finding's verdict on every seed of the quick
  profile, on docs/records/backcopy-seeds.tar.gz;
* ``all``: every one of them.

The standard board (docs/records/leaderboard-standard.tar.gz holds two run folders) is
recomputed by the command itself: ``sharpattn leaderboard --standard --out COPY``, on an unpacked
copy of it, re-reads every job's rows and rewrites the report (effects.md) without training.

    python benchmarks/record_verdicts.py all
    python benchmarks/record_verdicts.py clrs-llm-offfloor
"""

from __future__ import annotations

import argparse
import json
import math
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from sharpattn.experiments import (
    clrs_llm,
    leaderboard,
    leaderboard_power,
    max_retrieval,
    selective_llm,
    sequence,
)
from sharpattn.lab.stats import crossed_detectable, crossed_effect

RECORDS = Path(__file__).resolve().parent.parent / "docs" / "records"


def unpack(name: str, into: str) -> Path:
    """The record ``name`` (docs/records/NAME.tar.gz) unpacked into ``into``: its run folder
    (the archive's one top-level folder, whatever its name, or the one named as the record)."""
    with tarfile.open(RECORDS / f"{name}.tar.gz") as tar:
        tops = {Path(m.name).parts[0] for m in tar.getmembers()}
        tar.extractall(into, filter="data")
    if len(tops) == 1:
        return Path(into) / tops.pop()
    if name in tops:  # a record of several runs: the one named as the record
        return Path(into) / name
    raise SystemExit(f"{name}.tar.gz has {len(tops)} top-level folders and none named {name}.")


def config(cls, folder: Path):
    """The run's stored configuration as ``cls`` (the fields ``cls`` has)."""
    stored = json.loads((folder / "config.json").read_text())
    return cls(**{k: v for k, v in stored.items() if k in cls.__dataclass_fields__})


def clrs(folder: Path) -> None:
    cfg = config(clrs_llm.Config, folder)
    scores = {
        (name, m, s, size): json.loads(
            (folder / f"seed{s}" / m / f"eval_{name}_n{size}_p{cfg.prompts}.json").read_text()
        )
        for s in clrs_llm.seeds_of(cfg)
        for m in clrs_llm.METHODS
        for name in cfg.tasks
        for size in cfg.sizes
    }
    sizes = clrs_llm.per_size(scores, cfg)
    judged = clrs_llm.seed_verdicts(sizes)
    m_exact, m_tokens = judged[0]["exact"].m, judged[0]["tokens"].m
    print(
        f"Beyond training, adaptive − softmax over {len(clrs_llm.seeds_of(cfg))} seeds; Holm over "
        f"{m_exact} exact-match cells and {m_tokens} answer-token cells with a test.\n"
    )
    print(
        "| algorithm | n | exact: effect | 95 % interval | p | p, Holm | detectable | verdict | "
        "tokens: effect | 95 % interval | p | p, Holm | verdict |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|---:|---|---:|---:|---|")
    for v in judged:
        e, t = v["exact"], v["tokens"]
        print(
            f"| {v['task']} | {v['size']} | {e.effect.mean:+.3f} | [{e.effect.low:+.3f}, "
            f"{e.effect.high:+.3f}] | {e.effect.p:.2g} | {e.adjusted_p:.2g} | "
            f"{e.detectable:.3g} | {e.verdict} | {t.effect.mean:+.3f} | [{t.effect.low:+.3f}, "
            f"{t.effect.high:+.3f}] | {t.effect.p:.2g} | {t.adjusted_p:.2g} | {t.verdict} |"
        )
    print("\nPooled beyond training (each seed's mean exact match over those sizes):\n")
    print("| algorithm | softmax | adaptive | effect | 95 % interval | p | p, Holm | verdict |")
    print("|---|---:|---:|---:|---|---:|---:|---|")
    for v in clrs_llm.pooled_beyond(sizes, cfg.tasks):
        e = v["verdict"]
        print(
            f"| {v['task']} | {v['softmax']:.3f} | {v['adaptive']:.3f} | {e.effect.mean:+.3f} | "
            f"[{e.effect.low:+.3f}, {e.effect.high:+.3f}] | {e.effect.p:.2g} | "
            f"{e.adjusted_p:.2g} | {e.verdict} |"
        )


def table1(folder: Path) -> None:
    """Table 1's verdicts of the run folder ``folder`` (or of each reading's folder in it)."""
    runs = (
        [folder]
        if (folder / "accuracy.json").is_file()
        else sorted(f for f in folder.iterdir() if (f / "accuracy.json").is_file())
    )
    for run in runs:
        stored = json.loads((run / "accuracy.json").read_text())
        accuracy = {
            method: {int(s): {int(n): a for n, a in per.items()} for s, per in seeds.items()}
            for method, seeds in stored.items()
        }
        sizes = sorted(next(iter(accuracy["baseline"].values())))
        print(f"\n{run.name}: {len(accuracy['baseline'])} seeds\n")
        print(max_retrieval.verdict_table(max_retrieval.table1(accuracy, sizes)))


def selective(folder: Path) -> None:
    cfg = config(selective_llm.Config, folder)
    w = cfg.eval_windows

    def nll(*parts: str) -> list[float]:
        return json.loads(folder.joinpath(*parts).read_text())

    base = {str(n): nll("base", f"nll_n{n}_w{w}.json") for n in cfg.lengths}
    seeds = range(cfg.seed, cfg.seed + cfg.seeds)
    arms = {
        arm: {
            s: {str(n): nll(f"seed{s}", arm, f"nll_n{n}_w{w}.json") for n in cfg.lengths}
            for s in seeds
        }
        for arm in ("softmax", "selective")
    }
    rows = selective_llm.summarize_matched(cfg, base, arms)["rows"]
    print(
        f"Over {cfg.seeds} seeds × {w} held-out windows (crossed: both samples), and over the "
        "seeds alone as if the windows were all the text.\n"
    )
    print(
        "| tokens | Δ NLL | 95 % interval | p | detectable (80 %) | verdict | seeds alone: "
        f"interval | σ_seed | σ_window | σ_resid | detectable with {cfg.seeds} seeds × "
        f"{PLANNED_WINDOWS} windows |"
    )
    print("|---:|---:|---|---:|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        key = str(r["length"])
        d = np.array(
            [np.subtract(arms["selective"][s][key], arms["softmax"][s][key]) for s in seeds]
        )
        planned = crossed_detectable(crossed_effect(d), cfg.seeds, PLANNED_WINDOWS)
        print(
            f"| {r['length']:,} | {r['nll_change']:+.4f} | [{r['nll_change_low']:+.4f}, "
            f"{r['nll_change_high']:+.4f}] | {r['p']:.2g} | {r['detectable']:.3g} | "
            f"{r['verdict']} | [{r['seeds_low']:+.4f}, {r['seeds_high']:+.4f}] | "
            f"{math.sqrt(r['seed_var']):.4f} | {math.sqrt(r['window_var']):.4f} | "
            f"{math.sqrt(r['resid_var']):.4f} | {planned:.4f} |"
        )


def board(folder: Path) -> None:
    """A leaderboard record's comparisons against softmax (`leaderboard.rank` and
    `leaderboard.effects` on its rows: Holm over the methods, overall and per task), and each
    cell's test sampling against its seeds' spread (`sequence.test_sampling`)."""
    cfg, rows = leaderboard_power.read_rows(folder)
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    seeds = {m: len({r["seed"] for r in rows if r["method"] == m}) for m in cfg.methods}
    table = leaderboard.rank(rows, tasks, welch=len(set(seeds.values())) > 1)
    shown, _ = leaderboard.effects(table, tasks)
    print(leaderboard._detectable(table), end="")
    print("| task | method | seeds | effect | 95 % interval | p | p (Holm) | threshold | "
          "detectable (80 %) | verdict |")  # fmt: skip
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---|")
    for line in shown:
        print("| " + " | ".join(str(x) for x in line) + " |")
    print("\n| task | method | score | test sd | seed sd | test / seed |")
    print("|---|---|---:|---:|---:|---:|")
    for (task, method), v in sorted(sequence.test_sampling(rows).items()):
        e = next(x for x in table if x["method"] == method)
        score = e["tasks"][task]["auc"][0]
        print(
            f"| {task} | {method} | {score:.3f} | {v['test_sd']:.4f} | {v['seed_sd']:.4f} | "
            f"{v['ratio']:.2f} |"
        )


def backcopy(folder: Path) -> None:
    """The Bigram-Backcopy record's quick runs (``quick-s*``): each finding's verdict on every
    seed, as each run's ``results.json`` states it."""
    seeds = sorted(int(p.name.removeprefix("quick-s")) for p in folder.glob("quick-s*"))
    found = [
        json.loads((folder / f"quick-s{s}" / "results.json").read_text())["findings"] for s in seeds
    ]
    print("| finding | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---|" + "---|" * len(seeds))
    for i, first in enumerate(found[0]):
        verdicts = [f[i]["verdict"] for f in found]
        print(f"| {first['number']}. {first['title']} | " + " | ".join(verdicts) + " |")


#: the held-out windows a re-run of the selective-LLM study evaluates on
PLANNED_WINDOWS = 64


#: the selective-llm records: the base temperatures, and the weight-sharing ones (--sharing)
SELECTIVE = {
    "selective-llm": "selective-llm-lora-paper",
    "selective-llm-sharing": "selective-llm-lora-sharing-paper",
}
#: each study: its record in docs/records and the function that recomputes its verdicts
STUDIES = {
    "clrs-llm": ("clrs-llm-paper", clrs),
    "clrs-llm-offfloor": ("clrs-llm-offfloor", clrs),
    "clrs-llm-4-16": ("clrs-llm-4-16", clrs),
    "max-retrieval": ("max-retrieval-paper", table1),
    "regularisers": ("max-retrieval-regularisers", table1),
    **{study: (record, selective) for study, record in SELECTIVE.items()},
    "leaderboard-nape": ("leaderboard-nape", board),
    "leaderboard-far": ("leaderboard-flip-flop-far", board),
    "leaderboard-sb-shift": ("leaderboard-sb-shift", board),
    "leaderboard-power": ("leaderboard-power", board),
    "backcopy-seeds": ("backcopy-seeds", backcopy),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", choices=[*STUDIES, "all"])
    args = p.parse_args(argv)
    for study in STUDIES if args.study == "all" else [args.study]:
        record, recompute = STUDIES[study]
        print(f"\n## {study} (docs/records/{record}.tar.gz)\n")
        with tempfile.TemporaryDirectory() as tmp:
            recompute(unpack(record, tmp))


if __name__ == "__main__":
    main()
