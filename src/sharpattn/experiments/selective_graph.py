"""`sharpattn reproduce selective`'s graph next-token task (Zhang et al., NeurIPS 2024, Sec. 4.1,
Fig. 3, Table 1, App. A).

Vocabulary N = 8, each sequence a random order of all 8 tokens, query = the last token q; the next
token is uniform over q and its neighbours in the tree 0-1, 0-2, 0-3, 1-4, 2-5, 3-6 (7 isolated),
so the neighbour counts (self included) are 4, 3, 3, 3, 2, 2, 2, 1. Model: unit-norm token
embeddings, one attention layer with one head, a linear classifier on the last position; Adam,
lr 1e-4, cross-entropy. Vanilla vs query temperature (App. A: "a scaling parameter to each group
of nodes that share the same number of neighbors": τ_q = e^{γ_g}, the feature-based token
temperature on the one-hot group feature with the uncapped "exp" activation;
``query_activation="tanh"`` gives the capped τ_q = 1 + tanh(γ_g) ∈ (0, 2) of before) and the
weight-sharing query temperature.

The model's output at the last position does not depend on the order of the other tokens (no
positional information), so the population cross-entropy and attention map are computed exactly
from the N sequences "all other tokens, then q".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import normalizers as nz
from ..attention import SelectiveConfig
from ..attention.selective import Temperature
from ..diagnostics import qk_operator_norm, spikiness
from ..lab import report
from ..lab.runner import Progress, Trainer, generator
from .paper_numbers import GRAPH_CROSS_ENTROPY, GRAPH_ERR_MAP
from .selective_common import (
    DATA,
    FIG2_CLAIMS,
    FIG2_METRICS,
    GRAPH,
    OneHeadEnsemble,
    compare,
    fig2_markdown,
    finish,
    mean_cell,
    member_linear,
    memberwise,
    store,
    verdict_markdown,
)

PAPER = {  # as printed in the paper (`paper_numbers`)
    "cross_entropy": {
        "vanilla": GRAPH_CROSS_ENTROPY.before,
        "selective": GRAPH_CROSS_ENTROPY.after,
    },
    "err_map": {"vanilla": GRAPH_ERR_MAP.before, "selective": GRAPH_ERR_MAP.after},
    "temperature": {1: "0.002", 2: "0.019", 3: "0.152", 4: "0.751"},
}

GRAPH_EDGES = ((0, 1), (0, 2), (0, 3), (1, 4), (2, 5), (3, 6))


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

    def __init__(
        self,
        n: int,
        d: int,
        members: list[tuple[str, int]],
        readout: str = "classifier",
        activation: str = "exp",
    ):
        super().__init__(d, d, members, task=GRAPH)
        if readout not in ("classifier", "pointer"):
            raise ValueError(f"readout must be 'classifier' or 'pointer', got {readout!r}.")
        self.readout = readout
        embed = [torch.randn(n, d, generator=generator(*k)) for k in self.keys(7)]
        self.embed = nn.Parameter(torch.stack(embed))
        self.classifier = member_linear(d, n, self.keys(8), self.keys(9))
        counts = (graph_transition(n) > 0).sum(-1)  # neighbours incl. self, per token
        self.groups = sorted(set(counts.tolist()))
        onehot = F.one_hot(torch.tensor([self.groups.index(c) for c in counts.tolist()]))
        self.register_buffer("group_features", onehot.float())  # [N, groups]
        cfg = SelectiveConfig(
            "q",
            token="feature",
            num_features=len(self.groups),
            terms="token",
            activation=activation,
        )
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
            logits = memberwise(self.classifier, out)
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
    q = model.query(model.embeddings(seqs))
    tau = model.query_temperature(seqs, q)[:, :, 0]  # (N queries, E)
    entropy = nz.entropy(p_star).mean().item()  # H(P*)
    counts = (p_star > 0).sum(-1)
    spiky = spikiness(w)  # (N queries, E): Fig. 2's ‖s‖₁ / (‖s‖₂²·L), L = N keys
    # (E,): ‖W_q·W_kᵀ‖₂ (biases not included; W in x·W layout)
    w_norm = qk_operator_norm(model.q.weight.transpose(1, 2), model.k.weight.transpose(1, 2))
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


def graph_train(
    folder: Path,
    cfg: GraphConfig,
    seeds: list[int],
    readout: str = "classifier",
    progress: Progress | None = None,
    stop_at: int | None = None,
    checkpoint_every: int = 1000,
) -> list[dict] | None:
    """Train every (variant, seed) member of one readout together, as one ensemble in
    ``folder``; one metrics dict per member. Seed s draws its sequences from its own stream,
    whatever the other seeds and variants."""
    members = [(v, s) for v in cfg.variants for s in seeds]
    model = GraphEnsemble(cfg.n, cfg.d, members, readout=readout, activation=cfg.query_activation)
    group = torch.tensor([seeds.index(s) for _, s in members])  # member -> its data stream
    p_star = graph_transition(cfg.n)
    data = {s: generator(s, GRAPH, DATA) for s in seeds}

    def batch(step: int):
        seqs, y = zip(*(graph_batch(cfg.batch, 1, p_star, g) for g in data.values()), strict=True)
        return torch.cat(seqs, 1)[:, group], torch.cat(y, 1)[:, group]  # (B, E, N), (B, E)

    def loss(model: GraphEnsemble, b) -> torch.Tensor:  # each member's mean cross-entropy
        return F.cross_entropy(model(b[0]).transpose(1, 2), b[1], reduction="none").mean(0)

    trainer = Trainer(
        folder,
        model,
        torch.optim.Adam(model.parameters(), lr=cfg.lr),
        steps=cfg.steps,
        batch=batch,
        loss=loss,
        generators={f"data{s}": g for s, g in data.items()},
        checkpoint_every=checkpoint_every,
        task=f"graph ({readout})",
        progress=progress,
    )
    rows = [
        {
            "variant": str,
            "seed": int,
            "cross_entropy": float,
            "excess_cross_entropy": float,
            "err_map": float,
            "tau_by_group": {str: float},
            "readout": str,
        }
    ]
    return finish(
        trainer,
        stop_at,
        lambda state: [dict(r, readout=readout) for r in graph_evaluate(model, p_star)],
        rows,
    )


# ---------------------------------------------------------------- statistics, plot, report


GRAPH_METRICS = ("cross_entropy", "excess_cross_entropy", "err_map", "err_map_sum")
#: the claims of §4.1 and Fig. 3 as changes from vanilla (`paper_numbers`)
GRAPH_CLAIMS = {"cross_entropy": GRAPH_CROSS_ENTROPY, "err_map": GRAPH_ERR_MAP}
#: the measures judged against the paper, with their labels
GRAPH_VERDICTS = {
    "cross_entropy": "cross-entropy",
    "err_map": "err_map",
    "spikiness": "spikiness (Fig. 2)",
    "qk_norm": "‖W_q·W_kᵀ‖₂ (Fig. 2)",
}


def summarize_graph(runs: list[dict], variants) -> list[dict]:
    """Per variant: mean ± sd over seeds, paired p-value against vanilla, mean τ_q per group."""
    rows = []
    table = lambda rs: [[r[k] for k in GRAPH_METRICS] for r in rs]  # noqa: E731
    vanilla = [r for r in runs if r["variant"] == "vanilla"]
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        base = vanilla if len(vanilla) == len(rs) else rs
        row = dict(variant=v, seeds=len(rs))
        claims = [GRAPH_CLAIMS.get(k) for k in GRAPH_METRICS]
        for key, col in zip(GRAPH_METRICS, compare(table(rs), table(base), claims), strict=True):
            store(row, key, col)
        if all(k in r for r in rs + base for k in FIG2_METRICS):  # runs before Fig. 2 lack them
            fig2 = lambda rs: [[r[k] for k in FIG2_METRICS] for r in rs]  # noqa: E731
            claims = [FIG2_CLAIMS.get(k) for k in FIG2_METRICS]
            for key, col in zip(FIG2_METRICS, compare(fig2(rs), fig2(base), claims), strict=True):
                store(row, key, col)
        groups = sorted(rs[0]["tau_by_group"], key=int)
        row["tau_by_group"] = {
            int(c): float(np.mean([r["tau_by_group"][c] for r in rs])) for c in groups
        }
        rows.append(row)
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
        paper = PAPER["temperature"]
        ax.plot(list(paper), [float(t) for t in paper.values()], "k--", label="paper Table 1")
        ax.set(yscale="log", xlabel="neighbours (incl. self)", ylabel="temperature 1/τ_q")
        ax.set_title("learned query temperature", fontsize=9)
        ax.legend(fontsize=7)


def graph_markdown(rows) -> str:
    paper = PAPER
    header = [
        "readout",
        "variant",
        "seeds",
        "cross-entropy",
        "excess CE (CE − H(P*))",
        "err_map E_q‖P̂_q − P*_q‖₁",
        "err_map Σ‖P̂ − P*‖₁",
        "paper CE",
        "paper err_map",
    ]
    main = []
    for r in rows:
        key = "vanilla" if r["variant"] == "vanilla" else "selective"
        cells = [
            mean_cell(r[k], r[k + "_sd"], r[k + "_p"] if k != "cross_entropy" else None)
            for k in GRAPH_METRICS
        ]
        main.append(
            [
                r["readout"],
                r["variant"],
                r["seeds"],
                *cells,
                paper["cross_entropy"][key],
                paper["err_map"][key],
            ]
        )
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
        + "\n"
        + verdict_markdown(rows, GRAPH_VERDICTS, group="readout")
    )


def graph_report(result: dict, gc: GraphConfig) -> str:
    """report.md's graph section: settings, tables, what can be compared, figures."""
    return f"""## Graph next-token task (Sec. 4.1, Fig. 3, Table 1)

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

{"".join(report.image(f"graph_{ro}.png", f"{ro} readout: P* and P̂, learned 1/τ_q") for ro in gc.readouts)}"""
