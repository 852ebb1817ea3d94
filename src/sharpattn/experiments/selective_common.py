"""What the synthetic experiments of ``sharpattn reproduce selective`` share: the paper's Fig. 2
numbers, the seed keys, the ensemble of one-head attention models (`selective_graph`,
`selective_denoise`), training then evaluating once, and the table cells.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..attention import selective_attend
from ..lab import report
from ..lab.runner import Trainer, generator, once
from ..lab.stats import alpha_words, paired_comparison, reproduction_verdict, reproduction_verdicts
from ..models.ensemble import StackedLinear
from .paper_numbers import QK_NORM, SPIKINESS, PaperChange, PaperClaim

# Fig. 2 (Pythia pre-trained from scratch on SlimPajama, first 1000 Wikitext tokens): the
# spikiness ‖s‖₁/(‖s‖₂²·L) and the mean ‖W_q·W_kᵀ‖ (read off the figure: vanilla ≈ 3× SSA)
PAPER_FIG2 = {
    "spikiness": {"vanilla": SPIKINESS.before, "selective": SPIKINESS.after},
    "norm_ratio": "≈ 3 (vanilla / SSA)",
}
#: Fig. 2's claims as changes from vanilla (`paper_numbers`)
FIG2_CLAIMS = {"spikiness": SPIKINESS, "qk_norm": QK_NORM}

# Seeds: runner.seed_int(seed, task, purpose, ...) — one stream per seed, task and purpose.
GRAPH, DENOISE, LM = 1, 2, 3
INIT, DATA, TEST = range(3)


# ---------------------------------------------------------------- ensembles of one-head models


def member_linear(d_in: int, d_out: int, weight_keys, bias_keys) -> StackedLinear:
    """A `StackedLinear` ``d_in → d_out`` whose member i is
    nn.Linear's U(±1/√d_in), its weight drawn from ``generator(*weight_keys[i])`` (as ``[d_in,
    d_out]``, then transposed) and its bias from ``generator(*bias_keys[i])``: a member starts
    alike whatever the other members."""
    bound = 1 / math.sqrt(d_in)
    draw = lambda keys, *shape: torch.stack(  # noqa: E731
        [torch.rand(*shape, generator=generator(*k)) for k in keys]
    )
    layer = nn.utils.skip_init(StackedLinear, len(weight_keys), d_in, d_out)
    with torch.no_grad():
        layer.weight.copy_((draw(weight_keys, d_in, d_out) * 2 - 1).mul_(bound).transpose(1, 2))
        layer.bias.copy_((draw(bias_keys, d_out) * 2 - 1).mul_(bound).unsqueeze(1))
    return layer


def memberwise(layer: StackedLinear, x: torch.Tensor) -> torch.Tensor:
    """``layer`` on ``x`` ``[B, E, ..., d_in]`` (members along dim 1) -> ``[B, E, ..., d_out]``."""
    return layer(x.transpose(0, 1)).transpose(0, 1)


# Files written before the ensembles were StackedLinear held each linear map as one parameter
# [E, d_in, d_out] (x·W layout) and one bias [E, d_out]: the old names of (weight, bias).
_OLD_NAMES = {"q": ("wq", "bq"), "k": ("wk", "bk"), "v": ("wv", "bv"), "classifier": ("wc", "bc")}


class OneHeadEnsemble(nn.Module):
    """E independent one-layer, one-head attention models run as the E heads of one batched call.

    Nothing mixes heads and Adam is elementwise, so member e trains exactly as it would alone; this
    only removes Python overhead (the CPU is shared). Members of different variants with the same
    seed start from the same weights and see the same data, so comparisons are paired. The
    projections ``q``, ``k``, ``v`` are stacked linear layers (`sharpattn.models.ensemble`).
    """

    def __init__(self, d_in: int, d: int, members: list[tuple[str, int]], task: int):
        super().__init__()
        self.members, self.task = members, task
        self.q, self.k, self.v = (
            member_linear(d_in, d, self.keys(i), self.keys(3 + i)) for i in range(3)
        )

    def keys(self, i: int) -> list[tuple[int, ...]]:
        """The seed keys of parameter ``i``, one per member: members of one seed start alike."""
        return [(s, self.task, INIT, i) for _, s in self.members]

    def block(self, variant: str) -> slice:
        """The members of ``variant`` (members are ordered variant by variant)."""
        idx = [i for i, (v, _) in enumerate(self.members) if v == variant]
        if idx and idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError("ensemble members must be grouped by variant.")
        return slice(idx[0], idx[-1] + 1) if idx else slice(0, 0)

    def count(self, variant: str) -> int:
        return sum(v == variant for v, _ in self.members)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """The last token's query ``[B, E, 1, d]`` of ``x`` ``[B, E, L, d_in]``."""
        return memberwise(self.q, x[:, :, -1:])

    def attend_last(self, x: torch.Tensor, temperatures, return_weights=False):
        """The last token's attention output ``[B, E, d]`` (and weights ``[B, E, L]``).

        ``temperatures(q, v)`` returns (τ_q ``[B, E, 1]`` or None, τ_v ``[B, E, L]`` or None).
        """
        q = self.query(x)  # (B, E, 1, d)
        k, v = memberwise(self.k, x), memberwise(self.v, x)  # (B, E, L, d)
        tau_q, tau_v = temperatures(q, v)
        out = selective_attend(
            q, k, v, tau_q=tau_q, tau_v=tau_v, return_weights=return_weights, check_finite=False
        )
        if return_weights:
            return out[0][:, :, 0], out[1][:, :, 0]
        return out[:, :, 0]

    def upgrade_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint file's tensors of the layout before (`_OLD_NAMES`) in this one's:
        weights transposed, biases given their member row, Adam's moments alike and renumbered
        (the old order: the weights of q, k, v, their biases, the model's own parameters, the
        readout's weight and bias, the temperatures). Files of this layout pass unchanged."""
        if "model.wq" not in tensors:
            return tensors
        names = [n for n, _ in self.named_parameters()]
        renamed = {
            old[j]: f"{m}.{part}"
            for m, old in _OLD_NAMES.items()
            if hasattr(self, m)
            for j, part in enumerate(("weight", "bias"))
        }
        rest = [n for n in names if n not in renamed.values()]
        own, children = [n for n in rest if "." not in n], [n for n in rest if "." in n]
        old_order = ["wq", "wk", "wv", "bq", "bk", "bv", *own]
        old_order += ["wc", "bc"] if "wc" in renamed else []
        old_order += children
        weights = {w for w, _ in _OLD_NAMES.values()}

        def layout(old: str, t: torch.Tensor) -> torch.Tensor:
            if old not in renamed or t.dim() == 0:  # not a linear map's, or Adam's step count
                return t
            return t.transpose(1, 2).contiguous() if old in weights else t.unsqueeze(1)

        out = {}
        for key, t in tensors.items():
            kind, _, name = key.partition(".")
            if kind == "model":
                out[f"model.{renamed.get(name, name)}"] = layout(name, t)
            elif kind == "optim":
                idx, _, state = name.partition(".")
                old = old_order[int(idx)]
                out[f"optim.{names.index(renamed.get(old, old))}.{state}"] = layout(old, t)
            else:
                out[key] = t
        return out


def finish(trainer: Trainer, stop_at: int | None, evaluate, shape: Any = None) -> Any:
    """Train (or resume, or load) ``trainer``, then ``evaluate(state)`` once: the folder's
    evaluation.json, checked to be of ``shape`` (`runs.conforms`; None if ``stop_at``
    stopped the training, as a crash would)."""
    state = trainer.run(stop_at=stop_at)
    if state.get("stopped"):
        return None
    return once(trainer.folder / "evaluation.json", lambda: evaluate(state), shape)


# ---------------------------------------------------------------- statistics and tables


@dataclass(frozen=True)
class Column:
    """One measure of a variant over seeds against vanilla's (`compare`): its mean and sd (0 for
    one seed), and the paired change from vanilla with its 95 % interval, the paired t-test p,
    the change detected with 80 % power and the verdict against the paper's claim ("–" where
    the paper makes none); NaN where undefined."""

    mean: float
    sd: float
    p: float
    change: float
    low: float
    high: float
    detectable: float
    paper: str
    verdict: str
    #: what the page's Holm correction re-judges it from (`verdict_markdown`): vanilla's and the
    #: variant's value per seed and the sign of the paper's claim
    pair: dict[str, Any] | None = None


def compare(
    values, baseline, claims: list[PaperChange | PaperClaim | None] | None = None
) -> list[Column]:
    """Per column of ``values`` ``[seeds, columns]`` against ``baseline`` of the same shape (the
    same seeds), a `Column`. ``claims``: per column, the paper's change or claim
    (`paper_numbers`; its words and sign go to `stats.reproduction_verdict`), or None where the
    paper makes no claim."""
    c = paired_comparison(baseline, values)
    a, b = np.asarray(baseline, dtype=np.float64), np.asarray(values, dtype=np.float64)
    out = []
    for j, (m, sd) in enumerate(zip(c.mean_b, c.std_b, strict=True)):
        claim = (claims or [None] * len(c.mean_b))[j]
        paper, sign = (claim.words, claim.sign) if claim is not None else ("–", -1)
        v = reproduction_verdict(a[:, j], b[:, j], paper=paper, sign=sign)
        out.append(
            Column(
                float(m),
                float(np.nan_to_num(sd)),
                float(c.p_value[j]),
                v.effect.mean,
                v.effect.low,
                v.effect.high,
                v.detectable,
                paper,
                v.verdict if paper != "–" else "–",
                dict(a=a[:, j].tolist(), b=b[:, j].tolist(), sign=sign) if paper != "–" else None,
            )
        )
    return out


def store(row: dict[str, Any], key: str, col: Column) -> None:
    """``row``'s fields for measure ``key``: ``key`` (the mean), ``key_sd``, ``key_p`` and the
    change from vanilla (``key_change``, ``_low``, ``_high``, ``_detectable``, ``_paper``,
    ``_verdict``, and ``_pair`` where the paper makes a claim)."""
    row[key], row[f"{key}_sd"], row[f"{key}_p"] = col.mean, col.sd, col.p
    for field in ("change", "low", "high", "detectable", "paper", "verdict"):
        row[f"{key}_{field}"] = getattr(col, field)
    if col.pair is not None:
        row[f"{key}_pair"] = col.pair


def judge_page(rows, measures) -> int:
    """Re-judge every verdict of a page (each non-vanilla row of ``rows`` on ``measures`` where
    the paper makes a claim) as one family, Holm-corrected (`stats.reproduction_verdicts`):
    each row's ``_verdict`` and ``_detectable`` are replaced and ``_holm`` (the adjusted p) is
    added. Returns the family's size m (the comparisons with a test)."""
    cells = [
        (r, key)
        for r in rows
        if r["variant"] != "vanilla"
        for key in measures
        if f"{key}_pair" in r
    ]
    judged = reproduction_verdicts(
        [
            dict(
                a=r[f"{k}_pair"]["a"],
                b=r[f"{k}_pair"]["b"],
                paper=r[f"{k}_paper"],
                sign=r[f"{k}_pair"]["sign"],
            )
            for r, k in cells
        ]
    )
    for (r, key), v in zip(cells, judged, strict=True):
        r[f"{key}_verdict"], r[f"{key}_holm"] = v.verdict, v.adjusted_p
        r[f"{key}_detectable"] = v.detectable
    return max((v.m for v in judged), default=1)


def verdict_markdown(rows, measures: dict[str, str], group: str | None = None) -> str:
    """The seed-level verdicts of every non-vanilla row of ``rows`` on ``measures`` (key ->
    label; `store`'s fields), judged as one family (`judge_page`, Holm): the change from
    vanilla with its 95 % interval over seeds, the p-value Holm-corrected over the page's
    claims, the change detected with 80 % power at Holm's strictest threshold, the paper's
    change and the verdict; ``group``: a row key shown first (the readout, the noise level).
    Empty where no row has them."""
    m = judge_page(rows, measures)
    header = ([group] if group else []) + [
        "variant",
        "measure",
        "change vs vanilla",
        "95 % interval (seeds)",
        f"p, Holm over {m}",
        f"detectable (80 % power, {alpha_words(0.05, m)})",
        "paper",
        "verdict",
    ]
    body = []
    for r in rows:
        if r["variant"] == "vanilla":
            continue
        for key, label in measures.items():
            if f"{key}_change" not in r:
                continue
            body.append(
                ([r[group]] if group else [])
                + [
                    r["variant"],
                    label,
                    report.cell(r[f"{key}_change"]),
                    report.bounds(r[f"{key}_low"], r[f"{key}_high"], "+.3g"),
                    report.p_cell(r.get(f"{key}_holm", float("nan"))),
                    report.cell(r[f"{key}_detectable"]),
                    r[f"{key}_paper"],
                    # the verdict's words: its numbers are in the columns beside it
                    r[f"{key}_verdict"].split(" (detectable")[0],
                ]
            )
    if not body:
        return ""
    return (
        "Each variant against vanilla over seeds (the unit randomised; paired): the change, its "
        f"95 % t interval, the p-value Holm-corrected over the page's {m} claim"
        f"{'s' * (m != 1)} with a test (the verdict's), the change the paired t-test detects "
        f"with 80 % power at Holm's strictest threshold ({alpha_words(0.05, m)}), and the "
        "verdict where the paper claims a change.\n\n"
        + report.markdown_table(header, body, ("r" if group else "") + "llrrrrll")
    )


FIG2_METRICS = ("spikiness", "qk_norm", "effective_qk_norm")


def mean_cell(m, sd=None, p=None) -> str:
    """A table cell: mean (± sd where there is one) (p=... where defined)."""
    s = f"{m:.4f}" + (f" ± {sd:.4f}" if sd else "")
    if p is not None and not math.isnan(p):
        s += f" (p={p:.2g})"
    return s


def fig2_markdown(rows, task: str) -> str:
    """Fig. 2's measures per variant (mean ± sd over seeds, paired p against vanilla)."""
    paper = PAPER_FIG2
    header = (["readout"] if task == "graph" else []) + [
        "variant",
        "spikiness ‖s‖₁/(‖s‖₂²·L)",
        "‖W_q·W_kᵀ‖₂",
        "τ_q·‖W_q·W_kᵀ‖₂",
        "vanilla / this: ‖W‖ (τ_q·‖W‖)",
        "paper spikiness",
    ]
    body = []
    for r in rows:
        van = next(
            (v for v in rows if v["variant"] == "vanilla" and v.get("readout") == r.get("readout")),
            None,
        )
        key = "vanilla" if r["variant"] == "vanilla" else "selective"
        cells = [mean_cell(r[k], r.get(k + "_sd"), r.get(k + "_p")) for k in FIG2_METRICS]
        body.append(
            ([r["readout"]] if task == "graph" else [])
            + [
                r["variant"],
                *cells,
                "–"
                if van is None
                else f"{van['qk_norm'] / r['qk_norm']:.2f} "
                f"({van['effective_qk_norm'] / r['effective_qk_norm']:.2f})",
                paper["spikiness"][key],
            ]
        )
    return report.markdown_table(header, body)
