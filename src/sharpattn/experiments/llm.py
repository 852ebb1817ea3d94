"""Studies on a real decoder LLM (SmolLM2-135M, offline): Fig. 3 of *Softmax is not Enough* on the
model, and whether adaptive temperature helps it at inference.

- `max_study`: prompts asking for the maximum of n numbers (n = 2 … 512). Per n: the entropy
  of every layer's attention at the answer position (mean over heads and prompts; the paper:
  layer 0's entropy rises with n) and the model's accuracy at naming the maximum (greedy decoding),
  for softmax, adaptive temperature (both coefficient sets) and training-free length scaling
  (``ssmax``, ``length_scaled`` at fixed parameters), with exact McNemar tests of each method
  against softmax over the same prompts.
- `perplexity_study`: the cost on ordinary text: perplexity of each method on held-out text
  at 256 … 2,048 tokens.

No method is trained: every one is applied to the pretrained weights with
[`sharpattn.hf.apply`][sharpattn.integrations.hf.apply].
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from ..diagnostics import capture
from ..integrations.pretrained import quiet_transformers
from ..lab import memory, runner
from ..lab import report as kit
from ..lab.runner import Clock, Progress, RunFolder, emit, write_metrics

_PROMPTS = 0  # purpose of a run seed (runner.generator(seed, purpose, n))

#: A three-shot completion prompt: SmolLM2-135M-Instruct does not answer the paper's one-line
#: question (nor its chat-template form) with a number, but continues this pattern with one.
PROMPT = (
    "Find the largest number.\nNumbers: 3, 17, 5\nLargest: 17\nNumbers: 42, 8, 29, 11\n"
    "Largest: 42\nNumbers: 6, 61, 70, 15, 2\nLargest: 70\nNumbers: {seq}\nLargest:"
)
TRAIN_CONTEXT = 2048  # SmolLM2's pre-training context
#: SmolLM2-135M as memory estimates see it (`lab.memory`): 30 layers of width 576 with 9 heads
#: and a vocabulary of 49,152 whose embeddings are its output layer; its gated MLP's three
#: matrices of width 1,536 counted as two of 2,304
SMOLLM2_SHAPE = memory.Shape(d_model=576, heads=9, layers=30, vocab=49152, mlp=2304, tied=True)
#: the longest input SmolLM2 takes (its ``max_position_embeddings``)
SMOLLM2_CONTEXT = 8192
#: (label, method, fixed parameters). ssmax with s = 1/log 2048 equals softmax at n = 2048 keys
#: and flattens attention below it; length_scaled with c = 0.05 sharpens by 1 + 0.05·log n.
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("softmax", "softmax", {}),
    ("adaptive (icml)", "adaptive", {"coefficients": "icml"}),
    ("adaptive (arxiv)", "adaptive", {"coefficients": "arxiv"}),
    ("ssmax s=1/log 2048", "ssmax", {"s": 1.0 / math.log(TRAIN_CONTEXT)}),
    ("length_scaled c=0.05", "length_scaled", {"c": 0.05}),
]
QUICK_SIZES = [2, 4, 8, 16, 32, 64, 128]
FULL_SIZES = [2, 4, 8, 16, 32, 64, 128, 256, 512]


def pretrained_shape(name: str) -> tuple[memory.Shape, int] | None:
    """``(shape, context)`` of the pretrained decoder ``name`` for memory estimates, or None for
    a model that is not SmolLM2 (loading it says which models are known)."""
    from ..integrations.pretrained import SMOLLM2, canonical

    return (SMOLLM2_SHAPE, SMOLLM2_CONTEXT) if canonical(name) == SMOLLM2 else None


def max_prompts(n: int, count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` prompts of n random integers in [0, 100) with a unique maximum: (text, answer)."""
    g = runner.generator(seed, _PROMPTS, n)
    out = []
    while len(out) < count:
        xs = torch.randint(0, 100, (n,), generator=g).tolist()
        if xs.count(max(xs)) == 1 or n == 1:
            out.append((PROMPT.format(seq=", ".join(map(str, xs))), max(xs)))
    return out


def _answer(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group()) if m else None


def _set_method(net, method: str, params: dict[str, Any]) -> None:
    from .. import hf

    hf.apply(net, method, **params)


def max_study(
    net,
    tok,
    sizes: list[int],
    prompts: int,
    seed: int = 0,
    methods=None,
    entropy: bool = True,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Accuracy per method and n, and (softmax) per-layer entropy at the answer position; one
    progress event of task "max of n" per method and n."""
    from scipy.stats import binomtest

    methods = METHODS if methods is None else methods
    limit = int(net.config.max_position_embeddings)
    correct: dict[str, dict[int, list[int]]] = {label: {} for label, _, _ in methods}
    ent: dict[int, list[float]] = {}
    tokens: dict[int, float] = {}
    cpu = {}
    total = len(methods) * len(sizes)
    for m, (label, method, params) in enumerate(methods):
        _set_method(net, method, params)
        clock = Clock()
        for i, n in enumerate(sizes):
            row = []
            ent_sum = None
            lengths = []
            for text, answer in max_prompts(n, prompts, seed):
                enc = tok(text, return_tensors="pt")
                length = enc["input_ids"].shape[1]
                if length + 4 > limit:
                    raise ValueError(
                        f"n = {n} needs {length} tokens, beyond the context ({limit})."
                    )
                lengths.append(length)
                with torch.no_grad():
                    gen = net.generate(
                        **enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.eos_token_id
                    )
                row.append(int(_answer(tok.decode(gen[0, length:])) == answer))
                if entropy and method == "softmax":
                    with torch.no_grad(), capture(net, full_until=0, query_block=512) as cap:
                        net(**enc)
                    e = torch.tensor(
                        [
                            float(cap[f"layers.{layer}.attn.entropy"][0, :, -1].mean())
                            for layer in range(cap.num_layers)
                        ]
                    )
                    ent_sum = e if ent_sum is None else ent_sum + e
            correct[label][n] = row
            tokens[n] = sum(lengths) / len(lengths)
            if ent_sum is not None:
                ent[n] = (ent_sum / prompts).tolist()
            emit(progress, "max of n", f"{label} n={n}", m * len(sizes) + i + 1, total)
        cpu[label] = clock.cpu
    accuracy = {
        label: {n: sum(r) / len(r) for n, r in rows.items()} for label, rows in correct.items()
    }
    tests = {}
    base = correct[methods[0][0]]
    for label, rows in correct.items():
        if label == methods[0][0]:
            continue
        a = [x for n in sizes for x in rows[n]]
        b = [x for n in sizes for x in base[n]]
        better = sum(1 for x, y in zip(a, b, strict=True) if x > y)
        worse = sum(1 for x, y in zip(a, b, strict=True) if x < y)
        p = binomtest(better, better + worse, 0.5).pvalue if better + worse else 1.0
        tests[label] = {
            "better": better,
            "worse": worse,
            "p_mcnemar": p,
            "accuracy": sum(a) / len(a),
            "softmax_accuracy": sum(b) / len(b),
        }
    return {
        "sizes": sizes,
        "prompts": prompts,
        "tokens": tokens,
        "accuracy": accuracy,
        "correct": correct,
        "entropy": ent,
        "tests": tests,
        "cpu_seconds": cpu,
    }


def heldout_text() -> str:
    """Held-out prose for perplexity: tinyshakespeare from the shared corpus when present (public
    domain), else the docstrings of Python's standard library (present on every machine)."""
    shared = Path(__file__).resolve().parents[4] / "shared" / "data" / "tinyshakespeare.txt"
    if shared.is_file():
        return shared.read_text(encoding="utf-8")[500_000:]  # a slice far from the start
    import inspect
    import pkgutil

    docs = []
    for mod in pkgutil.iter_modules():
        if mod.name in ("argparse", "textwrap", "collections", "json", "logging", "pathlib"):
            docs.append(inspect.getdoc(__import__(mod.name)) or "")
    return "\n\n".join(docs)


@torch.no_grad()
def window_nll(net: torch.nn.Module, windows: list[torch.Tensor], length: int) -> list[float]:
    """Mean next-token negative log-likelihood (nats) of the first ``length`` tokens of each
    window, one value per window."""
    out = []
    for w in windows:
        x = w[:length][None]
        out.append(float(net(input_ids=x, labels=x).loss))
    return out


def perplexity_study(
    net, tok, lengths: list[int], windows: int, methods=None, progress: Progress | None = None
) -> dict[str, Any]:
    """Perplexity per method and context length on ``windows`` windows of held-out text; one
    progress event of task "perplexity" per method and length."""
    methods = METHODS if methods is None else methods
    ids = tok(heldout_text(), return_tensors="pt")["input_ids"][0]
    limit = int(net.config.max_position_embeddings)
    if max(lengths) > limit:
        raise ValueError(f"length {max(lengths)} is beyond the model's context ({limit}).")
    need = max(lengths) * windows
    if ids.numel() < need:
        raise ValueError(f"the held-out text has {ids.numel()} tokens; {need} are needed.")
    chunks = [ids[w * max(lengths) : (w + 1) * max(lengths)] for w in range(windows)]
    out: dict[str, dict[int, float]] = {}
    cpu = {}
    total = len(methods) * len(lengths)
    for m, (label, method, params) in enumerate(methods):
        _set_method(net, method, params)
        clock = Clock()
        out[label] = {}
        for i, length in enumerate(lengths):
            losses = window_nll(net, chunks, length)
            out[label][length] = math.exp(sum(losses) / len(losses))
            emit(
                progress, "perplexity", f"{label} {length} tokens", m * len(lengths) + i + 1, total
            )
        cpu[label] = clock.cpu
    return {"lengths": lengths, "windows": windows, "perplexity": out, "cpu_seconds": cpu}


def _plot_max(res: dict, path: Path) -> None:
    import numpy as np

    sizes = res["sizes"]
    with kit.figure(path, 1, 2, figsize=(11, 4), dpi=100) as (_, (a, b)):
        if res["entropy"]:
            e = np.asarray([res["entropy"][n] for n in sizes])  # (sizes, layers)
            cmap = kit.pyplot().get_cmap("viridis")
            for layer in range(e.shape[1]):
                a.plot(
                    sizes,
                    e[:, layer],
                    color=cmap(layer / max(e.shape[1] - 1, 1)),
                    lw=2.5 if layer == 0 else 0.8,
                    label="layer 0" if layer == 0 else None,
                )
            a.plot(
                sizes,
                np.log([res["tokens"][n] for n in sizes]),
                "k--",
                lw=1,
                label="log(tokens): uniform",
            )
            a.set_xscale("log", base=2)
            a.set_xlabel("n (numbers in the prompt)")
            a.set_ylabel("entropy at the answer position (nats)")
            a.set_title("softmax: every layer (dark = early), mean over heads", fontsize=9)
            a.legend(fontsize=8)
        for label, acc in res["accuracy"].items():
            b.plot(sizes, [acc[n] for n in sizes], "o-", label=label)
        b.set_xscale("log", base=2)
        b.set_xlabel("n (numbers in the prompt)")
        b.set_ylabel("accuracy at naming the maximum")
        b.set_ylim(-0.02, 1.02)
        b.legend(fontsize=8)


@quiet_transformers()  # loading and running the model: its warnings silenced, then restored
def run(
    out: str | Path = "runs/llm",
    model: str = "smollm2-135m",
    quick: bool = True,
    prompts: int | None = None,
    seed: int = 0,
    threads: int | None = 2,
    progress: Progress | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Both studies; writes metrics.json, report.md and max.png into ``out``. ``threads``: torch
    CPU threads (None: every core); ``progress`` receives the runner's events (tasks "max of n"
    and "perplexity")."""
    from ..integrations.pretrained import load_pretrained

    with runner.threads(threads) as n_threads:
        clock = Clock()
        net, tok = load_pretrained(model)
        sizes = QUICK_SIZES if quick else FULL_SIZES
        prompts = (8 if quick else 40) if prompts is None else prompts
        lengths = [256, 512, 1024, 2048]
        windows = 1 if quick else 4
        config = {"model": model, "quick": quick, "prompts": prompts, "seed": seed}
        # the thread count does not change the numbers
        folder = RunFolder(out, "llm", {**config, "threads": n_threads}, identity=list(config))
        res = max_study(net, tok, sizes, prompts, seed, progress=progress)
        ppl = perplexity_study(net, tok, lengths, windows, progress=progress)
        metrics = {
            "model": model,
            "max": res,
            "perplexity": ppl,
            "wall_seconds": clock.wall,
            "cpu_seconds": clock.cpu,
            "threads": n_threads,
        }
        _plot_max(res, folder / "max.png")
        write_metrics(folder, metrics)
        report(folder.path, metrics)
        return folder.path, metrics


def report(folder: Path, m: dict[str, Any]) -> Path:
    """Write ``folder``/report.md from the metrics ``m`` of `run`."""
    res, ppl = m["max"], m["perplexity"]
    sizes = res["sizes"]
    rows = []
    for label, acc in res["accuracy"].items():
        t = res["tests"].get(label)
        vs = "—" if t is None else f"+{t['better']}/−{t['worse']}, p = {t['p_mcnemar']:.3g}"
        total = sum(sum(r) for r in res["correct"][label].values()) / (len(sizes) * res["prompts"])
        rows.append([label, *(f"{acc[n]:.2f}" for n in sizes), f"{total:.2f}", vs])
    header = ["method", *(f"n={n}" for n in sizes), "all", "vs softmax (+/−, McNemar p)"]
    accuracy = kit.markdown_table(header, rows)
    if res["entropy"]:
        accuracy += (
            "\nLayer-0 entropy at the answer position (softmax, nats): "
            + ", ".join(f"n={n}: {res['entropy'][n][0]:.2f}" for n in sizes)
            + ".\n"
        )
    perplexity = kit.markdown_table(
        ["method", *(f"{n} tokens" for n in ppl["lengths"])],
        [
            [label, *(f"{row[n]:.2f}" for n in ppl["lengths"])]
            for label, row in ppl["perplexity"].items()
        ],
    )
    sections = [
        f"{res['prompts']} prompts per n; greedy decoding; no method trained. Wall "
        f"{m['wall_seconds']:.0f} s, CPU {m['cpu_seconds']:.0f} s ({m['threads']} thread{'s' * (m['threads'] != 1)}).",
        "![max](max.png)",
        accuracy,
        f"## Perplexity on held-out text ({ppl['windows']} window(s) per length)",
        perplexity,
    ]
    title = f"{m['model']}: max of n numbers and perplexity per attention method"
    return kit.write_report(folder, title, sections)
