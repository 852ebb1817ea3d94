"""`sharpattn reproduce selective`: the synthetic experiments of Zhang et al. (NeurIPS 2024).

1. Graph next-token task (Sec. 4.1, Fig. 3, Table 1, App. A). Vocabulary N = 8, each sequence a
   random order of all 8 tokens, query = the last token q; the next token is uniform over q and
   its neighbours in the tree 0-1, 0-2, 0-3, 1-4, 2-5, 3-6 (7 isolated), so the neighbour counts
   (self included) are 4, 3, 3, 3, 2, 2, 2, 1. Model: unit-norm token embeddings, one attention
   layer with one head, a linear classifier on the last position; Adam, lr 1e-4, cross-entropy.
   Vanilla vs query temperature (App. A: "a scaling parameter to each group of nodes that share
   the same number of neighbors": τ_q = e^{γ_g}, the feature-based token temperature on the
   one-hot group feature with the uncapped "exp" activation; ``query_activation="tanh"`` gives
   the capped τ_q = 1 + tanh(γ_g) ∈ (0, 2) of before) and the weight-sharing query temperature.
2. Denoising (Sec. 4.3, Table 2). d = K = 8, q ~ U[K], y = e_q; x_i = e_q + z_i with probability
   1/4 else z_i (i < L), x_L = e_q + z_L, z ~ N(0, σ²I); loss E‖y − ŷ/‖ŷ‖‖². One attention layer,
   one head, read at the last token. Vanilla vs value-selective (the paper's proxy
   τ_v = 1[max_j x_ij >= 1/2], and a learned τ_v = 1 + tanh(MLP(x))) vs the naive mean vs the
   Bayes (oracle) mean over the true signal tokens. σ and L are not given by the paper: we use
   L = 32 and sweep σ.

The model's output at the last position does not depend on the order of the other tokens (no
positional information), so the graph task's population cross-entropy and attention map are
computed exactly from the N sequences "all other tokens, then q".

3. Character language model (our experiment in the shape of the paper's Tables 5-6; the paper's
   are Wikitext fine-tuning perplexities of Pythia-160m / GPT-2): tiny Shakespeare characters,
   the tiny transformer of :mod:`sharpattn.models.transformer` with 4 layers, d = 128, rotary
   positions, trained at context 256; vanilla vs selective temperatures on q, v, qv with the
   token term, the position term or both, and on k and k, q, v with both (Table 5); validation
   loss at 256, 512 and 1024 characters, and Fig. 2's spikiness and ‖W_q·W_kᵀ‖. The
   text is read from ``--text`` (default ``../shared/data/tinyshakespeare.txt`` beside the
   source checkout); it is not shipped with the package (1 MB).

Everything runs on :mod:`.runner`: RUN/config.json (a folder of another configuration is
refused), one resumable Trainer run per ensemble or model (RUN/graph/<readout>/, RUN/denoise/,
RUN/lm/<variant>/seed<s>/, each with metrics.jsonl, checkpoints and an evaluation.json), seeds
from ``runner.seed_int`` keyed by (seed, task, purpose), so re-running after ``kill -9`` ends with
the numbers of an uninterrupted run.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import normalizers as nz
from ..attention import SelectiveConfig, selective_attend
from ..attention.selective import Temperature, parameter_overhead, selective_parameter_count
from ..diagnostics import qk_operator_norm, spikiness
from . import report
from .runner import Progress, RunFolder, Trainer, emit, generator, once, seeded, threads
from .runs import write_atomic, write_json
from .stats import paired_comparison

# The paper's numbers, printed beside ours.
PAPER = {  # as printed in the paper
    "graph": {
        "cross_entropy": {"vanilla": "0.0126", "selective": "0.009"},
        "err_map": {"vanilla": "0.543", "selective": "0.358"},
        "temperature": {1: "0.002", 2: "0.019", 3: "0.152", 4: "0.751"},
    },
    "denoise": {"vanilla": "1.390", "selective (threshold)": "0.071", "naive mean": "2.058",
                "Bayes (oracle)": "0.003"},
    # Fig. 2 (Pythia pre-trained from scratch on SlimPajama, first 1000 Wikitext tokens): the
    # spikiness ‖s‖₁/(‖s‖₂²·L) and the mean ‖W_q·W_kᵀ‖ (read off the figure: vanilla ≈ 3× SSA)
    "fig2": {"spikiness": {"vanilla": "0.39", "selective": "0.26"},
             "norm_ratio": "≈ 3 (vanilla / SSA)"},
}  # fmt: skip

GRAPH_EDGES = ((0, 1), (0, 2), (0, 3), (1, 4), (2, 5), (3, 6))
TASKS = ("graph", "denoise", "lm")

# Seeds: runner.seed_int(seed, task, purpose, ...) — one stream per seed, task and purpose.
GRAPH, DENOISE, LM = 1, 2, 3
_INIT, _DATA, _TEST = range(3)


# ---------------------------------------------------------------- parameter overhead


def _gpt_parameters(vocab, d, layers, context=None, tied=True) -> int:
    """A GPT-2 / GPT-NeoX block stack: embeddings, per layer LN·2 + qkv + out + 4d MLP, final LN."""
    per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d + 4 * d * d + d)
    embed = vocab * d * (1 if tied else 2) + (context * d if context else 0)
    return embed + layers * per_layer + 2 * d


PAPER_MODELS = {  # name: (base parameter count, d, heads, layers)
    "GPT-2 small": (_gpt_parameters(50257, 768, 12, context=1024, tied=True), 768, 12, 12),
    "Pythia-160m": (_gpt_parameters(50304, 768, 12, tied=False), 768, 12, 12),
}


def paper_scale_overhead() -> list[dict]:
    """New parameters of q+v selective temperatures (token + position) at the paper's model sizes:
    base (MLP, hidden d/2), weight sharing, feature-based (one scalar feature)."""
    variants = {
        "base": SelectiveConfig("qv"),
        "weight sharing": SelectiveConfig("qv", sharing=True),
        "feature-based": SelectiveConfig("qv", token="feature"),
    }
    paper = {"base": "≈5%", "weight sharing": "<0.5%", "feature-based": "<0.01%"}
    rows = []
    for model, (base, d, heads, layers) in PAPER_MODELS.items():
        for variant, cfg in variants.items():
            added = layers * selective_parameter_count(d, heads, config=cfg)
            rows.append(
                dict(model=model, variant=variant, base_parameters=base, added=added,
                     fraction=added / base, paper=paper[variant])
            )  # fmt: skip
    return rows


# ---------------------------------------------------------------- ensembles of one-head models


def _uniform(fan_in: int, *shape: int, keys) -> nn.Parameter:
    """Per-member nn.Linear-style init U(±1/√fan_in), member i drawn from ``generator(*keys[i])``."""
    bound = 1 / math.sqrt(fan_in)
    rows = [torch.rand(*shape, generator=generator(*k)) for k in keys]
    return nn.Parameter((torch.stack(rows) * 2 - 1) * bound)


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Member e's linear map: x ``[B, E, L, d]``, w ``[E, d, f]``, b ``[E, f]`` -> ``[B, E, L, f]``."""
    return torch.einsum("beld,edf->belf", x, w) + b[:, None]


class OneHeadEnsemble(nn.Module):
    """E independent one-layer, one-head attention models run as the E heads of one batched call.

    Nothing mixes heads and Adam is elementwise, so member e trains exactly as it would alone; this
    only removes Python overhead (the CPU is shared). Members of different variants with the same
    seed start from the same weights and see the same data, so comparisons are paired.
    """

    def __init__(self, d_in: int, d: int, members: list[tuple[str, int]], task: int):
        super().__init__()
        self.members, self.task = members, task
        self.wq, self.wk, self.wv = (_uniform(d_in, d_in, d, keys=self.keys(i)) for i in range(3))
        self.bq, self.bk, self.bv = (_uniform(d_in, d, keys=self.keys(3 + i)) for i in range(3))

    def keys(self, i: int) -> list[tuple[int, ...]]:
        """The seed keys of parameter ``i``, one per member: members of one seed start alike."""
        return [(s, self.task, _INIT, i) for _, s in self.members]

    def block(self, variant: str) -> slice:
        """The members of ``variant`` (members are ordered variant by variant)."""
        idx = [i for i, (v, _) in enumerate(self.members) if v == variant]
        if idx and idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError("ensemble members must be grouped by variant.")
        return slice(idx[0], idx[-1] + 1) if idx else slice(0, 0)

    def count(self, variant: str) -> int:
        return sum(v == variant for v, _ in self.members)

    def attend_last(self, x: torch.Tensor, temperatures, return_weights=False):
        """The last token's attention output ``[B, E, d]`` (and weights ``[B, E, L]``).

        ``temperatures(q, v)`` returns (τ_q ``[B, E, 1]`` or None, τ_v ``[B, E, L]`` or None).
        """
        q = _project(x[:, :, -1:], self.wq, self.bq)  # (B, E, 1, d)
        k, v = _project(x, self.wk, self.bk), _project(x, self.wv, self.bv)  # (B, E, L, d)
        tau_q, tau_v = temperatures(q, v)
        out = selective_attend(
            q, k, v, tau_q=tau_q, tau_v=tau_v, return_weights=return_weights, check_finite=False
        )
        if return_weights:
            return out[0][:, :, 0], out[1][:, :, 0]
        return out[:, :, 0]


# ---------------------------------------------------------------- graph next-token task


def graph_transition(n: int = 8, edges=GRAPH_EDGES) -> torch.Tensor:
    """P*: row q uniform over q and its neighbours."""
    a = torch.eye(n, dtype=torch.float64)
    for i, j in edges:
        a[i, j] = a[j, i] = 1.0
    return a / a.sum(-1, keepdim=True)


def graph_batch(batch: int, groups: int, p_star: torch.Tensor, generator: torch.Generator):
    """Sequences ``[B, G, N]`` (each token once, random order) and next tokens ``[B, G]`` drawn
    from the row of P* of the last token; G independent streams (one per seed)."""
    n = p_star.shape[0]
    seqs = torch.argsort(torch.rand(batch, groups, n, generator=generator), dim=-1)
    probs = p_star[seqs[..., -1]].float().view(-1, n)
    y = torch.multinomial(probs, 1, generator=generator).view(batch, groups)
    return seqs, y


def canonical_sequences(n: int) -> torch.Tensor:
    """Row q: all other tokens in increasing order, then q."""
    return torch.stack([torch.tensor([t for t in range(n) if t != q] + [q]) for q in range(n)])


GRAPH_VARIANTS = ("vanilla", "selective", "selective (weight sharing)")


class GraphEnsemble(OneHeadEnsemble):
    """Unit-norm embeddings, one attention head, a linear classifier, per member.

    Variants: ``vanilla``; ``selective``: App. A's "scaling parameter for each group of nodes
    that share the same number of neighbors", i.e. the feature-based query temperature
    τ_q = 1 + act(γ·onehot(group)); ``selective (weight sharing)``: the paper's weight-sharing
    query temperature τ_q = 1 + act(w·GELU(q)). No position term: every query is at position N.
    ``activation`` "exp" (default): 1 + act(f) = e^f, an unrestricted positive scale, 1 at
    initialisation (γ = 0); "tanh": the paper's Sec. 3 form, τ_q ∈ (0, 2).
    """

    def __init__(self, n: int, d: int, members: list[tuple[str, int]], readout: str = "classifier",
                 activation: str = "exp"):  # fmt: skip
        super().__init__(d, d, members, task=GRAPH)
        if readout not in ("classifier", "pointer"):
            raise ValueError(f"readout must be 'classifier' or 'pointer', got {readout!r}.")
        self.readout = readout
        embed = [torch.randn(n, d, generator=generator(*k)) for k in self.keys(7)]
        self.embed = nn.Parameter(torch.stack(embed))
        self.wc = _uniform(d, d, n, keys=self.keys(8))
        self.bc = _uniform(d, n, keys=self.keys(9))
        counts = (graph_transition(n) > 0).sum(-1)  # neighbours incl. self, per token
        self.groups = sorted(set(counts.tolist()))
        onehot = F.one_hot(torch.tensor([self.groups.index(c) for c in counts.tolist()]))
        self.register_buffer("group_features", onehot.float())  # [N, groups]
        cfg = SelectiveConfig("q", token="feature", num_features=len(self.groups), terms="token",
                              activation=activation)  # fmt: skip
        self.tau_group = Temperature(d, max(1, self.count("selective")), d, cfg)
        heads = max(1, self.count("selective (weight sharing)"))
        self.tau_shared = Temperature(
            d, heads, d, SelectiveConfig("q", sharing=True, terms="token", activation=activation)
        )

    def embeddings(self, seqs: torch.Tensor) -> torch.Tensor:
        """Member e's unit-norm (Sec. 4.1) embeddings of ``seqs`` ``[B, E, N]`` -> ``[B, E, N, d]``."""
        e, n, d = self.embed.shape
        offset = (torch.arange(e) * n).view(1, -1, 1)
        return F.normalize(F.embedding(seqs + offset, self.embed.view(e * n, d)), dim=-1)

    def query_temperature(self, seqs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """τ_q ``[B, E, 1]`` of the last token (1 for vanilla members)."""
        n = torch.ones(1, 1, 1)
        tau = torch.ones(q.shape[:3])
        g, s = self.block("selective"), self.block("selective (weight sharing)")
        if g.stop > g.start:
            feats = self.group_features[seqs[:, g, -1:]]  # (B, E_g, 1, groups)
            tau[:, g] = self.tau_group(n, features=feats)
        if s.stop > s.start:
            tau[:, s] = self.tau_shared(n, proj=q[:, s])
        return tau

    def forward(self, seqs: torch.Tensor, return_weights: bool = False):
        """seqs ``[B, E, N]`` -> logits ``[B, E, N]`` (and the last token's weights)."""
        x = self.embeddings(seqs)  # (B, E, N, d)
        taus = lambda q, v: (self.query_temperature(seqs, q), None)  # noqa: E731
        weights = return_weights or self.readout == "pointer"
        out, w = self.attend_last(x, taus, True) if weights else (self.attend_last(x, taus), None)
        if self.readout == "pointer":  # the attention map is the prediction: log P̂_q over tokens
            p_hat = torch.zeros_like(w).scatter_(-1, seqs, w)
            logits = torch.log(p_hat.clamp(min=1e-30))
        else:
            logits = torch.einsum("bed,edn->ben", out, self.wc) + self.bc
        return (logits, w) if return_weights else logits


@dataclass
class GraphConfig:
    n: int = 8
    d: int = 8
    steps: int = 60000  # at lr 1e-4 the excess CE still falls at 32,000 steps (2-seed check)
    batch: int = 256
    lr: float = 1e-4
    seeds: int = 5
    variants: tuple[str, ...] = GRAPH_VARIANTS
    readouts: tuple[str, ...] = ("classifier", "pointer")
    # τ_q = e^γ (uncapped, App. A's unrestricted per-group scale) or 1 + tanh(γ) ∈ (0, 2)
    query_activation: str = "exp"


@torch.no_grad()
def graph_evaluate(model: GraphEnsemble, p_star: torch.Tensor) -> list[dict]:
    """Exact population metrics per member: cross-entropy, its excess over H(P*), err_map, and
    the learned τ_q per neighbour-count group."""
    n, e = p_star.shape[0], len(model.members)
    seqs = canonical_sequences(n).unsqueeze(1).expand(n, e, n)
    logits, w = model(seqs, return_weights=True)  # (N, E, N), (N, E, N)
    x = model.embeddings(seqs)
    q = _project(x[:, :, -1:], model.wq, model.bq)
    tau = model.query_temperature(seqs, q)[:, :, 0]  # (N queries, E)
    entropy = nz.entropy(p_star).mean().item()  # H(P*)
    counts = (p_star > 0).sum(-1)
    spiky = spikiness(w)  # (N queries, E): Fig. 2's ‖s‖₁ / (‖s‖₂²·L), L = N keys
    w_norm = qk_operator_norm(model.wq, model.wk)  # (E,): ‖W_q·W_kᵀ‖₂ (biases not included)
    out = []
    for i, (variant, seed) in enumerate(model.members):
        logp = torch.log_softmax(logits[:, i].double(), -1)
        ce = -(p_star * logp).sum(-1).mean().item()
        p_hat = torch.zeros(n, n, dtype=torch.float64)
        p_hat.scatter_(1, seqs[:, i], w[:, i].double())  # position -> token id
        row_l1 = (p_hat - p_star).abs().sum(-1)
        out.append(
            dict(
                variant=variant,
                seed=seed,
                cross_entropy=ce,
                excess_cross_entropy=ce - entropy,
                err_map=row_l1.mean().item(),  # Claim 1: E_q ‖P̂_q − P*_q‖₁
                err_map_sum=row_l1.sum().item(),  # entrywise ‖P̂ − P*‖₁ over the N × N matrix
                tau_by_group={
                    int(c): tau[counts == c, i].mean().item() for c in sorted(set(counts.tolist()))
                },
                p_hat=p_hat.tolist(),
                spikiness=spiky[:, i].mean().item(),  # mean over the N queries
                qk_norm=w_norm[i].item(),
                effective_qk_norm=(tau[:, i].double() * w_norm[i]).mean().item(),  # E_q τ_q·‖W‖
            )
        )
    return out


def finish(trainer: Trainer, stop_at: int | None, evaluate, shape: Any = None) -> Any:
    """Train (or resume, or load) ``trainer``, then ``evaluate(state)`` once: the folder's
    evaluation.json, checked to be of ``shape`` (:func:`.runs.conforms`; None if ``stop_at``
    stopped the training, as a crash would)."""
    state = trainer.run(stop_at=stop_at)
    if state.get("stopped"):
        return None
    return once(trainer.folder / "evaluation.json", lambda: evaluate(state), shape)


def graph_train(folder: Path, cfg: GraphConfig, seeds: list[int], readout: str = "classifier",
                progress: Progress | None = None, stop_at: int | None = None,
                checkpoint_every: int = 1000) -> list[dict] | None:  # fmt: skip
    """Train every (variant, seed) member of one readout together, as one ensemble in
    ``folder``; one metrics dict per member. Seed s draws its sequences from its own stream,
    whatever the other seeds and variants."""
    members = [(v, s) for v in cfg.variants for s in seeds]
    model = GraphEnsemble(cfg.n, cfg.d, members, readout=readout, activation=cfg.query_activation)
    group = torch.tensor([seeds.index(s) for _, s in members])  # member -> its data stream
    p_star = graph_transition(cfg.n)
    data = {s: generator(s, GRAPH, _DATA) for s in seeds}

    def batch(step: int):
        seqs, y = zip(*(graph_batch(cfg.batch, 1, p_star, g) for g in data.values()), strict=True)
        return torch.cat(seqs, 1)[:, group], torch.cat(y, 1)[:, group]  # (B, E, N), (B, E)

    def loss(model: GraphEnsemble, b) -> torch.Tensor:  # each member's mean cross-entropy
        return F.cross_entropy(model(b[0]).transpose(1, 2), b[1], reduction="none").mean(0)

    trainer = Trainer(
        folder, model, torch.optim.Adam(model.parameters(), lr=cfg.lr), steps=cfg.steps,
        batch=batch, loss=loss, generators={f"data{s}": g for s, g in data.items()},
        checkpoint_every=checkpoint_every, task=f"graph ({readout})", progress=progress,
    )  # fmt: skip
    rows = [{"variant": str, "seed": int, "cross_entropy": float, "excess_cross_entropy": float,
             "err_map": float, "tau_by_group": {str: float}, "readout": str}]  # fmt: skip
    return finish(trainer, stop_at, lambda state: [dict(r, readout=readout)
                                                   for r in graph_evaluate(model, p_star)],
                  rows)  # fmt: skip


# ---------------------------------------------------------------- denoising task


def denoise_batch(batch: int, k: int, length: int, sigmas: torch.Tensor,
                  generator: torch.Generator, alpha: float = 0.25):  # fmt: skip
    """X ``[B, G, L, K]``, y ``[B, G, K]`` and the signal mask S ``[B, G, L]`` (Sec. 4.3) at each
    noise level σ_g in ``sigmas`` ``[G]``: the same q, S and unit noise z for every σ (common
    random numbers), so a σ's samples do not depend on the other σ's and σ's compare paired."""
    groups = sigmas.shape[0]
    q = torch.randint(k, (batch, 1), generator=generator)
    y = F.one_hot(q, k).float()  # (B, 1, K)
    signal = torch.rand(batch, 1, length, generator=generator) < alpha
    signal[..., -1] = True  # x_L = e_q + z_L
    z = torch.randn(batch, 1, length, k, generator=generator) * sigmas.view(1, -1, 1, 1)
    x = z + signal.unsqueeze(-1) * y.unsqueeze(2)  # (B, G, L, K)
    return x, y.expand(-1, groups, -1), signal.expand(-1, groups, -1)


def threshold_temperature(x: torch.Tensor) -> torch.Tensor:
    """The paper's proxy value temperature τ_v = 1[max_j x_ij >= 1/2]: ``[..., L, K]`` ->
    ``[..., L]``."""
    return (x.amax(-1) >= 0.5).to(x.dtype)


def denoise_loss(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """‖y − ŷ/‖ŷ‖‖² per sample."""
    return (y - F.normalize(y_hat, dim=-1, eps=1e-12)).pow(2).sum(-1)


DENOISE_VARIANTS = (
    "vanilla",
    "selective (threshold)",
    "selective (learned: weight sharing)",
    "selective (learned: feature)",
)


class DenoiseEnsemble(OneHeadEnsemble):
    """One attention head read at the last token, per member; value temperatures:

    - ``vanilla``: none;
    - ``selective (threshold)``: the paper's proxy τ_v = 1[max_j x_ij >= 1/2] (fixed);
    - ``selective (learned: weight sharing)``: τ_v = 1 + tanh(w·GELU(x·W_v + b_v)), the paper's
      weight-sharing token temperature (it can only push τ_v to 0 through GELU's negative dip);
    - ``selective (learned: feature)``: τ_v = 1 + tanh(γ₁·max_j x_ij + γ₀), the feature-based
      form on the feature the proxy thresholds (App. B.2), threshold and sharpness learned.
    """

    def __init__(self, k: int, members: list[tuple[str, int]]):
        super().__init__(k, k, members, task=DENOISE)
        shared = max(1, self.count("selective (learned: weight sharing)"))
        self.tau_shared = Temperature(
            k, shared, k, SelectiveConfig("v", sharing=True, terms="token")
        )
        cfg = SelectiveConfig("v", token="feature", num_features=2, terms="token")
        self.tau_feature = Temperature(
            k, max(1, self.count("selective (learned: feature)")), k, cfg
        )

    def value_temperature(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """τ_v ``[B, E, L]`` (1 for vanilla members)."""
        n = torch.ones(1, 1, 1)
        tau = torch.ones(x.shape[:3])
        t = self.block("selective (threshold)")
        tau[:, t] = threshold_temperature(x[:, t])
        s = self.block("selective (learned: weight sharing)")
        if s.stop > s.start:
            tau[:, s] = self.tau_shared(n, proj=v[:, s])
        f = self.block("selective (learned: feature)")
        if f.stop > f.start:
            xf = x[:, f]
            feats = torch.stack([xf.amax(-1), torch.ones_like(xf[..., 0])], -1)  # (B, E_f, L, 2)
            tau[:, f] = self.tau_feature(n, features=feats)
        return tau

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, E, L, K]`` -> ŷ ``[B, E, K]``."""
        return self.attend_last(x, lambda q, v: (None, self.value_temperature(x, v)))


@dataclass
class DenoiseConfig:
    k: int = 8
    length: int = 32
    sigmas: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5)
    main_sigma: float = 0.1
    steps: int = 20000
    batch: int = 64
    lr: float = 1e-4
    seeds: int = 5
    eval_samples: int = 20000
    variants: tuple[str, ...] = DENOISE_VARIANTS


def _denoise_streams(cfg: DenoiseConfig, seeds: list[int]):
    """Streams (σ, seed), σ-major; members (variant, stream), variant-major; member -> stream."""
    streams = [(sigma, s) for sigma in cfg.sigmas for s in seeds]
    members = [(v, i) for v in cfg.variants for i in range(len(streams))]
    return streams, members, torch.tensor([i for _, i in members])


def _denoise_draw(cfg: DenoiseConfig, batch: int, gens: list[torch.Generator]):
    """One draw per seed's generator at every σ: X ``[B, σ·seeds, L, K]`` (σ-major, as the
    streams), y and the signal mask alike."""
    sigmas = torch.tensor(cfg.sigmas)
    draws = [denoise_batch(batch, cfg.k, cfg.length, sigmas, g) for g in gens]
    return tuple(torch.stack(parts, 2).flatten(1, 2) for parts in zip(*draws, strict=True))


@torch.no_grad()
def denoise_evaluate(model: DenoiseEnsemble, cfg: DenoiseConfig, seeds: list[int]) -> list[dict]:
    """Every member and the naive and Bayes (oracle) estimators on ``cfg.eval_samples`` held-out
    samples per seed; one dict per (σ, seed)."""
    streams, members, group = _denoise_streams(cfg, seeds)
    gens = [generator(s, DENOISE, _TEST) for s in seeds]
    x, y, signal = _denoise_draw(cfg, cfg.eval_samples, gens)
    chunks = zip(x.split(1024), y.split(1024), strict=True)  # members × samples: bounded memory
    per_member = torch.cat([denoise_loss(model(xc[:, group]), yc[:, group]) for xc, yc in chunks])
    per_member = per_member.mean(0)  # (E,)
    naive = denoise_loss(x.mean(2), y).mean(0)
    s = signal.unsqueeze(-1).float()
    bayes = denoise_loss((x * s).sum(2) / s.sum(2), y).mean(0)
    out = []
    for i, (sigma, seed) in enumerate(streams):
        row = dict(sigma=sigma, seed=seed)
        for j, (v, stream) in enumerate(members):
            if stream == i:
                row[v] = per_member[j].item()
        row["naive mean"], row["Bayes (oracle)"] = naive[i].item(), bayes[i].item()
        out.append(row)
    return out


def denoise_train(folder: Path, cfg: DenoiseConfig, seeds: list[int],
                  progress: Progress | None = None, stop_at: int | None = None,
                  checkpoint_every: int = 1000) -> list[dict] | None:  # fmt: skip
    """Train every (variant, σ, seed) member together, as one ensemble in ``folder``, then
    evaluate; one dict per (σ, seed)."""
    streams, members, group = _denoise_streams(cfg, seeds)
    model = DenoiseEnsemble(cfg.k, [(v, streams[i][1]) for v, i in members])
    data = {s: generator(s, DENOISE, _DATA) for s in seeds}

    def batch(step: int):
        x, y, _ = _denoise_draw(cfg, cfg.batch, list(data.values()))
        return x[:, group], y[:, group]

    def loss(model: DenoiseEnsemble, b) -> torch.Tensor:  # each member's mean loss
        return denoise_loss(model(b[0]), b[1]).mean(0)

    trainer = Trainer(
        folder, model, torch.optim.Adam(model.parameters(), lr=cfg.lr), steps=cfg.steps,
        batch=batch, loss=loss, generators={f"data{s}": g for s, g in data.items()},
        checkpoint_every=checkpoint_every, task="denoise", progress=progress,
    )  # fmt: skip
    rows = [{"sigma": float, "seed": int, "naive mean": float, "Bayes (oracle)": float}]
    return finish(trainer, stop_at, lambda state: denoise_evaluate(model, cfg, seeds), rows)


# ---------------------------------------------------------------- statistics, plots, report


def _compare(values, baseline) -> list[tuple[float, float, float]]:
    """Per column of ``values`` ``[seeds, columns]``: (mean, sd (0 for one seed), paired p-value
    against ``baseline`` of the same shape, NaN where undefined)."""
    c = paired_comparison(baseline, values)
    return [(float(m), float(np.nan_to_num(sd)), float(p))
            for m, sd, p in zip(c.mean_b, c.std_b, c.p_value, strict=True)]  # fmt: skip


GRAPH_METRICS = ("cross_entropy", "excess_cross_entropy", "err_map", "err_map_sum")
FIG2_METRICS = ("spikiness", "qk_norm", "effective_qk_norm")


def summarize_graph(runs: list[dict], variants) -> list[dict]:
    """Per variant: mean ± sd over seeds, paired p-value against vanilla, mean τ_q per group."""
    rows = []
    table = lambda rs: [[r[k] for k in GRAPH_METRICS] for r in rs]  # noqa: E731
    vanilla = [r for r in runs if r["variant"] == "vanilla"]
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        base = vanilla if len(vanilla) == len(rs) else rs
        row = dict(variant=v, seeds=len(rs))
        for key, (m, sd, p) in zip(GRAPH_METRICS, _compare(table(rs), table(base)), strict=True):
            row[key], row[key + "_sd"], row[key + "_p"] = m, sd, p
        if all(k in r for r in rs + base for k in FIG2_METRICS):  # runs before Fig. 2 lack them
            fig2 = lambda rs: [[r[k] for k in FIG2_METRICS] for r in rs]  # noqa: E731
            for key, (m, sd, p) in zip(FIG2_METRICS, _compare(fig2(rs), fig2(base)), strict=True):
                row[key], row[key + "_sd"], row[key + "_p"] = m, sd, p
        groups = sorted(rs[0]["tau_by_group"], key=int)
        row["tau_by_group"] = {
            int(c): float(np.mean([r["tau_by_group"][c] for r in rs])) for c in groups
        }
        rows.append(row)
    return rows


def summarize_denoise(runs: list[dict]) -> list[dict]:
    """One row per (σ, method): mean ± sd over seeds, paired p-value against vanilla."""
    rows = []
    for sigma in sorted({r["sigma"] for r in runs}):
        rs = sorted((r for r in runs if r["sigma"] == sigma), key=lambda r: r["seed"])
        vanilla = [[r["vanilla"]] for r in rs]
        for method in (k for k in rs[0] if k not in ("sigma", "seed")):
            [(m, sd, p)] = _compare([[r[method]] for r in rs], vanilla)
            rows.append(dict(sigma=sigma, method=method, loss=m, sd=sd, p=p, seeds=len(rs)))
    return rows


def plot_graph(summary, p_star, example_maps, path: Path) -> None:
    mats = [("P* (ground truth)", np.asarray(p_star))] + [
        (f"P̂ {v}", np.asarray(m)) for v, m in example_maps.items()
    ]
    size = (3.6 * (len(mats) + 1), 3.6)
    with report.figure(path, 1, len(mats) + 1, figsize=size, dpi=110) as (fig, axes):
        for ax, (title, m) in zip(axes, mats, strict=False):
            ax.imshow(m, vmin=0, vmax=1, cmap="viridis")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("key token")
            ax.set_ylabel("query token")
        ax = axes[-1]
        for row in summary:
            if row["variant"] == "vanilla":
                continue
            groups = sorted(row["tau_by_group"])
            taus = [1 / row["tau_by_group"][c] for c in groups]
            ax.plot(groups, taus, "o-", label=row["variant"])
        paper = PAPER["graph"]["temperature"]
        ax.plot(list(paper), [float(t) for t in paper.values()], "k--", label="paper Table 1")
        ax.set(yscale="log", xlabel="neighbours (incl. self)", ylabel="temperature 1/τ_q")
        ax.set_title("learned query temperature", fontsize=9)
        ax.legend(fontsize=7)


def plot_denoise(rows, path: Path) -> None:
    with report.figure(path, figsize=(6.5, 4.2), dpi=110) as (fig, ax):
        for method in dict.fromkeys(r["method"] for r in rows):
            rs = [r for r in rows if r["method"] == method]
            ax.errorbar([r["sigma"] for r in rs], [r["loss"] for r in rs],
                        yerr=[r["sd"] for r in rs], marker="o", capsize=3, label=method)  # fmt: skip
        ax.axhline(2.0, color="grey", lw=0.8, ls=":", label="random unit vector (= 2)")
        ax.set(xlabel="noise σ", ylabel="E‖y − ŷ/‖ŷ‖‖²", yscale="log")
        ax.set_title(
            "Denoising (Sec. 4.3): loss against noise σ (mean ± sd over seeds)", fontsize=9
        )
        ax.legend(fontsize=7)


def _fmt(m, sd=None, p=None) -> str:
    """A table cell: mean (± sd where there is one) (p=... where defined)."""
    s = f"{m:.4f}" + (f" ± {sd:.4f}" if sd else "")
    if p is not None and not math.isnan(p):
        s += f" (p={p:.2g})"
    return s


def graph_markdown(rows) -> str:
    paper = PAPER["graph"]
    header = ["readout", "variant", "seeds", "cross-entropy", "excess CE (CE − H(P*))",
              "err_map E_q‖P̂_q − P*_q‖₁", "err_map Σ‖P̂ − P*‖₁", "paper CE", "paper err_map"]  # fmt: skip
    main = []
    for r in rows:
        key = "vanilla" if r["variant"] == "vanilla" else "selective"
        cells = [_fmt(r[k], r[k + "_sd"], r[k + "_p"] if k != "cross_entropy" else None)
                 for k in GRAPH_METRICS]  # fmt: skip
        main.append([r["readout"], r["variant"], r["seeds"], *cells,
                     paper["cross_entropy"][key], paper["err_map"][key]])  # fmt: skip
    sel_rows = [r for r in rows if r["variant"] != "vanilla"]
    nodes = {1: "7", 2: "4,5,6", 3: "1,2,3", 4: "0"}
    temperature = [
        [c, nodes[c], paper["temperature"][c]]
        + [f"{r['tau_by_group'][c]:.3f} / {1 / r['tau_by_group'][c]:.3f}" for r in sel_rows]
        for c in sorted(paper["temperature"])
    ]
    # τ_q trades against ‖W‖ (only τ_q·W_q·W_kᵀ enters the scores), so the scale-free comparison
    # is each group's temperature relative to the 4-neighbour group's
    p4 = float(paper["temperature"][4])
    temperature += [
        [c, "ratio to the 4-neighbour group", f"{float(paper['temperature'][c]) / p4:.3g}"]
        + [f"{r['tau_by_group'][4] / r['tau_by_group'][c]:.3g}" for r in sel_rows]
        for c in sorted(paper["temperature"])
    ]
    tau_header = ["neighbours (incl. self)", "nodes", "paper temperature"] + [
        f"{r['variant']} ({r['readout']}): τ_q / 1/τ_q" for r in sel_rows
    ]
    return (
        report.markdown_table(header, main, "ll" + "r" * 7)
        + "\n"
        + report.markdown_table(tau_header, temperature, "rlr" + "r" * len(sel_rows))
        + ("\n" + fig2_markdown(rows, "graph") if all("spikiness" in r for r in rows) else "")
    )


def fig2_markdown(rows, task: str) -> str:
    """Fig. 2's measures per variant (mean ± sd over seeds, paired p against vanilla)."""
    paper = PAPER["fig2"]
    header = (["readout"] if task == "graph" else []) + [
        "variant", "spikiness ‖s‖₁/(‖s‖₂²·L)", "‖W_q·W_kᵀ‖₂", "τ_q·‖W_q·W_kᵀ‖₂",
        "vanilla / this: ‖W‖ (τ_q·‖W‖)", "paper spikiness"]  # fmt: skip
    body = []
    for r in rows:
        van = next(
            (v for v in rows if v["variant"] == "vanilla" and v.get("readout") == r.get("readout")),
            None,
        )
        key = "vanilla" if r["variant"] == "vanilla" else "selective"
        cells = [_fmt(r[k], r.get(k + "_sd"), r.get(k + "_p")) for k in FIG2_METRICS]
        body.append(([r["readout"]] if task == "graph" else []) + [r["variant"], *cells,
                    "–" if van is None else f"{van['qk_norm'] / r['qk_norm']:.2f} "
                    f"({van['effective_qk_norm'] / r['effective_qk_norm']:.2f})",
                    paper["spikiness"][key]])  # fmt: skip
    return report.markdown_table(header, body)


def denoise_markdown(rows, main_sigma: float) -> str:
    paper = PAPER["denoise"]
    header = ["σ", "method", "seeds", "loss E‖y − ŷ/‖ŷ‖‖² (mean ± sd, paired p vs vanilla)",
              "paper (σ unstated)"]  # fmt: skip
    body = [[f"{r['sigma']:g}", r["method"], r["seeds"], _fmt(r["loss"], r["sd"], r["p"]),
             paper.get(r["method"], "") if r["sigma"] == main_sigma else ""]
            for r in rows]  # fmt: skip
    return report.markdown_table(header, body, "rlrrr")


def overhead_markdown(rows) -> str:
    header = ["model", "variant (q + v, token + position)", "base parameters", "added",
              "overhead", "paper"]  # fmt: skip
    body = [[r["model"], r["variant"], r["base_parameters"], r["added"],
             f"{100 * r['fraction']:.3g}%", r["paper"]] for r in rows]  # fmt: skip
    return report.markdown_table(header, body, "llrrrl")


# ---------------------------------------------------------------- character language model


# The paper's Tables 5-6 (fine-tuning Pythia-160m / GPT-2 on Wikitext, perplexity): printed beside
# ours for the shape of the comparison only; our numbers are character-level losses of tiny models.
PAPER_LM = {  # variant: (Pythia ppl, GPT-2 ppl)
    "vanilla": ("28.781", "36.503"),
    "q · both": ("27.416", "34.832"), "q · position": ("27.995", "34.970"),
    "q · token": ("27.503", "35.064"),
    "v · both": ("27.980", "35.857"), "v · position": ("28.342", "36.320"),
    "v · token": ("27.975", "35.617"),
    "qv · both": ("26.514", "34.618"),
    "k · both": ("28.715", "36.443"), "kqv · both": ("26.603", "34.609"),  # Table 5
}  # fmt: skip

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
    """The packaged excerpt of tiny Shakespeare (:data:`PACKAGED_TEXT`)."""
    return Path(str(resources.files("sharpattn.tasks").joinpath("data", PACKAGED_TEXT)))


def load_text(path: str | Path | None = None) -> str:
    """The training text (default :func:`default_text_path`); a missing file is one sentence."""
    path = Path(path) if path is not None else default_text_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"no text file at {path}: pass --text PATH to a plain-text corpus such as tiny "
            "Shakespeare."
        )
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
        with seeded(seed, LM, _INIT):
            return Transformer(
                TransformerConfig(
                    vocab_size=vocab, n_out=vocab, d_model=cfg.d_model, n_heads=cfg.n_heads,
                    layers=cfg.layers, positions="rotary", selective=selective,
                    selective_terms=terms, sharing=cfg.sharing,
                )
            )  # fmt: skip

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
    return dict(spikiness=float(np.mean(spiky)), qk_norm=float(np.mean(norms)),
                effective_qk_norm=float(np.mean(effective)), spikiness_by_layer=spiky,
                qk_norm_by_layer=norms, effective_qk_norm_by_layer=effective,
                tokens=n * context)  # fmt: skip


def lm_train(folder: Path, cfg: LMConfig, train, val, vocab: int, variant: str, seed: int,
             progress: Progress | None = None, stop_at: int | None = None,
             checkpoint_every: int = 1000) -> dict | None:  # fmt: skip
    """Train one (variant, seed) in ``folder``: AdamW, linear warmup then cosine decay, gradient
    clipping at 1; the batches depend on the seed only (paired variants). Returns validation
    losses at every eval context and the first / last training losses."""
    model = lm_model(cfg, vocab, variant, seed)
    data = generator(seed, LM, _DATA)

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
        folder, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01),
        steps=cfg.steps, batch=batch, loss=loss, generators={"data": data},
        checkpoint_every=checkpoint_every, log_every=1, lr_schedule=schedule, clip_grad_norm=1.0,
        task=f"lm {variant} seed {seed}", progress=progress,
    )  # fmt: skip

    def evaluate(state) -> dict:
        losses = [r["loss"][0] for r in trainer.metrics.read() if r["loss"] is not None]
        val_loss = {}
        for i, c in enumerate(cfg.eval_contexts):
            emit(progress, trainer.task, f"eval {c}", i, len(cfg.eval_contexts))
            val_loss[str(c)] = lm_evaluate(model, val, c, cfg.eval_tokens)
        emit(progress, trainer.task, "done", len(cfg.eval_contexts), len(cfg.eval_contexts))
        overhead = parameter_overhead(model)
        return dict(
            variant=variant, seed=seed, val_loss=val_loss, train_seconds=state["seconds"],
            first_train_loss=float(np.mean(losses[:10])),
            last_train_loss=float(np.mean(losses[-50:])),
            added_parameters=overhead.added, base_parameters=overhead.base,
            fig2=lm_fig2(model, val, cfg.context),
        )  # fmt: skip

    shape = {"variant": str, "seed": int, "val_loss": {str: float}, "train_seconds": float,
             "first_train_loss": float, "last_train_loss": float, "added_parameters": int,
             "base_parameters": int, "fig2": None}  # fmt: skip
    return finish(trainer, stop_at, evaluate, shape)


def summarize_lm(runs: list[dict], variants, contexts) -> list[dict]:
    """Per variant and context: mean ± sd over seeds, paired p-value against vanilla."""
    rows = []
    vanilla = sorted((r for r in runs if r["variant"] == "vanilla"), key=lambda r: r["seed"])
    table = lambda rs: [[r["val_loss"][str(c)] for c in contexts] for r in rs]  # noqa: E731
    for v in variants:
        rs = sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"])
        row = dict(variant=v, seeds=len(rs), added_parameters=rs[0]["added_parameters"],
                   base_parameters=rs[0]["base_parameters"])  # fmt: skip
        paired = [r["seed"] for r in rs] == [r["seed"] for r in vanilla]
        for c, (m, sd, p) in zip(contexts, _compare(table(rs), table(vanilla if paired else rs)),
                                 strict=True):  # fmt: skip
            row[f"loss_{c}"], row[f"sd_{c}"], row[f"p_{c}"] = m, sd, p
        if all("fig2" in r for r in rs + vanilla):  # runs before Fig. 2 lack it
            fig2 = lambda rs: [[r["fig2"][k] for k in FIG2_METRICS] for r in rs]  # noqa: E731
            base = vanilla if paired else rs
            for key, (m, sd, p) in zip(FIG2_METRICS, _compare(fig2(rs), fig2(base)), strict=True):
                row[key], row[key + "_sd"], row[key + "_p"] = m, sd, p
        rows.append(row)
    return rows


def lm_markdown(rows, contexts) -> str:
    header = ["variant (targets · terms)", "seeds", "added params"]
    header += [f"val loss @ {c}" for c in contexts] + ["paper ppl Pythia / GPT-2"]
    body = [[r["variant"], r["seeds"], r["added_parameters"]]
            + [_fmt(r[f"loss_{c}"], r[f"sd_{c}"], r[f"p_{c}"]) for c in contexts]
            + [" / ".join(PAPER_LM.get(r["variant"], ("–", "–")))] for r in rows]  # fmt: skip
    return report.markdown_table(header, body)


def plot_lm(rows, contexts, path: Path) -> None:
    with report.figure(path, figsize=(6.5, 4.2), dpi=110) as (fig, ax):
        for r in rows:
            style = "ko-" if r["variant"] == "vanilla" else "o-"
            ax.errorbar(contexts, [r[f"loss_{c}"] for c in contexts],
                        yerr=[r[f"sd_{c}"] for c in contexts], fmt=style, capsize=3,
                        label=r["variant"], lw=2 if r["variant"] == "vanilla" else 1)  # fmt: skip
        ax.set(xscale="log", xlabel="evaluation context (trained at the first)",
               ylabel="validation loss (nats / char)")  # fmt: skip
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_title("Tiny Shakespeare characters: ours, not the paper's (mean ± sd)", fontsize=9)
        ax.legend(fontsize=7)


# ---------------------------------------------------------------- the command's entry point


@dataclass
class ReproduceConfig:
    graph: GraphConfig = field(default_factory=GraphConfig)
    denoise: DenoiseConfig = field(default_factory=DenoiseConfig)
    lm: LMConfig = field(default_factory=LMConfig)
    tasks: tuple[str, ...] = TASKS
    seed: int = 0
    quick: bool = False
    threads: int | None = 1  # tiny models: a second thread only adds overhead on a shared CPU
    checkpoint_every: int = 500


# What a run folder keeps fixed: everything that changes a trained model or an evaluation.json.
# Tasks, threads and checkpoints may change between invocations; LM variants and seeds each have
# their own folder, so a run can gain some.
_FREE = {"tasks", "quick", "threads", "checkpoint_every", "lm.variants", "lm.seeds"}


def _identity(config: ReproduceConfig) -> list[str]:
    keys = [f"{part}.{f.name}" for part in ("graph", "denoise", "lm")
            for f in fields(getattr(config, part))] + [f.name for f in fields(config)]  # fmt: skip
    return [k for k in keys if k not in _FREE and k not in ("graph", "denoise", "lm")]


# The --quick LM: the same model and context, few steps, one seed and the q/v/qv "both" rows
# (tiny Shakespeare at 0.27 s per batch-8 step on one busy core: the whole quick profile must stay
# under 5 minutes on 2 cores).
QUICK_LM_VARIANTS = ("vanilla", "q · both", "v · both", "qv · both")


def quick_config(seed: int = 0) -> ReproduceConfig:
    """The --quick profile: fewer steps, seeds and σ's, a larger learning rate (stated)."""
    return ReproduceConfig(
        graph=GraphConfig(steps=3000, seeds=3, lr=1e-3, readouts=("classifier",)),
        denoise=DenoiseConfig(steps=1500, seeds=3, lr=1e-3, sigmas=(0.1, 0.3), eval_samples=8000),
        lm=LMConfig(
            steps=100, batch=8, warmup=10, seeds=1, eval_tokens=8192, variants=QUICK_LM_VARIANTS
        ),  # fmt: skip
        seed=seed,
        quick=True,
    )


def make_config(profile: str = "paper", *, seed: int = 0, seeds: int | None = None,
                steps: int | None = None, sigmas=None, tasks: str = ",".join(TASKS),
                text: str | None = None, lm_steps: int | None = None, lm_variants: str | None = None,
                threads: int | None = 1, checkpoint_every: int = 500) -> ReproduceConfig:  # fmt: skip
    """The configuration of a profile ("quick" or "paper") with the command's overrides: seeds
    and steps apply to every part (``lm_steps`` overrides the LM's), ``sigmas[0]`` becomes the
    main σ, ``lm_variants`` and ``tasks`` are comma-separated."""
    config = quick_config(seed) if profile == "quick" else ReproduceConfig(seed=seed)
    g, d, lm = config.graph, config.denoise, config.lm
    if seeds is not None:
        g, d, lm = (replace(c, seeds=seeds) for c in (g, d, lm))
    if steps is not None:
        g, d = replace(g, steps=steps), replace(d, steps=steps)
    if sigmas is not None:
        d = replace(d, sigmas=tuple(sigmas), main_sigma=sigmas[0])
    lm_steps = steps if lm_steps is None else lm_steps
    if lm_steps is not None:
        lm = replace(lm, steps=lm_steps, warmup=min(lm.warmup, lm_steps))
    if lm_variants is not None:
        names = [v for v in lm_variants.split(",") if v.strip()]
        lm = replace(lm, variants=tuple(dict.fromkeys(map(lm_variant, names))))
    if text is not None:
        lm = replace(lm, text=text)
    parts = tuple(dict.fromkeys(t.strip() for t in tasks.split(",") if t.strip()))
    return replace(config, graph=g, denoise=d, lm=lm, tasks=parts, threads=threads,
                   checkpoint_every=checkpoint_every)  # fmt: skip


def trainings(config: ReproduceConfig) -> int:
    """How many trainings ``config`` runs: one ensemble per graph readout, one for denoising,
    one run per LM variant and seed (of the tasks it names)."""
    per_task = {
        "graph": len(config.graph.readouts),
        "denoise": 1,
        "lm": len(config.lm.variants) * config.lm.seeds,
    }
    return sum(per_task.get(t, 0) for t in config.tasks)


TABLE_TITLES = {  # RUN/<name>.md: what the command prints, in this order
    "graph": "Graph next-token task (Sec. 4.1, Table 1)",
    "denoise": "Denoising (Sec. 4.3, Table 2)",
    "lm": "Character LM on tiny Shakespeare (ours, not the paper's numbers)",
    "overhead": "Parameter overhead (Sec. 3)",
}


def run(out: str | Path, config: ReproduceConfig, progress: Progress | None = None,
        stop_at: int | None = None) -> tuple[Path, dict | None]:  # fmt: skip
    """Train (resuming what exists) and evaluate everything; write the tables, metrics.json,
    plots and report.md into the run folder ``out``.

    ``progress`` receives the runner's events. ``stop_at`` stops every training at that step as
    a crash would (tests): the result is then None and re-running resumes.
    """
    bad = sorted(set(config.tasks) - set(TASKS))
    if bad or not config.tasks:
        raise ValueError(
            f"tasks must be some of {', '.join(TASKS)}, got {', '.join(bad) or 'none'}."
        )
    if "lm" in config.tasks and not config.lm.variants:
        raise ValueError("lm variants names no variant; name at least one, or leave out lm.")
    text = load_text(config.lm.text) if "lm" in config.tasks else None  # fail before training
    folder = RunFolder(out, "reproduce selective", asdict(config), identity=_identity(config))
    with threads(config.threads):
        return folder.path, _run(folder.path, config, progress, text, stop_at)


def _slug(variant: str) -> str:
    """A folder name for an LM variant: "qv · both" -> "qv-both"."""
    return re.sub(r"[^a-z]+", "-", variant).strip("-")


def _run(run_dir: Path, config: ReproduceConfig, progress, text, stop_at) -> dict | None:
    gc, dc, lc, tasks = config.graph, config.denoise, config.lm, config.tasks
    every = dict(progress=progress, stop_at=stop_at, checkpoint_every=config.checkpoint_every)
    t0 = time.perf_counter()
    result = dict(tasks=list(tasks), overhead=paper_scale_overhead(), paper=PAPER)
    tables = {"overhead": overhead_markdown(result["overhead"])}

    if "graph" in tasks:
        graph_seeds = [config.seed + i for i in range(gc.seeds)]
        graph_runs, graph_rows = [], []
        p_star = graph_transition(gc.n)
        for readout in gc.readouts:
            runs = graph_train(run_dir / "graph" / readout, gc, graph_seeds, readout, **every)
            if runs is None:
                return None
            rows = [dict(r, readout=readout) for r in summarize_graph(runs, gc.variants)]
            example = {r["variant"]: r["p_hat"] for r in runs if r["seed"] == graph_seeds[0]}
            plot_graph(rows, p_star.tolist(), example, run_dir / f"graph_{readout}.png")
            graph_runs += runs
            graph_rows += rows
        result.update(graph=graph_rows, graph_runs=graph_runs)
        tables["graph"] = graph_markdown(graph_rows)
        result["graph_seconds"] = time.perf_counter() - t0

    if "denoise" in tasks:
        t1 = time.perf_counter()
        denoise_seeds = [config.seed + i for i in range(dc.seeds)]
        denoise_runs = denoise_train(run_dir / "denoise", dc, denoise_seeds, **every)
        if denoise_runs is None:
            return None
        denoise_rows = summarize_denoise(denoise_runs)
        plot_denoise(denoise_rows, run_dir / "denoise.png")
        result.update(denoise=denoise_rows, denoise_runs=denoise_runs)
        tables["denoise"] = denoise_markdown(denoise_rows, dc.main_sigma)
        result["denoise_seconds"] = time.perf_counter() - t1

    if "lm" in tasks:
        t1 = time.perf_counter()
        train, val, vocab = char_corpus(text)
        lm_runs = []
        for seed in range(config.seed, config.seed + lc.seeds):
            for variant in lc.variants:
                folder = run_dir / "lm" / _slug(variant) / f"seed{seed}"
                r = lm_train(folder, lc, train, val, len(vocab), variant, seed, **every)
                if r is None:
                    return None
                lm_runs.append(r)
        lm_rows = summarize_lm(lm_runs, lc.variants, lc.eval_contexts)
        plot_lm(lm_rows, list(lc.eval_contexts), run_dir / "lm.png")
        result.update(lm=lm_rows, lm_runs=lm_runs, lm_vocab=len(vocab), paper_lm=PAPER_LM,
                      lm_train_chars=len(train), lm_val_chars=len(val))  # fmt: skip
        tables["lm"] = lm_markdown(lm_rows, lc.eval_contexts)
        if all("spikiness" in r for r in lm_rows):
            tables["lm"] += "\n" + fig2_markdown(lm_rows, "lm")
        result["lm_seconds"] = time.perf_counter() - t1

    for name, md in tables.items():
        write_atomic(run_dir / f"{name}.md", md)
    result["seconds"] = time.perf_counter() - t0
    write_json(run_dir / "metrics.json", result)
    write_report(run_dir, result, config)
    return result


def write_report(run_dir: Path, result: dict, config: ReproduceConfig) -> Path:
    """RUN/report.md: each part's settings, table, caveats and figure."""
    gc, dc, lc = config.graph, config.denoise, config.lm
    parts = [
        f"""Profile: {"quick" if config.quick else "full"}; tasks {", ".join(result["tasks"])};
{result["seconds"]:.0f} s. These are our numbers from our runs; the paper's are printed beside
them.
"""
    ]
    if "graph" in result:
        parts.append(f"""## Graph next-token task (Sec. 4.1, Fig. 3, Table 1)

N = L = {gc.n}, d = {gc.d}, batch {gc.batch}, {gc.steps} Adam steps at lr {gc.lr:g}
(paper: lr 1e-4, steps not given), {gc.seeds} seeds, paired t-test p-values against vanilla.
The cross-entropy cannot go below H(P*) = E_q log(#neighbours) = 0.845 nats, so the paper's
0.0126 / 0.009 must be something else; the excess cross-entropy (= E_q KL(P*_q ‖ g_q)) is the
closest comparable quantity. err_map is reported both as the paper's Claim 1 defines it
(mean over queries of the row ℓ1 error) and summed over the 8 × 8 matrix.
Readouts: `classifier` is the paper's model (embedding → attention → linear classifier on the
last token); it can also solve the task by attending to the query itself and reading P*_q out of
its value, so its attention map need not approach P* and its err_map can stay large. `pointer`
makes the attention map itself the prediction (g = P̂_q), so training pulls P̂ toward P*.

{graph_markdown(result["graph"])}

Query temperature per neighbour group: τ_q = {"e^γ (uncapped; γ = 0 at initialisation)" if gc.query_activation == "exp" else "1 + tanh(γ) ∈ (0, 2) (capped)"}.
The paper's Table 1 reports a "temperature" that falls with fewer neighbours ("lower temperatures
... receive a sparser attention map"), i.e. the temperature 1/τ of the softmax, not the inverse
temperature τ that multiplies the scores; we list τ_q and 1/τ_q. Only τ_q·W_q·W_kᵀ enters the
scores, so τ_q's overall scale trades against ‖W‖; the ratio rows (each group's 1/τ_q divided by
the 4-neighbour group's) are the scale-free comparison. Adam moves γ by about lr per step, so
after S steps e^γ is within e^(±lr·S) of 1 (here e^(±{gc.lr * gc.steps:g})).

Fig. 2's measures on the same models: spikiness ‖s‖₁/(‖s‖₂²·L) of the attention rows (mean over the
N queries; 1 = uniform, 1/N = one-hot; P* itself scores 0.3125), ‖W_q·W_kᵀ‖₂ and the effective
τ_q·‖W_q·W_kᵀ‖₂ (Sec. 4.1: W_a = τ(a)·W; mean over queries). The paper's Fig. 2 (0.39 vs 0.26,
‖W‖ ≈ 3× smaller with SSA) is measured on Pythia, not on this task.

{"".join(report.image(f"graph_{ro}.png", f"{ro} readout: P* and P̂, learned 1/τ_q") for ro in gc.readouts)}""")
    if "denoise" in result:
        parts.append(f"""## Denoising (Sec. 4.3, Table 2)

K = d = {dc.k}, L = {dc.length}, α = 1/4, batch {dc.batch}, {dc.steps} Adam steps at lr {dc.lr:g},
{dc.seeds} seeds, {dc.eval_samples} held-out samples per seed. The paper's σ and L are not given;
we show its numbers beside σ = {dc.main_sigma:g}. A random unit vector scores exactly 2, and the
naive mean always has positive expected cosine with y, so the paper's naive 2.058 is not reachable
in expectation under the stated loss.

{denoise_markdown(result["denoise"], dc.main_sigma)}

Learned value temperatures: `weight sharing` is τ_v = 1 + tanh(w·GELU(x·W_v + b_v)) (the paper's
cheap form; it can push τ_v toward 0 only through GELU's small negative dip), `feature` is
τ_v = 1 + tanh(γ₁·max_j x_ij + γ₀) (App. B.2's feature-based form on the feature the proxy
thresholds). Our vanilla attention is read at x_L, which carries e_q, so it can already prefer
signal tokens by their similarity to x_L; that is why it is far below the paper's 1.390 here.

{report.image("denoise.png", "Denoising: loss against noise σ")}""")
    if "lm" in result:
        parts.append(lm_report(result, lc))
    parts.append(f"""## Parameter overhead (Sec. 3, App. B.2)

Temperatures on q and v with token and position terms, at the paper's model shapes (MLP hidden
width d/2, our choice: the paper does not give it).

{overhead_markdown(result["overhead"])}""")
    title = "Selective attention: reproductions (Zhang et al., NeurIPS 2024)"
    return report.write_report(run_dir, title, parts)


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
