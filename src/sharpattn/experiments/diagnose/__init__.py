"""`sharpattn diagnose`: dispersion and extreme tokens of a (Hugging Face) model, offline.

(a) Figure 3 probe (Veličković et al.): entropy of every head of layer 0 (and ``layers``) on
    "What is the maximum in the following sequence: {seq}? The maximum is:" for 2 … N items,
    measured at the prompt's last real token (the one that must answer).
(b) Logit spread δ of every head of every layer on the code sample, and its dispersion horizon
    n* = e^{δ}/ε (θ = 1; Lemma 2.1), next to the paper's Gemma 2B δ ∈ [2.28, 14.78], mean 5.69.
(c) Extreme tokens (Guo et al.) per layer on a prose and a code sample: sink mass of the top sink,
    value-state drain, residual-state peak, and the active/dormant test (loss change when a head is
    zeroed; next-token loss for causal LMs, 1 − cosine of the mean-pooled output otherwise).
(d) With ``method``: (a) again with the model switched to that method, both curves on one plot.

The modules: `measures` (loading, the probe, the samples, extreme tokens, a head's ablation
loss) and `page` (figures and report.md); this one runs them and re-exports their public names.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import torch

from ...diagnostics import dispersion_horizon, head_ablation, side_by_side
from ...diagnostics.samples import SAMPLES
from ...integrations.pretrained import quiet_transformers
from ...lab import runner
from ...lab.runner import Progress, RunFolder, emit, write_metrics
from .measures import (
    EPS,
    GEMMA_2B,
    PROMPT,
    SINK_THRESHOLD,
    STREAM_LOAD,
    STREAM_PROBE,
    ablation_loss,
    code_sample,
    default_out,
    domain_texts,
    extreme_tokens,
    load,
    probe,
    resolve_model,
)
from .page import (
    mean_of,
    plot_extreme,
    plot_probe,
    plot_spread,
    report,
    summary_markdown,
)

__all__ = [
    "EPS",
    "GEMMA_2B",
    "PROMPT",
    "SINK_THRESHOLD",
    "STREAM_LOAD",
    "STREAM_PROBE",
    "code_sample",
    "default_out",
    "domain_texts",
    "extreme_tokens",
    "load",
    "ablation_loss",
    "mean_of",
    "plot_extreme",
    "plot_probe",
    "plot_spread",
    "probe",
    "report",
    "resolve_model",
    "run",
    "summary_markdown",
]


@quiet_transformers()  # loading and running the model: its warnings silenced, then restored
def run(
    out: str | Path | None = None,
    model: str | None = None,
    method: str | None = None,
    layers: list[int] | None = None,
    max_items: int = 48,
    repeats: int = 3,
    seed: int = 0,
    dormant_threshold: float = 0.01,
    threads: int | None = None,
    ablation: bool = True,
    progress: Progress | None = None,
    ablation_tokens: int = 256,
    **method_params,
) -> tuple[Path, dict[str, Any]]:
    """Run the four diagnostics and write report.md, PNGs and metrics.json into ``out`` (default:
    `default_out` of the model and method).

    ``ablation=False`` skips the active/dormant test (one forward pass per head and domain, a
    layer's heads side by side in one batch). ``threads``: CPU threads (default: every core). The
    ablation's passes and the two domains' extreme-token passes run that many at a time, each in
    its own thread on its own copy of the model with one torch thread: on cores shared with
    other work no thread waits for a descheduled one inside a matrix product (intra-op threads
    do), so a busy core costs its share, not the whole run. ``progress`` receives the runner's
    events (tasks "probe", "extreme tokens", "head ablation", "probe (<method>)").
    """
    workers = runner.cores() if threads is None else max(1, int(threads))
    if out is None:
        out = default_out(model, method)
    with runner.threads(1):
        return _run(
            out,
            model,
            method,
            layers,
            max_items,
            repeats,
            seed,
            dormant_threshold,
            ablation,
            progress,
            method_params,
            ablation_tokens,
            workers,
        )


def _run(
    out,
    model,
    method,
    layers,
    max_items,
    repeats,
    seed,
    dormant_threshold,
    ablate,
    progress,
    method_params,
    ablation_tokens=256,
    workers=1,
):
    from ... import hf
    from ... import normalizers as nz

    if method is not None:
        nz.get(method)  # unknown method: one sentence before any loading
    if max_items < 2:
        raise ValueError(f"max_items must be >= 2, got {max_items}.")
    with runner.seeded(seed, STREAM_LOAD):  # weights a checkpoint lacks are drawn at random
        tok, net, label, kind = load(model)
    n_layers = len(hf.attention_modules(net))
    probe_layers = sorted({0, *(layers or [])})
    bad = [x for x in probe_layers if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"--layers {bad} out of range: the model has layers 0..{n_layers - 1}.")
    config = {
        "model": label,
        "method": method,
        "method_params": method_params,
        "layers": probe_layers,
        "max_items": max_items,
        "repeats": repeats,
        "seed": seed,
        "ablation": ablate,
        "ablation_tokens": ablation_tokens,
        "dormant_threshold": dormant_threshold,
        "threads": workers,
    }
    # every setting but the thread count changes the numbers
    folder = RunFolder(out, "diagnose", config, identity=sorted(set(config) - {"threads"}))
    run_dir = folder.path

    # (a) Figure 3 probe
    sizes, entropy = probe(tok, net, probe_layers, max_items, repeats, seed, progress)
    tokens = entropy.pop("tokens")
    # (b), (c)
    extreme, encoded = {}, {}
    texts = domain_texts()
    copies = [net] + [copy.deepcopy(net) for _ in range(min(workers, len(texts)) - 1)]
    done, lock = [], threading.Lock()  # the domains finish in any order, in worker threads
    emit(progress, "extreme tokens", "start", 0, len(texts))

    def measure(replica, domain, text):
        result = extreme_tokens(tok, replica, text, kind == "causal-lm")
        with lock:
            done.append(domain)
            emit(progress, "extreme tokens", domain, len(done), len(texts))
        return result

    results = side_by_side(measure, list(texts.items()), copies)
    del copies
    for domain, (extreme[domain], enc) in zip(texts, results, strict=True):
        # the active/dormant test runs one forward pass per head: on the first ablation_tokens
        encoded[domain] = {k: v[:, :ablation_tokens] for k, v in enc.items()}
    heads = [
        (layer, h)
        for layer in range(n_layers)
        for h in range(len(extreme["code"]["layers"][layer]["spread"]))
    ]
    ablation = None
    if ablate:
        loss_fn = ablation_loss(kind, net)
        # each head still gets its own forward pass with only it zeroed; one layer's heads run side
        # by side (batch), and the layers before it are not recomputed (reuse_prefix)
        per_layer = max(h for _, h in heads) + 1
        deltas = {}
        for i, (d, e) in enumerate(encoded.items()):
            emit(progress, "head ablation", d, i, len(encoded))
            deltas |= head_ablation(
                net, loss_fn, {d: [e]}, heads, batch=per_layer, reuse_prefix=True, workers=workers
            )
        emit(progress, "head ablation", "done", len(encoded), len(encoded))
        ablation = {
            d: [
                [deltas[d][(layer, h)] for h in range(len(extreme[d]["layers"][layer]["spread"]))]
                for layer in range(n_layers)
            ]
            for d in encoded
        }
    # (d)
    entropy_method = None
    if method is not None:
        hf.apply(net, method, **method_params)
        _, entropy_method = probe(
            tok, net, probe_layers, max_items, repeats, seed, progress, f"probe ({method})"
        )
        entropy_method.pop("tokens")

    spread = [x["spread"] for x in extreme["code"]["layers"]]
    flat = [s for layer in spread for s in layer]
    horizon = [dispersion_horizon(torch.tensor(s), eps=EPS).tolist() for s in spread]
    summary = {
        "model": label,
        "kind": kind,
        "layers": n_layers,
        "heads_per_layer": len(spread[0]),
        "code_tokens": extreme["code"]["tokens"],
        "prose_tokens": extreme["prose"]["tokens"],
        "spread": {
            "min": min(flat),
            "mean": sum(flat) / len(flat),
            "max": max(flat),
            "std": float(torch.tensor(flat).std()),
        },
        "horizon_eps": EPS,
        "horizon_min": min(min(h) for h in horizon),
        "horizon_median": float(torch.tensor(horizon).flatten().median()),
        "probe_entropy_layer0": {
            "n=2": mean_of(entropy[0][0]),
            f"n={sizes[-1]}": mean_of(entropy[0][-1]),
        },
    }
    if entropy_method is not None:
        summary[f"probe_entropy_layer0_{method}"] = {
            "n=2": mean_of(entropy_method[0][0]),
            f"n={sizes[-1]}": mean_of(entropy_method[0][-1]),
        }
    if ablation is not None:
        dormant = {
            d: sum(1 for row in ablation[d] for x in row if x <= dormant_threshold)
            for d in ablation
        }
        summary["dormant_heads"] = {d: f"{n}/{len(heads)}" for d, n in dormant.items()}
        # Guo et al. Fig. 8b: heads active (loss change > threshold) on one domain, dormant on the other
        if {"code", "prose"} <= set(ablation):
            c, p = ablation["code"], ablation["prose"]
            summary["active_code_dormant_prose"] = [
                [layer, h]
                for layer, h in heads
                if c[layer][h] > dormant_threshold and p[layer][h] <= dormant_threshold
            ]
            summary["active_prose_dormant_code"] = [
                [layer, h]
                for layer, h in heads
                if p[layer][h] > dormant_threshold and c[layer][h] <= dormant_threshold
            ]
        summary["ablation_tokens"] = ablation_tokens
    else:
        summary["dormant_heads"] = {d: "not measured" for d in SAMPLES}
    summary["dormant_threshold"] = dormant_threshold

    for layer in probe_layers:
        curves = {"softmax": entropy[layer]}
        if entropy_method is not None:
            curves[method] = entropy_method[layer]
        plot_probe(
            sizes,
            curves,
            tokens,
            run_dir / f"probe_layer{layer}.png",
            f"{label}: layer {layer} heads on the max-of-sequence prompt",
        )
    plot_spread(spread, run_dir / "spread.png")
    plot_extreme(extreme, ablation, run_dir / "extreme.png")
    metrics = {
        "summary": summary,
        "probe": {
            "sizes": sizes,
            "tokens": tokens,
            "entropy": {str(k): v for k, v in entropy.items()},
        },
        "probe_method": None
        if entropy_method is None
        else {"method": method, "entropy": {str(k): v for k, v in entropy_method.items()}},
        "spread": spread,
        "horizon": horizon,
        "extreme": extreme,
        "ablation": ablation,
    }
    write_metrics(run_dir, metrics)
    report(run_dir, metrics, probe_layers)
    return run_dir, metrics
