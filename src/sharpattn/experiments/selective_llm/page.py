"""The selective-LLM study's summaries, verdicts over seeds, figure and report.md, for the
temperatures-only run and the matched study."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ...lab import report as kit
from ...lab.stats import (
    alpha_words,
    at_power,
    crossed_effect,
    paired_comparison,
    paired_effect,
    reproduction_verdict,
)
from .. import adapters
from ..paper_numbers import PaperChange, selective_fine_tune
from .config import Config

#: the significance level and power of the matched study's verdicts and detectable change
ALPHA, POWER = 0.05, 0.8


def reference(cfg: Config) -> PaperChange | None:
    """The paper's fine-tuning row for the arm ``cfg`` trains (its targets, terms and weight
    sharing: `paper_numbers.selective_fine_tune`); None where the paper has none."""
    return selective_fine_tune(cfg.targets, cfg.terms, cfg.sharing)


def nll_change(paper: PaperChange) -> float:
    """A perplexity change before → after as the change in mean NLL, ln(after / before) nats."""
    return math.log(float(paper.after) / float(paper.before))


def summarize_matched(cfg: Config, base: dict[str, list[float]], nll: dict) -> dict:
    """Per length: perplexity of the unpatched model and of both fine-tunings (exp of the mean
    window NLL over seeds), and selective against softmax over seeds and held-out windows
    together (`stats.crossed_effect`: the seeds are the randomised unit and the windows a
    sample of the text, so both spreads count; the effect with its interval, p, variance
    components and the 80 %-power detectable change) with, at the training context, the
    verdict against the paper's change for this arm (`reference`, `stats.reproduction_verdict`);
    beside it the interval over seeds alone (``seeds_low``/``seeds_high``: as if the windows
    were all the text) and, secondary, the test over windows (each window's NLL averaged over
    seeds). The paper has no number at other contexts, nor for an arm without a row: there the
    verdict says so and gives the change with its interval only."""
    seeds = sorted(nll["softmax"])
    paper = reference(cfg)
    rows = []
    for length in cfg.lengths:
        key = str(length)
        a = np.array([nll["softmax"][s][key] for s in seeds])  # [seeds, windows]
        b = np.array([nll["selective"][s][key] for s in seeds])
        u = np.asarray(base[key])
        rows.append(
            {
                "length": length,
                "factor": length // cfg.context,
                "seeds": len(seeds),
                "windows": a.shape[1],
                "ppl_base": float(np.exp(u.mean())),
                "ppl_softmax": float(np.exp(a.mean())),
                "ppl_selective": float(np.exp(b.mean())),
                "nll_change": float((b - a).mean()),
                "better_windows": int((b.mean(0) < a.mean(0)).sum()),
                "p_windows": float(
                    paired_comparison(a.mean(0)[:, None], b.mean(0)[:, None]).p_value[0]
                ),
                "p_seeds": float(
                    paired_comparison(a.mean(1)[:, None], b.mean(1)[:, None]).p_value[0]
                ),
            }
        )
        # the held-out windows are a sample of the text: the verdict is over seeds and windows
        effect = crossed_effect(b - a)
        fixed = paired_effect(a.mean(1), b.mean(1))  # as if the windows were all the text
        if paper is not None and length == cfg.context:
            change = nll_change(paper)
            judged = reproduction_verdict(
                a.mean(1),
                b.mean(1),
                sign=paper.sign,
                paper=f"{change:+.4f} nats",
                paper_effect=change,
                alpha=ALPHA,
                power=POWER,
                effect=effect,
            )
            detect, words = judged.detectable, judged.verdict
        else:
            detect = at_power(effect.se, effect.df, ALPHA, POWER)
            where = "for this arm" if paper is None else f"at {length // cfg.context}× the context"
            measured = _measured(effect.mean, effect.low, effect.high)
            words = f"no paper number {where}; measured {measured}"
        rows[-1] |= {
            "nll_change_low": effect.low,
            "nll_change_high": effect.high,
            "p": effect.p,
            "seed_var": effect.seed_var,
            "window_var": effect.item_var,
            "resid_var": effect.resid_var,
            "seeds_low": fixed.low,
            "seeds_high": fixed.high,
            "detectable": detect,
            "verdict": words,
        }
    return {"rows": rows}


def _measured(mean: float, low: float, high: float) -> str:
    """A change in NLL with its interval, in words."""
    if not np.isfinite(low):
        return f"{mean:+.4f} nats (no interval)"
    return f"{mean:+.4f} nats [{low:+.4f}, {high:+.4f}]"


def _reference_words(cfg: Config) -> str:
    """The paper's number the verdict at the training context is judged against, in words."""
    paper = reference(cfg)
    if paper is None:
        return (
            "the paper has no fine-tuning row for this arm, so no verdict is against a paper number"
        )
    return (
        f"the verdict at the training context against the paper's {nll_change(paper):+.4f} nats "
        f"({paper.source}: {paper.words}); the paper has no number at longer contexts"
    )


def write_matched(folder: Path, cfg: Config, m: dict[str, Any]) -> Path:
    rows = m["rows"]
    header = [
        "context",
        "tokens",
        "ppl unpatched",
        "ppl LoRA + softmax",
        "ppl LoRA + selective",
        "Δ nll (nats)",
        "95 % interval (seeds × windows)",
        "p (seeds × windows)",
        f"detectable (80 % power, {alpha_words(ALPHA)})",
        "verdict",
        "95 % interval (seeds, windows fixed)",
        "p (seeds, windows fixed)",
        "windows better",
        "p (windows, secondary)",
    ]
    table = [
        [
            f"{r['factor']}×",
            r["length"],
            f"{r['ppl_base']:.3f}",
            f"{r['ppl_softmax']:.3f}",
            f"{r['ppl_selective']:.3f}",
            f"{r['nll_change']:+.4f}",
            _span(r),
            _p(r.get("p", float("nan"))),
            _p(r.get("detectable", float("nan"))),
            r.get("verdict", "–"),
            _span(r, "seeds_"),
            _p(r["p_seeds"]),
            f"{r['better_windows']}/{r['windows']}",
            _p(r["p_windows"]),
        ]
        for r in rows
    ]
    arms = m["training"]
    first = next(iter(arms.values()))
    temps = max(v["temperature_parameters"] for v in arms.values())
    cost = "; ".join(
        f"{k}: {v['seconds']:.0f} s ({v['steps_per_s']:.3g} steps/s)"
        for k, v in arms.items()
        if v["seconds"] and v["steps_per_s"]
    )
    intro = (
        f"{cfg.model} fine-tuned per seed ({cfg.seeds} seed{'s' * (cfg.seeds != 1)} from {cfg.seed}) twice with the same "
        f"budget: LoRA adapters of rank {cfg.lora} (α = {2 * cfg.lora}) on "
        f"{', '.join(adapters.TARGETS)} of every layer ({first['adapter_parameters']:,} "
        f"parameters, lr {cfg.lora_lr:g}), the pretrained weights frozen, {cfg.steps} AdamW "
        f"steps on the same {cfg.batch}×{cfg.context}-token windows from the same initial "
        f"adapters; one with softmax attention, one with selective temperatures on "
        f"{cfg.targets} trained with the adapters ({temps:,} more parameters, lr {cfg.lr:g}, "
        f"position {cfg.position_lr:g}; terms: {cfg.terms}"
        f"{', weight sharing' if cfg.sharing else ''}). Perplexity on {rows[0]['windows']} "
        "held-out windows, the same for every model. Selective against softmax over seeds (the "
        "randomised unit: each seed is one pair of fine-tunings) and windows together (a sample "
        "of the text: a crossed two-way analysis whose variance components give the interval, "
        "with Satterthwaite's degrees of freedom): the mean change in NLL with its 95 % t "
        f"interval and p, the smallest change a test at {alpha_words(ALPHA)} detects with "
        f"80 % power at that spread, and {_reference_words(cfg)}. Beside it the interval over "
        "seeds alone, as if the windows were all the text, and the test over windows (each "
        "window's NLL averaged over seeds), which treats the trained models as fixed. The "
        "frozen-model study (temperatures alone against the unpatched model) is this command "
        "without --lora."
    )
    lines = {
        "ppl_base": "unpatched",
        "ppl_softmax": "LoRA + softmax",
        "ppl_selective": f"LoRA + selective {cfg.targets}",
    }
    return _report(
        folder,
        cfg,
        rows,
        ("table3_matched", header, table),
        lines,
        [intro, _position_term(m, cfg), f"Cost: {cost}; this invocation {_invocation(m)}."],
        "low-rank adapters learn instead of every weight",
        "Selective temperatures with a matched fine-tuned baseline (Table 3 in small)",
    )


def _p(v: float) -> str:
    return "–" if not np.isfinite(v) else f"{v:.2g}"


def _position_term(m: dict[str, Any], cfg: Config) -> str:
    """Whether the position term moved: the largest learned |c| (a layer's mean over heads) over
    seeds and targets, and τ_pos = 1 + c·ln n it gives at the longest length; and how many
    trainable parameters each arm had."""
    cs = [
        abs(c)
        for per in m.get("position_coefficient", {}).values()
        for layers in per.values()
        for c in layers
        if np.isfinite(c)
    ]
    arms = m["training"]
    temps = max(v["temperature_parameters"] for v in arms.values())
    adapters_ = next(iter(arms.values()))["adapter_parameters"]
    counts = (
        f"Trainable parameters: {adapters_:,} adapter parameters in both arms, and "
        f"{temps:,} temperature parameters more in the selective one."
    )
    if not cs:
        return counts
    n = max(cfg.lengths)
    return (
        f"{counts} The position coefficients c ended at most {max(cs):.2g} in size, so the "
        f"position temperature 1 + c·ln n is within {max(cs) * math.log(n):.2g} of 1 at "
        f"{n:,} tokens (a longer context tests the position term only where that is not "
        "negligible)."
    )


def _span(row: dict[str, Any], key: str = "nll_change_") -> str:
    """A row's interval of the change in NLL (``key``: "nll_change_" over seeds and windows,
    "seeds_" over seeds alone; "–" where undefined or not recorded)."""
    low, high = row.get(f"{key}low", float("nan")), row.get(f"{key}high", float("nan"))
    return "–" if not np.isfinite(low) else f"[{low:+.4f}, {high:+.4f}]"


def _invocation(m: dict[str, Any]) -> str:
    return f"{m['wall_seconds']:.0f} s wall and {m['cpu_seconds']:.0f} CPU-s ({m['threads']} thread{'s' * (m['threads'] != 1)})"


def _report(
    folder: Path,
    cfg: Config,
    rows: list[dict],
    table: tuple[str, list, list],
    lines: dict[str, str],
    sections: list[str],
    here: str,
    title: str,
) -> Path:
    """Both studies' report: ``sections[0]``, the table (``name``, header, cells; also written
    as name.csv/.md), the perplexity figure (a line per key of ``lines``), the other sections,
    then the paper's numbers, ``here`` saying what differs from the paper's fine-tuning."""
    name, header, cells = table
    kit.write_table(folder, name, header, cells)
    plot_perplexity(folder / "perplexity.png", rows, cfg.context, lines)
    return kit.write_report(
        folder,
        title,
        [
            sections[0],
            kit.markdown_table(header, cells),
            kit.image("perplexity.png", "held-out perplexity against tokens"),
            *sections[1:],
            "The paper (Table 3, fine-tuning on Wikitext with every weight trained, perplexity "
            "without → with SSA base): GPT-2 36.503 → 34.618, Pythia-160m 26.681 → 26.514, "
            f"Pythia-410m 20.310 → 19.976, Llama 19.764 → 19.305 (−0.6 % to −5.2 %). Here {here}, "
            "and the text is not Wikitext.",
        ],
    )


def summarize(cfg: Config, base: dict[str, list[float]], tuned: dict[str, list[float]]) -> dict:
    """Per length: perplexity of both models (exp of the mean window NLL) and the paired t-test of
    the window NLLs."""
    rows = []
    for length in cfg.lengths:
        a, b = np.asarray(base[str(length)]), np.asarray(tuned[str(length)])
        cmp = paired_comparison(a[:, None], b[:, None])
        rows.append(
            {
                "length": length,
                "factor": length // cfg.context,
                "ppl_base": float(np.exp(a.mean())),
                "ppl_selective": float(np.exp(b.mean())),
                "nll_change": float((b - a).mean()),
                "better_windows": int((b < a).sum()),
                "windows": len(a),
                "p": float(cmp.p_value[0]),
            }
        )
    return {"rows": rows}


def plot_perplexity(path: Path, rows: list[dict], context: int, lines: dict[str, str]) -> None:
    """Held-out perplexity against tokens, a line per key of ``rows`` in ``lines`` (its label),
    the fine-tuning context marked."""
    with kit.figure(path, 1, 1, figsize=(5.5, 3.6), dpi=100) as (_, ax):
        x = [r["length"] for r in rows]
        for (key, label), marker in zip(lines.items(), "os^v", strict=False):
            ax.plot(x, [r[key] for r in rows], f"{marker}-", label=label)
        ax.axvline(context, color="grey", ls=":", lw=1, label="fine-tuning context")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("perplexity (held-out)")
        ax.legend(fontsize=8)


def write(folder: Path, cfg: Config, m: dict[str, Any]) -> Path:
    rows = m["rows"]
    header = [
        "context",
        "tokens",
        "ppl unpatched",
        "ppl selective (trained)",
        "Δ nll (nats)",
        "windows better",
        "p (paired t)",
    ]
    table = [
        [
            f"{r['factor']}×",
            r["length"],
            f"{r['ppl_base']:.3f}",
            f"{r['ppl_selective']:.3f}",
            f"{r['nll_change']:+.4f}",
            f"{r['better_windows']}/{r['windows']}",
            _p(r["p"]),
        ]
        for r in rows
    ]
    coef = m["position_coefficient"]
    form = {
        "position": "position term only: τ = 1 + c·log n",
        "token": "token term only, " + ("weight sharing" if cfg.sharing else "MLP"),
        "both": "weight sharing" if cfg.sharing else "base SSA: MLP token term + position term",
    }[cfg.terms]
    sections = [
        f"{cfg.model}, frozen; selective temperatures on {cfg.targets} ({form}) trained for "
        f"{cfg.steps} AdamW steps (lr {cfg.lr:g}, position {cfg.position_lr:g}) on "
        f"{cfg.batch}×{cfg.context}-token windows: "
        f"{m['trainable_parameters']:,} trainable parameters "
        f"({100 * m['trainable_parameters'] / m['model_parameters']:.2f}% of the model). "
        f"Perplexity on {rows[0]['windows']} held-out windows, the same for both models; p from "
        "a paired t-test of the per-window NLL.",
        f"Step 0 (temperatures at their identity initialisation): NLL moved by "
        f"{m['step0_nll_change']:+.2e} nats from the unpatched model on the first window.",
        "Learned position coefficient c (τ_pos = 1 + c·log n; mean over heads) per layer: "
        + "; ".join(f"{t}: " + ", ".join(f"{c:.3g}" for c in cs) for t, cs in coef.items())
        + ".",
        f"Cost: {m['train_seconds']:.0f} s of training ({m['train_steps_per_s']:.3f} steps/s), "
        f"{_invocation(m)} for this invocation.",
    ]
    lines = {"ppl_base": "unpatched", "ppl_selective": f"selective {cfg.targets}"}
    return _report(
        folder,
        cfg,
        rows,
        ("table3_small", header, table),
        lines,
        sections,
        "only the temperatures learn, the base is frozen",
        "Selective temperatures on a frozen LLM (Table 3 in small)",
    )
