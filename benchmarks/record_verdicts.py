"""The verdicts over seeds of two published reproductions, recomputed from their records.

The records in docs/records keep every evaluation a run made (not its weights), so the reports'
current comparisons can be recomputed without training: this script unpacks a record into a
temporary folder and runs the report's own functions on its evaluation files.

* ``clrs-llm``: `clrs_llm.per_size` and `clrs_llm.seed_verdicts` (adaptive against softmax over
  seeds, every size beyond training, exact match and answer tokens) on
  docs/records/clrs-llm-paper.tar.gz;
* ``selective-llm``: `selective_llm.summarize_matched` (the NLL change over seeds with its
  interval, the 80 %-power detectable change and the verdict against the paper's row for the
  arm, `selective_llm.reference`) on docs/records/selective-llm-lora-paper.tar.gz, and how many
  seeds a paired t-test would need to detect that row's change with 80 % power at the record's
  seed-to-seed spread (`stats.detectable_at_power`), and what 54 seeds (3 hours here) would
  detect; ``selective-llm-sharing``: the same on the weight-sharing run's record,
  docs/records/selective-llm-lora-sharing-paper.tar.gz.

The leaderboard's comparisons come from the command itself: ``sharpattn leaderboard --standard
--out COPY``, on an unpacked copy of docs/records/leaderboard-standard.tar.gz, re-reads every
job's rows and rewrites the report (effects.md) without training.

    python benchmarks/record_verdicts.py clrs-llm
    python benchmarks/record_verdicts.py selective-llm
    python benchmarks/record_verdicts.py selective-llm-sharing
"""

from __future__ import annotations

import argparse
import json
import math
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from sharpattn.experiments import clrs_llm, selective_llm
from sharpattn.lab.stats import detectable_at_power

RECORDS = Path(__file__).resolve().parent.parent / "docs" / "records"


def unpack(name: str, into: str) -> Path:
    """The record ``name`` (docs/records/NAME.tar.gz) unpacked into ``into``: its run folder."""
    with tarfile.open(RECORDS / f"{name}.tar.gz") as tar:
        tar.extractall(into, filter="data")
    return Path(into) / name


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
    print(
        "| algorithm | n | exact: effect | 95 % interval | p | verdict | tokens: effect | "
        "95 % interval | verdict |"
    )
    print("|---|---:|---:|---|---:|---|---:|---|---|")
    for v in clrs_llm.seed_verdicts(clrs_llm.per_size(scores, cfg)):
        e, t = v["exact"].effect, v["tokens"].effect
        print(
            f"| {v['task']} | {v['size']} | {e.mean:+.3f} | [{e.low:+.3f}, {e.high:+.3f}] | "
            f"{e.p:.2g} | {v['exact'].verdict} | {t.mean:+.3f} | [{t.low:+.3f}, {t.high:+.3f}] "
            f"| {v['tokens'].verdict} |"
        )


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", choices=["clrs-llm", *SELECTIVE])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.study == "clrs-llm":
            clrs(unpack("clrs-llm-paper", tmp))
        else:
            selective(unpack(SELECTIVE[args.study], tmp))


if __name__ == "__main__":
    main()
