"""What the synthetic experiments of ``sharpattn reproduce selective`` share: the paper's Fig. 2
numbers, the seed keys, the ensemble of one-head attention models (:mod:`.selective_graph`,
:mod:`.selective_denoise`), training then evaluating once, and the table cells.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from ..attention import selective_attend
from . import report
from .runner import Trainer, generator, once
from .stats import paired_comparison

# Fig. 2 (Pythia pre-trained from scratch on SlimPajama, first 1000 Wikitext tokens): the
# spikiness ‖s‖₁/(‖s‖₂²·L) and the mean ‖W_q·W_kᵀ‖ (read off the figure: vanilla ≈ 3× SSA)
PAPER_FIG2 = {"spikiness": {"vanilla": "0.39", "selective": "0.26"},
              "norm_ratio": "≈ 3 (vanilla / SSA)"}  # fmt: skip

# Seeds: runner.seed_int(seed, task, purpose, ...) — one stream per seed, task and purpose.
GRAPH, DENOISE, LM = 1, 2, 3
INIT, DATA, TEST = range(3)


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
        return [(s, self.task, INIT, i) for _, s in self.members]

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


def finish(trainer: Trainer, stop_at: int | None, evaluate, shape: Any = None) -> Any:
    """Train (or resume, or load) ``trainer``, then ``evaluate(state)`` once: the folder's
    evaluation.json, checked to be of ``shape`` (:func:`.runs.conforms`; None if ``stop_at``
    stopped the training, as a crash would)."""
    state = trainer.run(stop_at=stop_at)
    if state.get("stopped"):
        return None
    return once(trainer.folder / "evaluation.json", lambda: evaluate(state), shape)


# ---------------------------------------------------------------- statistics and tables


def compare(values, baseline) -> list[tuple[float, float, float]]:
    """Per column of ``values`` ``[seeds, columns]``: (mean, sd (0 for one seed), paired p-value
    against ``baseline`` of the same shape, NaN where undefined)."""
    c = paired_comparison(baseline, values)
    return [(float(m), float(np.nan_to_num(sd)), float(p))
            for m, sd, p in zip(c.mean_b, c.std_b, c.p_value, strict=True)]  # fmt: skip


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
        "variant", "spikiness ‖s‖₁/(‖s‖₂²·L)", "‖W_q·W_kᵀ‖₂", "τ_q·‖W_q·W_kᵀ‖₂",
        "vanilla / this: ‖W‖ (τ_q·‖W‖)", "paper spikiness"]  # fmt: skip
    body = []
    for r in rows:
        van = next(
            (v for v in rows if v["variant"] == "vanilla" and v.get("readout") == r.get("readout")),
            None,
        )
        key = "vanilla" if r["variant"] == "vanilla" else "selective"
        cells = [mean_cell(r[k], r.get(k + "_sd"), r.get(k + "_p")) for k in FIG2_METRICS]
        body.append(([r["readout"]] if task == "graph" else []) + [r["variant"], *cells,
                    "–" if van is None else f"{van['qk_norm'] / r['qk_norm']:.2f} "
                    f"({van['effective_qk_norm'] / r['effective_qk_norm']:.2f})",
                    paper["spikiness"][key]])  # fmt: skip
    return report.markdown_table(header, body)
