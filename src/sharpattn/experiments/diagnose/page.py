"""The figures and report.md of a `sharpattn diagnose` run."""

from __future__ import annotations

from pathlib import Path

from ...diagnostics import (
    dispersion_horizon,
)
from ...lab import report as kit
from .measures import EPS, GEMMA_2B, PROMPT


def plot_probe(sizes, curves: dict[str, list[list[float]]], tokens, path: Path, title: str) -> None:
    import numpy as np

    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    with kit.figure(path, figsize=(7, 4.2)) as (_, ax):
        for (label, per_n), color in zip(curves.items(), colors, strict=False):
            e = np.asarray(per_n)  # (sizes, H)
            ax.plot(sizes, e, color=color, lw=0.5, alpha=0.35)
            mean, std = e.mean(1), e.std(1)
            ax.plot(sizes, mean, color=color, lw=2, label=f"{label}: mean over heads")
            ax.fill_between(sizes, mean - std, mean + std, color=color, alpha=0.2)
        ax.plot(sizes, np.log(tokens), "k--", lw=1, label="log(tokens up to the answer): uniform")
        ax.set_xlabel("number of items in the sequence")
        ax.set_ylabel("attention entropy at the answer token (nats)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)


def plot_spread(spread: list[list[float]], path: Path) -> None:
    import numpy as np

    flat = np.concatenate([np.asarray(s) for s in spread])
    with kit.figure(path, 1, 2, figsize=(10, 3.8)) as (_, (a, b)):
        a.hist(flat, bins=30, color="tab:blue", alpha=0.8)
        a.axvspan(
            GEMMA_2B["min"], GEMMA_2B["max"], color="tab:orange", alpha=0.15, label="Gemma 2B range"
        )
        a.axvline(GEMMA_2B["mean"], color="tab:orange", lw=1.5, label="Gemma 2B mean")
        a.set_xlabel("logit spread δ per head")
        a.set_ylabel("heads")
        a.legend(fontsize=8)
        for layer, s in enumerate(spread):
            n_star = dispersion_horizon(np.asarray(s), eps=EPS).cpu().numpy()
            b.scatter([layer] * len(s), np.log10(n_star), s=10)
        b.set_xlabel("layer")
        b.set_ylabel(f"log10 n* = log10(e^δ/{EPS})")
        b.set_title("dispersion horizon per head (Lemma 2.1)", fontsize=10)


def plot_extreme(extreme: dict, ablation: dict, path: Path) -> None:
    import numpy as np

    size = (15 if ablation else 11.5, 3.4)
    with kit.figure(path, 1, 4 if ablation else 3, figsize=size, dpi=110) as (_, axes):
        for domain, res in extreme.items():
            L = np.arange(len(res["layers"]))
            for ax, key in zip(axes, ("sink_mass_top", "value_drain"), strict=False):
                ax.plot(L, [np.mean(x[key]) for x in res["layers"]], "o-", label=domain)
            axes[2].plot(
                L, [x.get("residual_peak", np.nan) for x in res["layers"]], "o-", label=domain
            )
            if ablation:
                d = np.asarray(ablation[domain])
                axes[3].plot(L, d.max(1), "o-", label=f"{domain}: max over heads")
        titles = [
            "sink mass Ā of top sink (mean over heads)",
            "value drain ‖Val_sink‖/mean ‖Val_other‖",
            "residual peak ‖Res_sink‖/mean ‖Res_other‖",
            "loss change when a head is zeroed",
        ]
        for ax, t in zip(axes, titles, strict=False):
            ax.set_title(t, fontsize=9)
            ax.set_xlabel("layer")
            ax.legend(fontsize=7)
        axes[1].axhline(1, color="k", lw=0.5)
        axes[2].axhline(1, color="k", lw=0.5)


def _max_or_dash(ablation, domain, layer) -> str:
    return "-" if ablation is None else f"{max(ablation[domain][layer]):.4f}"


def mean_of(xs) -> float:
    return float(sum(xs) / len(xs))


def summary_markdown(metrics: dict) -> str:
    """The command's summary: logit spread and horizon, layer-0 probe entropies, the sink token
    and residual peak per layer of each domain, dormant heads."""
    s = metrics["summary"]
    sp = s["spread"]
    rows = [
        [
            "logit spread δ per head (code)",
            f"{sp['min']:.2f} / {sp['mean']:.2f} / {sp['max']:.2f} (min/mean/max)",
        ],
        ["Gemma 2B (paper)", "2.28 / 5.69 / 14.78"],
        [
            f"horizon n* = e^δ/{s['horizon_eps']}",
            f"min {s['horizon_min']:.3g}, median {s['horizon_median']:.3g}",
        ],
    ]
    for key in [k for k in s if k.startswith("probe_entropy_layer0")]:
        rows.append([key.replace("_", " "), ", ".join(f"{k}: {v:.3f}" for k, v in s[key].items())])
    for domain, res in metrics["extreme"].items():
        first = res["layers"]
        rows.append(
            [
                f"{domain}: sink token per layer",
                " ".join(f"{x['layer_sink']}:{x['layer_sink_token']}" for x in first),
            ]
        )
        rows.append(
            [
                f"{domain}: residual peak per layer",
                " ".join(f"{x.get('residual_peak', float('nan')):.2f}" for x in first),
            ]
        )
    rows.append(["dormant heads", ", ".join(f"{d}: {n}" for d, n in s["dormant_heads"].items())])
    return kit.markdown_table(["quantity", "value"], rows)


def report(folder: Path, metrics: dict, probe_layers: list[int]) -> Path:
    """Write ``folder``/report.md from ``metrics``."""
    s = metrics["summary"]
    sp = s["spread"]
    probe = "\n".join(f"![probe layer {layer}](probe_layer{layer}.png)" for layer in probe_layers)
    probe_rows = [
        [key, *(f"{v:.3f}" for v in list(s[key].values())[:2])]
        for key in s
        if key.startswith("probe_entropy_layer0")
    ]
    spread_rows = [
        [str(layer), f"{min(d):.2f}", f"{sum(d) / len(d):.2f}", f"{max(d):.2f}", f"{min(h):.3g}"]
        for layer, (d, h) in enumerate(zip(metrics["spread"], metrics["horizon"], strict=True))
    ]
    extreme = ["## (c) Extreme tokens\n\n![extreme](extreme.png)\n"]
    for domain, res in metrics["extreme"].items():
        rows = []
        for layer, x in enumerate(res["layers"]):
            massive = (
                f"{x['massive_top'][0]:.1f} ({x['massive_ratio']:.0f}×, token {x['massive_token']})"
                if "massive_top" in x
                else "-"
            )
            rows.append(
                [
                    str(layer),
                    f"{x['layer_sink']} `{x['layer_sink_token']}`",
                    f"{x['sink_share']:.2f}",
                    f"{mean_of(x['sink_mass_top']):.3f}",
                    f"{mean_of(x['value_drain']):.3f}",
                    f"{x.get('residual_peak', float('nan')):.3f}",
                    massive,
                    _max_or_dash(metrics["ablation"], domain, layer),
                ]
            )
        header = [
            "layer",
            "sink token",
            "heads with a sink (Ā > 0.3)",
            "mean Ā of top sink",
            "value drain (mean)",
            "residual peak",
            "top activation (× median)",
            "max loss change, head zeroed",
        ]
        extreme.append(
            f"### {domain} ({res['tokens']} tokens)\n\n"
            + kit.markdown_table(header, rows, "llrrrrrr")
        )
    dormant = [
        f"Dormant heads (loss change <= {s['dormant_threshold']} when zeroed): "
        + ", ".join(f"{d}: {n}" for d, n in s["dormant_heads"].items())
        + "."
    ]
    for key, text in (
        ("active_code_dormant_prose", "active on code, dormant on prose"),
        ("active_prose_dormant_code", "active on prose, dormant on code"),
    ):
        if key in s:
            heads = ", ".join(f"L{a}H{b}" for a, b in s[key]) or "none"
            dormant.append(f"Heads {text} (Guo et al. Fig. 8b): {heads}.")
    sections = [
        f"{s['layers']} layers × {s['heads_per_layer']} heads ({s['kind']}).",
        "## (a) Figure 3 probe\n\nEntropy of each head's attention at the answer token of "
        f"“{PROMPT}” for 2 … {metrics['probe']['sizes'][-1]} items (mean of the random draws).\n\n"
        f"{probe}\n\n" + kit.markdown_table(["", "entropy, n=2", "entropy, n=max"], probe_rows),
        f"## (b) Logit spread δ ({s['code_tokens']} tokens of code)\n\n"
        f"δ per head: min {sp['min']:.2f}, mean {sp['mean']:.2f} ± {sp['std']:.2f}, max "
        f"{sp['max']:.2f} (Gemma 2B in the paper: [2.28, 14.78], mean 5.69). Dispersion horizon "
        f"n* = e^δ/{s['horizon_eps']}: smallest {s['horizon_min']:.3g}, median "
        f"{s['horizon_median']:.3g} items.\n\n![spread](spread.png)\n\n"
        + kit.markdown_table(["layer", "δ min", "δ mean", "δ max", "n* min"], spread_rows),
        *extreme,
        "\n\n".join(dormant),
    ]
    return kit.write_report(folder, f"sharpattn diagnose: {s['model']}", sections)
