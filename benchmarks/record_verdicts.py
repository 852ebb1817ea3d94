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
* ``selective-llm``: `selective_llm.summarize_matched` (the NLL change over seeds with its
  interval, the 80 %-power detectable change and the verdict against the paper's row for the
  arm, `selective_llm.reference`) on docs/records/selective-llm-lora-paper.tar.gz, and how many
  seeds a paired t-test would need to detect that row's change with 80 % power at the record's
  seed-to-seed spread (`stats.detectable_at_power`), and what 54 seeds (3 hours here) would
  detect; ``selective-llm-sharing``: the same on the weight-sharing run's record,
  docs/records/selective-llm-lora-sharing-paper.tar.gz;
* ``all``: every one of them.

The leaderboards' comparisons come from the command itself: ``sharpattn leaderboard --standard
--out COPY``, on an unpacked copy of docs/records/leaderboard-standard.tar.gz, re-reads every
job's rows and rewrites the report (effects.md) without training.

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

from sharpattn.experiments import clrs_llm, max_retrieval, selective_llm
from sharpattn.lab.stats import detectable_at_power

RECORDS = Path(__file__).resolve().parent.parent / "docs" / "records"


def unpack(name: str, into: str) -> Path:
    """The record ``name`` (docs/records/NAME.tar.gz) unpacked into ``into``: its run folder
    (the archive's one top-level folder, whatever its name)."""
    with tarfile.open(RECORDS / f"{name}.tar.gz") as tar:
        tops = {Path(m.name).parts[0] for m in tar.getmembers()}
        tar.extractall(into, filter="data")
    if len(tops) != 1:
        raise SystemExit(f"{name}.tar.gz has {len(tops)} top-level folders, expected one.")
    return Path(into) / tops.pop()


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
    row = selective_llm.reference(cfg)
    paper = math.nan if row is None else abs(selective_llm.nll_change(row))
    print(
        "| tokens | Δ NLL | 95 % interval | p | detectable (80 %) | verdict | seed sd | "
        "seeds for the paper's change | detectable with 54 seeds |"
    )
    print("|---:|---:|---|---:|---:|---|---:|---:|---:|")
    for r in selective_llm.summarize_matched(cfg, base, arms)["rows"]:
        key = str(r["length"])
        d = [np.mean(arms["selective"][s][key]) - np.mean(arms["softmax"][s][key]) for s in seeds]
        sd = float(np.std(d, ddof=1))
        need = next(
            (n for n in range(2, 5000) if detectable_at_power(sd, n, 0.05) <= paper), math.nan
        )
        print(
            f"| {r['length']:,} | {r['nll_change']:+.4f} | [{r['nll_change_low']:+.4f}, "
            f"{r['nll_change_high']:+.4f}] | {r['p_seeds']:.2g} | {r['detectable']:.3g} | "
            f"{r['verdict']} | {sd:.4f} | {need} | "
            f"{detectable_at_power(sd, 54, 0.05):.4f} |"
        )


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
