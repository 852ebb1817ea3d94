"""`sharpattn reproduce selective`'s character language model (our experiment in the shape of
Zhang et al.'s Tables 5-6 and Fig. 2; the paper's are Wikitext fine-tuning perplexities of
Pythia-160m / GPT-2).

Tiny Shakespeare characters, the tiny transformer of `sharpattn.models.transformer` with 4
layers, d = 128, rotary positions, trained at context 256; vanilla vs selective temperatures on
q, v, qv with the token term, the position term or both, and on k and k, q, v with both (Table 5);
validation loss at 256, 512 and 1024 characters, and Fig. 2's spikiness and ‖W_q·W_kᵀ‖. The text
is read from ``--text`` (default: `PACKAGED_TEXT`, the first 100 KB of tiny Shakespeare,
shipped with the package).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.selective import parameter_overhead
from ..diagnostics import qk_operator_norm, spikiness
from ..lab import report
from ..lab.runner import Progress, Trainer, emit, generator, seeded
from ..lab.runs import check_memory
from .paper_numbers import TABLES_5_6_LOWER
from .selective_common import (
    DATA,
    FIG2_CLAIMS,
    FIG2_METRICS,
    INIT,
    LM,
    compare,
    fig2_markdown,
    finish,
    mean_cell,
    store,
    verdict_markdown,
)

# The paper's Tables 5-6 (fine-tuning Pythia-160m / GPT-2 on Wikitext, perplexity): printed beside
# ours for the shape of the comparison only; our numbers are character-level losses of tiny models.
#: the direction of Tables 5-6 (selective lowers the perplexity), as a claim on our losses
LM_CLAIM = TABLES_5_6_LOWER
PAPER_LM = {  # variant: (Pythia ppl, GPT-2 ppl)
    "vanilla": ("28.781", "36.503"),
    "q · both": ("27.416", "34.832"),
    "q · position": ("27.995", "34.970"),
    "q · token": ("27.503", "35.064"),
    "v · both": ("27.980", "35.857"),
    "v · position": ("28.342", "36.320"),
    "v · token": ("27.975", "35.617"),
    "qv · both": ("26.514", "34.618"),
    "k · both": ("28.715", "36.443"),
    "kqv · both": ("26.603", "34.609"),  # Table 5
}

# Table 6's q / v × terms grid, then Table 5's key rows (key temperatures "similar to, or even
# worse than" vanilla; K, Q, V together about as good as Q, V)
LM_VARIANTS = (
    ("vanilla",)
    + tuple(f"{t} · {terms}" for t in ("q", "v", "qv") for terms in ("both", "token", "position"))
    + ("k · both", "kqv · both")
)


def lm_variant(name: str) -> str:
    """``"vanilla"`` or "targets · terms" from "qv·both", "qv:both", "qv-both" or "qv both"."""
    parts = [p for p in re.split(r"[\s·:\-/]+", name.strip()) if p]
    canonical = (
        " · ".join(parts) if len(parts) == 2 else "vanilla" if parts == ["vanilla"] else None
    )
    if canonical not in LM_VARIANTS:
        raise ValueError(
            f"unknown language-model variant {name!r}: use vanilla, q|v|qv:both|token|position, "
            "k:both or kqv:both (e.g. qv:both)."
        )
    return canonical


#: The language model's default text, shipped with the package: the first 99,843 characters
#: (whole speeches) of tiny Shakespeare (public domain). The full corpus (1.1 MB) is what the
#: documented --paper numbers used: ``--text PATH`` reads it (or any plain-text file).
PACKAGED_TEXT = "tinyshakespeare_100k.txt"


def default_text_path() -> Path:
    """The packaged excerpt of tiny Shakespeare (`PACKAGED_TEXT`)."""
    return Path(str(resources.files("sharpattn.tasks").joinpath("data", PACKAGED_TEXT)))


#: bytes per byte of a text file while the language model reads it: the text and its
#: characters' ids as a list and as a tensor (18 measured on ASCII text)
TEXT_BYTES = 32


def load_text(path: str | Path | None = None) -> str:
    """The training text (default `default_text_path`); a missing file, or one too large for
    the memory available (`TEXT_BYTES` per byte), is one sentence."""
    path = Path(path) if path is not None else default_text_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"no text file at {path}: pass --text PATH to a plain-text corpus such as tiny "
            "Shakespeare."
        )
    size = path.stat().st_size
    check_memory(TEXT_BYTES * size, f"reading the {size:,}-byte text {path}", "--text files")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {e.start} cannot be decoded); pass --text a "
            "plain-text file."
        ) from None
    if len(set(text)) < 2 or len(text) < 10_000:
        raise ValueError(f"{path} is too small for the language model ({len(text)} characters).")
    return text


def char_corpus(text: str, val_fraction: float = 0.1):
    """(train ids, validation ids, vocabulary): characters, sorted vocabulary, the last
    ``val_fraction`` of the text held out."""
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:], vocab


@dataclass
class LMConfig:
    """Character LM on tiny Shakespeare: the tiny transformer with rotary positions."""

    layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    context: int = 256
    eval_contexts: tuple[int, ...] = (256, 512, 1024)
    steps: int = 2000
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 100
    seeds: int = 3
    eval_tokens: int = 65536  # validation tokens per context (whole windows of that length)
    sharing: bool = False  # token term: the MLP (base SSA) or weight sharing
    variants: tuple[str, ...] = LM_VARIANTS
    text: str | None = None  # default: default_text_path(), the packaged excerpt


def lm_model(cfg: LMConfig, vocab: int, variant: str, seed: int):
    """The model of ``variant`` ("vanilla" or "q|v|qv · both|token|position"). Every variant of
    one seed starts from the same base weights (the vanilla model's), so comparisons are paired."""
    from ..models.transformer import Transformer, TransformerConfig

    def build(selective=None, terms="both"):
        with seeded(seed, LM, INIT):
            return Transformer(
                TransformerConfig(
                    vocab_size=vocab,
                    n_out=vocab,
                    d_model=cfg.d_model,
                    n_heads=cfg.n_heads,
                    layers=cfg.layers,
                    positions="rotary",
                    selective=selective,
                    selective_terms=terms,
                    sharing=cfg.sharing,
                )
            )

    if variant == "vanilla":
        return build()
    targets, terms = (part.strip() for part in variant.split("·"))
    model = build(targets, terms)
    missing, unexpected = model.load_state_dict(build().state_dict(), strict=False)
    assert not unexpected and all(".selective." in k for k in missing)
    return model


@torch.no_grad()
def lm_evaluate(model, val: torch.Tensor, context: int, tokens: int, batch: int = 8) -> float:
    """Mean next-character cross-entropy (nats) over non-overlapping windows of ``context``
    characters from the start of ``val``, about ``tokens`` predicted characters in all."""
    n = max(1, min(tokens // context, (len(val) - 1) // context))
    windows = torch.stack([val[i * context : i * context + context + 1] for i in range(n)])
    model.eval()
    total = 0.0
    for chunk in windows.split(batch):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
    model.train()
    return float(total) / (n * context)


@torch.no_grad()
def lm_fig2(model, val: torch.Tensor, context: int, tokens: int = 1000) -> dict:
    """Fig. 2's two measures on the first ``tokens`` validation characters (windows of
    ``context``, as the paper's "first 1000 tokens of Wikitext"), mean over layers:

    - spikiness ‖s‖₁/(‖s‖₂²·n) of every causal attention row (n = keys the row sees), mean over
      rows, heads and windows (1 = uniform, 1/n = one-hot; the paper: 0.39 vanilla, 0.26 SSA);
    - ‖W‖ = ‖W_q,h·W_k,hᵀ‖₂ per head (q_proj, k_proj rows of head h; without biases, rotation
      and the 1/√d_head scale, which every variant shares), mean over heads, and the effective
      τ_q·‖W‖ per query token (Sec. 4.1: W_a = τ(a)·W), mean over tokens and heads (paper:
      ‖W‖ about 3× smaller with query temperatures).
    """
    from ..attention import MultiheadAttention
    from ..diagnostics import capture

    n = max(1, math.ceil(tokens / context))
    windows = torch.stack([val[i * context : (i + 1) * context] for i in range(n)])
    attn = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    taus: dict[int, torch.Tensor] = {}
    hooks = [
        m.selective["q"].register_forward_hook(lambda _m, _a, out, i=i: taus.__setitem__(i, out))
        for i, m in enumerate(attn)
        if m.selective is not None and "q" in m.selective
    ]
    was_training = model.training
    model.eval()
    try:
        with capture(model) as cap:
            model(windows)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    layers = sorted(int(k.split(".")[1]) for k in cap.names() if k.endswith(".attn.weights"))
    if len(layers) != len(attn):
        raise ValueError("lm_fig2 needs one attention module per layer.")
    visible = torch.arange(1, context + 1, dtype=torch.float64)
    spiky, norms, effective = [], [], []
    for i, m in enumerate(attn):
        w = cap[f"layers.{layers[i]}.attn.weights"]  # (B, H, L, L), 0 above the diagonal
        spiky.append(spikiness(w, visible).mean().item())
        h, hd = m.num_heads, m.head_dim
        wq = m.q_proj.weight.view(h, hd, -1).transpose(1, 2)  # (H, d, hd)
        wk = m.k_proj.weight.view(m.num_kv_heads, hd, -1).transpose(1, 2)
        wk = wk.repeat_interleave(h // m.num_kv_heads, dim=0)
        norm = qk_operator_norm(wq, wk)  # (H,)
        norms.append(norm.mean().item())
        tau = taus.get(i)
        tau = torch.ones(1, h, 1, dtype=torch.float64) if tau is None else tau.double()
        effective.append((tau * norm.view(1, h, 1)).mean().item())
    return dict(
        spikiness=float(np.mean(spiky)),
        qk_norm=float(np.mean(norms)),
        effective_qk_norm=float(np.mean(effective)),
        spikiness_by_layer=spiky,
        qk_norm_by_layer=norms,
        effective_qk_norm_by_layer=effective,
        tokens=n * context,
    )


def lm_train(
    folder: Path,
    cfg: LMConfig,
    train,
    val,
    vocab: int,
    variant: str,
    seed: int,
    progress: Progress | None = None,
    stop_at: int | None = None,
    checkpoint_every: int = 1000,
) -> dict | None:
    """Train one (variant, seed) in ``folder``: AdamW, linear warmup then cosine decay, gradient
    clipping at 1; the batches depend on the seed only (paired variants). Returns validation
    losses at every eval context and the first / last training losses."""
    model = lm_model(cfg, vocab, variant, seed)
    data = generator(seed, LM, DATA)

    def batch(step: int) -> torch.Tensor:
        start = torch.randint(len(train) - cfg.context - 1, (cfg.batch,), generator=data)
        return torch.stack([train[s : s + cfg.context + 1] for s in start.tolist()])

    def loss(model, chunk: torch.Tensor) -> torch.Tensor:
        logits = model(chunk[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())

    def schedule(i: int) -> float:
        warmup = min(1.0, (i + 1) / max(1, cfg.warmup))
        return warmup * 0.5 * (1 + math.cos(math.pi * min(i, cfg.steps) / cfg.steps))

    trainer = Trainer(
        folder,
        model,
        torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01),
        steps=cfg.steps,
        batch=batch,
        loss=loss,
        generators={"data": data},
        checkpoint_every=checkpoint_every,
        log_every=1,
        lr_schedule=schedule,
        clip_grad_norm=1.0,
        task=f"lm {variant} seed {seed}",
        progress=progress,
    )

    def evaluate(state) -> dict:
        losses = [r["loss"][0] for r in trainer.metrics.read() if r["loss"] is not None]
        val_loss = {}
        for i, c in enumerate(cfg.eval_contexts):
            emit(progress, trainer.task, f"eval {c}", i, len(cfg.eval_contexts))
            val_loss[str(c)] = lm_evaluate(model, val, c, cfg.eval_tokens)
        emit(progress, trainer.task, "done", len(cfg.eval_contexts), len(cfg.eval_contexts))
        overhead = parameter_overhead(model)
        return dict(
            variant=variant,
            seed=seed,
            val_loss=val_loss,
            train_seconds=state["seconds"],
            first_train_loss=float(np.mean(losses[:10])),
            last_train_loss=float(np.mean(losses[-50:])),
            added_parameters=overhead.added,
            base_parameters=overhead.base,
            fig2=lm_fig2(model, val, cfg.context),
        )

    shape = {
        "variant": str,
        "seed": int,
        "val_loss": {str: float},
        "train_seconds": float,
        "first_train_loss": float,
        "last_train_loss": float,
        "added_parameters": int,
        "base_parameters": int,
        "fig2": None,
    }
    return finish(trainer, stop_at, evaluate, shape)


def summarize_lm(runs: list[dict], variants, contexts) -> list[dict]:
    """Per variant and context: mean ± sd over seeds, paired p-value against vanilla."""
    rows = []
    vanilla = sorted((r for r in runs if r["variant"] == "vanilla"), key=lambda r: r["seed"])
    table = lambda rs: [[r["val_loss"][str(c)] for c in contexts] for r in rs]  # noqa: E731
    for v in variants:
        rs = sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"])
        row = dict(
            variant=v,
            seeds=len(rs),
            added_parameters=rs[0]["added_parameters"],
            base_parameters=rs[0]["base_parameters"],
        )
        paired = [r["seed"] for r in rs] == [r["seed"] for r in vanilla]
        claims = [LM_CLAIM] * len(contexts)
        for c, col in zip(
            contexts, compare(table(rs), table(vanilla if paired else rs), claims), strict=True
        ):
            store(row, f"loss_{c}", col)
            row[f"sd_{c}"], row[f"p_{c}"] = col.sd, col.p
        if all("fig2" in r for r in rs + vanilla):  # runs before Fig. 2 lack it
            fig2 = lambda rs: [[r["fig2"][k] for k in FIG2_METRICS] for r in rs]  # noqa: E731
            base = vanilla if paired else rs
            claims = [FIG2_CLAIMS.get(k) for k in FIG2_METRICS]
            for key, col in zip(FIG2_METRICS, compare(fig2(rs), fig2(base), claims), strict=True):
                store(row, key, col)
        rows.append(row)
    return rows


def lm_markdown(rows, contexts) -> str:
    header = ["variant (targets · terms)", "seeds", "added params"]
    header += [f"val loss @ {c}" for c in contexts] + ["paper ppl Pythia / GPT-2"]
    body = [
        [r["variant"], r["seeds"], r["added_parameters"]]
        + [mean_cell(r[f"loss_{c}"], r[f"sd_{c}"], r[f"p_{c}"]) for c in contexts]
        + [" / ".join(PAPER_LM.get(r["variant"], ("–", "–")))]
        for r in rows
    ]
    measures = {f"loss_{c}": f"val loss @ {c}" for c in contexts}
    measures.update(spikiness="spikiness (Fig. 2)", qk_norm="‖W_q·W_kᵀ‖₂ (Fig. 2)")
    return report.markdown_table(header, body) + "\n" + verdict_markdown(rows, measures)


def plot_lm(rows, contexts, path: Path) -> None:
    with report.figure(path, figsize=(6.5, 4.2), dpi=110) as (fig, ax):
        for r in rows:
            style = "ko-" if r["variant"] == "vanilla" else "o-"
            ax.errorbar(
                contexts,
                [r[f"loss_{c}"] for c in contexts],
                yerr=[r[f"sd_{c}"] for c in contexts],
                fmt=style,
                capsize=3,
                label=r["variant"],
                lw=2 if r["variant"] == "vanilla" else 1,
            )
        ax.set(
            xscale="log",
            xlabel="evaluation context (trained at the first)",
            ylabel="validation loss (nats / char)",
        )
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_title("Tiny Shakespeare characters: ours, not the paper's (mean ± sd)", fontsize=9)
        ax.legend(fontsize=7)


def lm_report(result: dict, lc: LMConfig) -> str:
    contexts = list(lc.eval_contexts)
    return f"""## Character language model on tiny Shakespeare (our experiment, cf. Tables 5-6)

**These numbers are ours, not the paper's.** The paper fine-tunes Pythia-160m and GPT-2 on
Wikitext and reports perplexity (printed in the last column for the shape of the comparison only:
different data, models and units). Here: characters of tiny Shakespeare ({result["lm_vocab"]}
symbols; the last 10% held out, {result["lm_val_chars"]:,} characters), the tiny pre-LN
transformer with {lc.layers} layers, d = {lc.d_model}, {lc.n_heads} heads, rotary positions, trained
at context {lc.context}: {lc.steps} AdamW steps of batch {lc.batch}, lr {lc.lr:g} (warmup
{lc.warmup}, cosine decay), {lc.seeds} seed(s); every variant of a seed starts from the same base
weights and sees the same batches (paired t-test p-values against vanilla). Selective temperatures
in every layer, token term {"weight sharing" if lc.sharing else "a two-layer GELU MLP of width d/2"},
position term 1 + c·log n (identity at initialisation). Validation loss in nats per character,
mean over every position of non-overlapping windows (about {lc.eval_tokens:,} characters per
context); contexts above {lc.context} were never seen in training.

{lm_markdown(result["lm"], contexts)}

Fig. 2's measures (the paper: Pythia pre-trained from scratch, the first 1000 Wikitext tokens;
spikiness 0.39 vanilla vs 0.26 SSA, ‖W‖ ≈ 3× smaller with SSA), on the first 1,024 validation
characters (windows of {lc.context}): spikiness ‖s‖₁/(‖s‖₂²·n) of every causal attention row (n =
keys it sees), ‖W_q,h·W_k,hᵀ‖₂ per head and the effective τ_q·‖W‖ per query token, means over
rows / tokens, heads and layers (rotation and the 1/√d_head scale left out: every variant has them).

{fig2_markdown(result["lm"], "lm") if all("spikiness" in r for r in result["lm"]) else "(not recorded by these runs)"}

{report.image("lm.png", "Validation loss against evaluation context (mean ± sd over seeds)")}"""
