"""The CLRS-LLM study's tables: per size (paired over prompts and over seeds), in distribution,
the verdicts over seeds, and report.md with its figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...lab import report as kit
from ...lab.stats import alpha_words, paired_comparison, paired_effect, reproduction_verdicts
from .. import adapters
from .. import sequence as seq
from ..clrs import PAPER_CLAIM
from .config import METHODS, Config, seeds_of


def per_size(scores: dict, cfg: Config) -> list[dict[str, Any]]:
    """Per algorithm and size: each method's exact match and answer-token accuracy (mean and sd
    over seeds) and adaptive against softmax, paired over test prompts (each prompt's score
    averaged over seeds) and over seeds."""
    seeds = seeds_of(cfg)
    out = []
    for name in cfg.tasks:
        for size in cfg.sizes:
            entry: dict[str, Any] = {
                "task": name,
                "size": size,
                "in_training": size <= cfg.train_sizes[1],
            }
            per_prompt, per_seed = {}, {}
            for m in METHODS:
                sc = [scores[(name, m, s, size)] for s in seeds]
                exact = np.array([x["exact"] for x in sc], dtype=float)  # [seeds, prompts]
                tok_ = np.array([np.divide(x["right"], x["tokens"]) for x in sc])
                per_prompt[m] = {"exact": exact.mean(0), "tokens": tok_.mean(0)}
                per_seed[m] = {
                    "exact": exact.mean(1),
                    "tokens": np.array([sum(x["right"]) / sum(x["tokens"]) for x in sc]),
                }
                for k in ("exact", "tokens"):
                    v = per_seed[m][k]
                    entry[f"{m}_{k}_seeds"] = [float(x) for x in v]
                    entry[f"{m}_{k}"] = float(v.mean())
                    entry[f"{m}_{k}_sd"] = float(v.std(ddof=1)) if len(v) > 1 else float("nan")
            a, b = METHODS
            for k in ("exact", "tokens"):
                entry[f"p_prompts_{k}"] = float(
                    paired_comparison(per_prompt[a][k][:, None], per_prompt[b][k][:, None]).p_value[
                        0
                    ]
                )
                entry[f"p_seeds_{k}"] = float(
                    paired_comparison(per_seed[a][k][:, None], per_seed[b][k][:, None]).p_value[0]
                )
            out.append(entry)
    return out


def in_distribution(rows: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Per algorithm: adaptive against softmax in exact match at the training sizes (each seed's
    mean over those sizes), paired over seeds (`stats.paired_effect`): how well matched the two
    fine-tunings are where both were trained."""
    lo, hi = cfg.train_sizes
    out = {}
    for name in cfg.tasks:
        per = {m: {} for m in METHODS}
        for r in rows:
            if r["task"] == name and lo <= r["size"] <= hi:
                per[r["method"]].setdefault(r["seed"], []).append(r["acc"])
        seeds = sorted(set(per[METHODS[0]]) & set(per[METHODS[1]]))
        out[name] = paired_effect(
            [np.mean(per[METHODS[0]][s]) for s in seeds],
            [np.mean(per[METHODS[1]][s]) for s in seeds],
        )
    return out


def seed_verdicts(sizes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Beyond the training sizes, per algorithm and size: adaptive against softmax over the
    seeds (the randomised unit: each seed is one fine-tuning), exact match and answer tokens,
    each a `stats.reproduction_verdict` of the paper's claim that adaptive is ahead. Each
    measure's cells are one family, Holm-corrected (`stats.reproduction_verdicts`: the cells
    without a test, such as both at 0 on every seed, do not count)."""
    a, b = METHODS
    cells = [e for e in sizes if not e["in_training"] and f"{a}_exact_seeds" in e]
    judged = {
        k: reproduction_verdicts(
            [
                dict(
                    a=e[f"{a}_{k}_seeds"],
                    b=e[f"{b}_{k}_seeds"],
                    paper=PAPER_CLAIM.words,
                    sign=PAPER_CLAIM.sign,
                )
                for e in cells
            ]
        )
        for k in ("exact", "tokens")
    }
    return [
        {"task": e["task"], "size": e["size"], **{k: judged[k][i] for k in judged}}
        for i, e in enumerate(cells)
    ]


def pooled_beyond(sizes: list[dict[str, Any]], tasks) -> list[dict[str, Any]]:
    """Per algorithm: adaptive against softmax in exact match over every size beyond training
    (each seed's mean over those sizes), paired over seeds; the algorithms are one family,
    Holm-corrected (`stats.reproduction_verdicts`)."""
    a, b = METHODS
    per = {}
    for name in tasks:
        cells = [e for e in sizes if e["task"] == name and not e["in_training"]]
        if cells and f"{a}_exact_seeds" in cells[0]:
            per[name] = [np.mean([e[f"{m}_exact_seeds"] for e in cells], axis=0) for m in METHODS]
    judged = reproduction_verdicts(
        [dict(a=x, b=y, paper=PAPER_CLAIM.words, sign=PAPER_CLAIM.sign) for x, y in per.values()]
    )
    return [
        {"task": name, a: float(np.mean(x)), b: float(np.mean(y)), "verdict": v}
        for (name, (x, y)), v in zip(per.items(), judged, strict=True)
    ]


def write(folder: Path, cfg: Config, m: dict[str, Any]) -> Path:
    a, b = METHODS
    header = [
        "algorithm",
        "method",
        "in distribution",
        "out of distribution",
        "p",
        "tokens in",
        "tokens out",
        "p",
    ]
    summary = kit.write_table(
        folder,
        "clrs_llm",
        header,
        [
            [
                e["task"],
                e["method"],
                kit.mean_sd(*e["id"][:2]),
                kit.mean_sd(*e["ood"][:2]),
                kit.p_cell(e["ood"][2]),
                kit.mean_sd(*e["id_token"][:2]),
                kit.mean_sd(*e["ood_token"][:2]),
                kit.p_cell(e["ood_token"][2]),
            ]
            for e in m["summary"]
        ],
    )
    size_header = [
        "algorithm",
        a,
        b,
        "p (prompts, secondary)",
        "p (seeds)",
        f"tokens {a}",
        f"tokens {b}",
        "p (prompts, secondary)",
        "p (seeds)",
    ]
    tables = []
    for size in cfg.sizes:
        entries = [e for e in m["sizes"] if e["size"] == size]
        shown = [
            [
                e["task"],
                kit.mean_sd(e[f"{a}_exact"], e[f"{a}_exact_sd"]),
                kit.mean_sd(e[f"{b}_exact"], e[f"{b}_exact_sd"]),
                kit.p_cell(e["p_prompts_exact"]),
                kit.p_cell(e["p_seeds_exact"]),
                kit.mean_sd(e[f"{a}_tokens"], e[f"{a}_tokens_sd"]),
                kit.mean_sd(e[f"{b}_tokens"], e[f"{b}_tokens_sd"]),
                kit.p_cell(e["p_prompts_tokens"]),
                kit.p_cell(e["p_seeds_tokens"]),
            ]
            for e in entries
        ]
        where = (
            "training size"
            if entries[0]["in_training"]
            else (f"{size / cfg.train_sizes[1]:g}× the largest training size")
        )
        tables.append(f"### n = {size} ({where})\n\n" + kit.markdown_table(size_header, shown))
    seq.plot_curves(
        folder / "fig8.png",
        m["rows"],
        list(cfg.tasks),
        list(METHODS),
        "Exact match against size (shaded: training sizes)",
        colors={"softmax": "tab:blue", "adaptive": "tab:red"},
        spans={name: cfg.train_sizes for name in cfg.tasks},
    )
    pooled = pooled_beyond(m["sizes"], cfg.tasks)
    ahead = [v for v in pooled if v["verdict"].effect.mean > 0]
    signif = [v for v in ahead if v["verdict"].adjusted_p <= 0.05]
    t = m["training"]
    cost = "; ".join(
        f"{k}: {v['seconds']:.0f} s ({v['steps_per_s']:.3g} steps/s), loss "
        f"{v['first_loss']:.3f} → {v['last_loss']:.3f}"
        for k, v in t.items()
        if v["seconds"] is not None and v["steps_per_s"]
    )
    first = next(iter(t.values()))
    setup = (
        f"{cfg.model} fine-tuned per seed ({cfg.seeds} seed{'s' * (cfg.seeds != 1)} from {cfg.seed}) twice"
        f"{' with identical budgets' if cfg.adaptive_steps is None else ''}: low-rank adapters (LoRA rank {cfg.rank}, α = {2 * cfg.rank}, on "
        f"{', '.join(adapters.TARGETS)} of every layer; {first['adapter_parameters']:,} trained "
        "parameters, the pretrained weights frozen) trained with softmax attention and with "
        "adaptive temperature in every layer (in training and at inference, as §4.2 does), from "
        f"the same initial adapters on the same batches: {cfg.steps} AdamW steps"
        + (f" ({cfg.adaptive_steps} for adaptive temperature)" if cfg.adaptive_steps else "")
        + f" (lr {cfg.lr:g}, "
        f"gradient norm clipped at 1) of {cfg.batch} CLRS-Text examples of "
        f"{', '.join(cfg.tasks)} at {cfg.train_sizes[0]}-{cfg.train_sizes[1]} items (keys 0-"
        f"{cfg.values - 1}), loss on the answer tokens. {cfg.prompts} test prompts per algorithm "
        "and size, the same for both methods and every seed. Exact match: every answer token and "
        "the closing end-of-text token the most likely one (what greedy decoding produces); "
        "tokens: the share of them right. p: two-sided paired t-tests of adaptive against "
        "softmax, over seeds in the first table, over test prompts (each averaged over seeds) "
        "and over seeds in the tables per size."
    )
    judged = seed_verdicts(m["sizes"])
    words = [v["exact"].verdict.split(" (")[0] for v in judged]
    inside = in_distribution(m["rows"], cfg)
    matched = "; ".join(f"{name} {e.mean:+.3f} {kit.interval(e)}" for name, e in inside.items())
    setup += (
        " In distribution (exact match at the training sizes, adaptive − softmax over "
        f"seeds, 95 % interval): {matched}. Where adaptive is behind there, it is less "
        "trained, and the comparison beyond the training sizes is confounded by it "
        "(`--adaptive-steps` gives adaptive more steps to match)."
    )
    pooled_words = "; ".join(
        f"{v['task']} {v[a]:.3f} → {v[b]:.3f} (p = {kit.p_cell(v['verdict'].effect.p)}, "
        f"{kit.p_cell(v['verdict'].adjusted_p)} after Holm over {v['verdict'].m})"
        for v in pooled
    )
    verdict = (
        f"Beyond the training sizes adaptive temperature is ahead of softmax on {len(ahead)} of "
        f"{len(cfg.tasks)} algorithms in exact match (each seed's mean over those sizes), "
        f"{len(signif)} of them significantly (paired over seeds, Holm over the algorithms): "
        f"{pooled_words}. The paper (Fig. 8, Gemma 2B fine-tuned on thirty algorithms) reports adaptive "
        "temperature ahead out of distribution on nearly all of them."
        + (
            f" Over seeds, per algorithm and size beyond training (exact match): "
            f"{words.count('reproduced')} reproduced, {words.count('contradicted')} contradicted, "
            f"{sum(w.startswith('not detectable') for w in words)} not detectable at this power, "
            f"{len(words) - sum(w in ('reproduced', 'contradicted') or w.startswith('not detectable') for w in words)} "
            "without a test (too few seeds, or the same on every seed: e.g. both at 0)."
            if judged
            else ""
        )
    )
    seeds_section = None
    if judged:
        head = [
            "algorithm",
            "n",
            "effect (adaptive − softmax)",
            "95 % interval",
            "p (seeds)",
            "p, Holm",
            "detectable (80 % power, α/m)",
            "verdict",
            "tokens: effect",
            "tokens: p, Holm",
            "tokens: verdict",
        ]
        body = [
            [
                v["task"],
                str(v["size"]),
                f"{v['exact'].effect.mean:+.3f}",
                kit.interval(v["exact"].effect),
                kit.p_cell(v["exact"].effect.p),
                kit.p_cell(v["exact"].adjusted_p),
                kit.decimals(v["exact"].detectable),
                v["exact"].verdict,
                f"{v['tokens'].effect.mean:+.3f}",
                kit.p_cell(v["tokens"].adjusted_p),
                v["tokens"].verdict,
            ]
            for v in judged
        ]
        seeds_section = (
            "## Verdict over seeds\n\nThe unit randomised here is the seed (one fine-tuning "
            "each), so each comparison is judged over seeds: the effect is the mean over seeds of "
            "adaptive's exact match minus softmax's, with its 95 % t interval. Each measure's "
            "cells with a test are one family: the verdict is on the p-value Holm-corrected over "
            f"them ({judged[0]['exact'].m} in exact match, {judged[0]['tokens'].m} in answer "
            "tokens; cells the same on every seed have no test and do not count), and detectable "
            "is the smallest true effect a paired t-test at Holm's strictest threshold α/m "
            f"({alpha_words(0.05, judged[0]['exact'].m)} in exact match) finds with 80 % power "
            "at the seeds' spread; the verdict is reproduced (adaptive significantly ahead, as the paper has "
            "it), contradicted (significantly behind) or not detectable at this power. The "
            "per-size tables' p-values over prompts treat the trained models as fixed and are "
            "secondary.\n\n" + kit.markdown_table(head, body)
        )

    return kit.write_report(
        folder,
        "CLRS-Text on a fine-tuned LLM: softmax vs adaptive temperature "
        "(Softmax is not Enough, Fig. 8)",
        [
            "## Setup\n\n" + setup,
            "## Result\n\n" + verdict + "\n\n" + summary,
            seeds_section,
            kit.image("fig8.png", "Exact match against size per algorithm, mean ± sd over seeds"),
            "## Per size\n\n" + "\n".join(tables),
            f"## Cost\n\n{cost}. This invocation: {m['wall_seconds']:.0f} s wall, "
            f"{m['cpu_seconds']:.0f} s CPU ({m['threads']} thread{'s' * (m['threads'] != 1)}).",
        ],
    )
