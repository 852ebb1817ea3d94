"""Corollary B.1 (Veličković et al., App. B) on a trained max-retrieval model.

The corollary: take two items v_a > v_b (here: priority ρ_a > ρ_b, classes κ_a ≠ κ_b) and the set
{v_a, v_b, …, v_b} of n items (one a, n − 1 copies of b), whose answer is κ_a. Item logits do
not depend on the other items, so the model's attention over that set is α·f(v_a) + (1 − α)·f(v_b)
with α = 1 / (1 + (n − 1)·e^{β(e_b − e_a)}) (β = 1 for softmax; adaptive temperature's β(H) from
the entropy H of the softmax row). The weight α must vanish as n grows, so the prediction
becomes g(f(v_b)) = κ_b: misclassified. The proof's bound: every weight is at most e^{δ/θ}/n
(δ the logit spread, θ = 1/β), so α < ε (machine epsilon) once n > n_B1 = e^{δ/θ}/ε.

For pairs drawn from the task distribution and each trained seed, `measure` finds

* ``n_fail``: the smallest n at which the model (its own weights, in float64 through the closed
  form above) predicts something other than κ_a on the set;
* ``n_eps``: the smallest n at which α < ε (float32's ε: the model's dtype);
* ``n_bound``: n_B1 = e^{β_max·δ}/ε with δ = |e_a − e_b| the set's logit spread (β_max = 1 for
  softmax; for adaptive the polynomial's largest β).

The closed form is checked against the model's own float32 forward on real sets of n* − 1 and
n* items where n* is small enough to build (``verify_max``).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .. import normalizers as nz
from ..lab import report
from ..lab.runner import Progress, emit, generator
from ..lab.runs import check_memory, write_json
from ..models import SetAttention
from ..normalizers.softmax import beta_from_entropy
from ..tasks.max_retrieval import N_CLASSES

Tensor = torch.Tensor

EPS = torch.finfo(torch.float32).eps
N_MAX = 1e40  # search limit for n (float64: n beyond 2^53 is found to 12 significant digits)
GRID = 401  # geometric grid points between 1 and N_MAX
_PAIRS_STREAM = 7  # generator stream of the pairs (max_retrieval uses 0..6)


def sample_pairs(
    count: int, g: torch.Generator, n_classes: int = N_CLASSES
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``count`` pairs (x_a, x_b, q, κ_a, κ_b): items ``(P, C + 1)`` with ρ_a > ρ_b and κ_a ≠ κ_b,
    queries ``(P, 1)``, as the task draws them."""
    if count < 1:
        raise ValueError(f"pairs must be >= 1, got {count}.")
    rho = torch.rand(count, 2, generator=g).sort(dim=-1, descending=True).values
    ka = torch.randint(n_classes, (count,), generator=g)
    kb = (ka + torch.randint(1, n_classes, (count,), generator=g)) % n_classes
    q = torch.rand(count, 1, generator=g)

    def item(r, k):
        return torch.cat((r[:, None], F.one_hot(k, n_classes).float()), dim=-1)

    return item(rho[:, 0], ka), item(rho[:, 1], kb), q, ka, kb


def weight_of_a(n: Tensor, e_a: Tensor, e_b: Tensor, method: str, coefficients="icml") -> Tensor:
    """α, the weight of v_a in {v_a, v_b × (n − 1)}, float64, broadcast over n and the logits.

    softmax: α = σ(e_a − e_b − log(n − 1)). adaptive (Fig. 4, as `nz.adaptive`): H = −Σ
    p·log(p + 1e-9) of that softmax row (one term for a, n − 1 equal terms for b), β = β(H), then
    α = σ(β·(e_a − e_b) − log(n − 1))."""
    n = n.double()
    d = (e_a - e_b).double()
    log_m = torch.log(n - 1)  # −inf at n = 1: α = 1
    alpha = torch.sigmoid(d - log_m)
    if method == "softmax":
        return alpha
    if method != "adaptive":
        raise ValueError(f"method must be 'softmax' or 'adaptive', got {method!r}.")
    p_b = torch.where(n > 1, (1 - alpha) / (n - 1).clamp_min(1), torch.zeros_like(alpha))
    h = -alpha * torch.log(alpha + 1e-9) - (n - 1) * p_b * torch.log(p_b + 1e-9)
    beta = beta_from_entropy(h, nz.resolve_coefficients(coefficients), 0.5, 1.0)
    return torch.sigmoid(beta * d - log_m)


class PairModel:
    """The trained model's pieces for a batch of pairs, in float64: item logits e_a, e_b, the
    embeddings h_a, h_b, and the readout of α·h_a + (1 − α)·h_b (the model's attention tail:
    value projection of Σα_i h_i plus Σα_i·b_v, then output projection and ϕ)."""

    @torch.no_grad()
    def __init__(self, model: SetAttention, xa: Tensor, xb: Tensor, q: Tensor):
        self.model = copy.deepcopy(model).double().eval()
        x = torch.stack((xa, xb), dim=1).double()  # (P, 2, F)
        h, _ = self.model.embed(x, q.double())
        self.h_a, self.h_b = h[:, 0], h[:, 1]  # (P, d)
        e = self.model.scores(x, q.double())  # (P, 2)
        self.e_a, self.e_b = e[:, 0], e[:, 1]

    @torch.no_grad()
    def logits(self, alpha: Tensor) -> Tensor:
        """Class logits ``(P, G, C)`` for weights α ``(P, G)`` of v_a."""
        a = alpha[..., None]
        att = a * self.h_a[:, None] + (1 - a) * self.h_b[:, None]  # (P, G, d), Σα = 1
        m = self.model
        return m.readout(att @ m.value.weight.T + m.value.bias)

    def predict(self, alpha: Tensor) -> Tensor:
        """Predicted classes ``(P, G)`` for weights α ``(P, G)``."""
        return self.logits(alpha).argmax(-1)


def first_n(fails, p: int) -> Tensor:
    """The smallest n in [1, N_MAX] with ``fails(n)`` (``fails``: n ``(P, G)`` float64 → bool
    ``(P, G)``) per pair: the first failing point of a geometric grid, refined by bisection
    against the grid point before it (the first crossing inside that interval), to the integer
    (to 12 significant digits beyond 10^12). −1 if none."""
    grid = torch.unique(torch.logspace(0, math.log10(N_MAX), GRID, dtype=torch.float64).round())
    bad = fails(grid.expand(p, -1))  # (P, G)
    found = bad.any(-1)
    idx = bad.float().argmax(-1)  # first failing grid index (0 if none)
    hi = grid[idx].clone()
    lo = torch.where(idx > 0, grid[(idx - 1).clamp_min(0)], torch.zeros_like(hi))
    # invariant: fails(hi), not fails(lo) (lo = 0 stands for "below n = 1")

    def open_(lo, hi):
        return (hi - lo) > torch.clamp_min(hi * 1e-12, 1.0)

    while bool(open_(lo, hi).any()):
        mid = torch.floor((lo + hi) / 2)
        step = open_(lo, hi)
        f = fails(mid.clamp_min(1)[:, None])[:, 0]
        hi = torch.where(step & f, mid, hi)
        lo = torch.where(step & ~f, mid, lo)
    return torch.where(found, hi, torch.full_like(hi, -1.0))


def beta_max(coefficients="icml") -> float:
    """The largest β adaptive temperature can apply: max(1, max over H > 0.5 of the polynomial)."""
    h = torch.linspace(0.5, 20.0, 20001, dtype=torch.float64)
    return max(1.0, float(nz.polyval(nz.resolve_coefficients(coefficients), h).max()))


def measure_pairs(
    model: SetAttention,
    xa: Tensor,
    xb: Tensor,
    q: Tensor,
    ka: Tensor,
    kb: Tensor,
    method: str,
    coefficients="icml",
) -> dict[str, Tensor]:
    """Per pair: n_fail, n_eps, n_bound, δ, and whether the model classifies {v_a} as κ_a and
    {v_b} as κ_b (the corollary's "trained properly")."""
    pm = PairModel(model, xa, xb, q)
    p = len(ka)

    def alpha(n):
        return weight_of_a(n, pm.e_a[:, None], pm.e_b[:, None], method, coefficients)

    ones, zeros = torch.ones(p, 1, dtype=torch.float64), torch.zeros(p, 1, dtype=torch.float64)
    proper = (pm.predict(ones)[:, 0] == ka) & (pm.predict(zeros)[:, 0] == kb)
    n_fail = first_n(lambda n: pm.predict(alpha(n)) != ka[:, None], p)
    n_eps = first_n(lambda n: alpha(n) < EPS, p)
    delta = (pm.e_a - pm.e_b).abs()
    b = 1.0 if method == "softmax" else beta_max(coefficients)
    log10_bound = (b * delta - math.log(EPS)) / math.log(10)
    return {
        "n_fail": n_fail,
        "n_eps": n_eps,
        "log10_n_bound": log10_bound,
        "delta": delta,
        "e_gap": pm.e_a - pm.e_b,
        "proper": proper,
    }


@torch.no_grad()
def verify(
    model: SetAttention, xa, xb, q, ka, n_fail: Tensor, method: str, limit: int, count: int
) -> dict[str, int]:
    """The model's own float32 forward on real sets (pairs with 2 <= n_fail <= ``limit``, at
    most ``count``): ``exact``, right at n_fail − 1 and wrong at n_fail; ``near``, right at
    ⌊0.95·n_fail⌋ and wrong at ⌈1.05·n_fail⌉ (float32 sums of n terms may move a knife-edge
    crossing by a few items)."""
    idx = [i for i in range(len(ka)) if 2 <= n_fail[i] <= limit][:count]

    def right(i: int, size: int) -> bool:
        x = torch.cat((xa[i : i + 1], xb[i : i + 1].expand(max(size, 1) - 1, -1)))[None]
        return int(model(x, q[i : i + 1], method=method).argmax(-1)) == int(ka[i])

    exact = near = 0
    for i in idx:
        n = int(n_fail[i])
        exact += right(i, n - 1) and not right(i, n)
        near += right(i, math.floor(0.95 * n)) and not right(i, math.ceil(1.05 * n))
    return {"checked": len(idx), "exact": exact, "near": near}


def _summary(res: dict[str, Tensor]) -> dict[str, Any]:
    proper = res["proper"]
    nf = res["n_fail"][proper]
    failed = nf[nf > 0]
    q = lambda t, v: float(torch.quantile(t, v)) if len(t) else math.nan  # noqa: E731
    bound = res["log10_n_bound"][proper]
    within = (nf > 0) & (torch.log10(nf.clamp_min(1)) <= bound + 1e-9)
    return {
        "pairs": int(len(proper)),
        "proper": int(proper.sum()),
        "failed": int(len(failed)),
        "n_fail_q25": q(failed, 0.25),
        "n_fail_median": q(failed, 0.5),
        "n_fail_q75": q(failed, 0.75),
        "n_fail_min": float(failed.min()) if len(failed) else math.nan,
        "n_fail_max": float(failed.max()) if len(failed) else math.nan,
        "n_eps_median": q(res["n_eps"][proper & (res["n_eps"] > 0)], 0.5),
        "log10_n_bound_median": q(bound, 0.5),
        "delta_median": q(res["delta"][proper], 0.5),
        "fail_within_bound": int(within.sum()),
    }


#: peak bytes per pair of `measure` (float64 (pairs, grid) weights, the (pairs, grid,
#: width) mixtures through the readout and their class logits): 2.1 MB measured (peak RSS growth
#: on 2,000 pairs), 1.6 times that here
_PAIR_BYTES = GRID * 8 * 128 * 8


def check_pairs(pairs: int) -> None:
    """Refuse, before any work, more pairs than the memory available holds."""
    check_memory(pairs * _PAIR_BYTES, f"{pairs:,} pairs", "--pairs")


def measure(
    models: dict[int, SetAttention],
    pairs: int = 200,
    methods=("softmax", "adaptive"),
    coefficients="icml",
    verify_max: int = 1 << 15,
    verify_count: int = 20,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Per seed and method: `_summary` of `measure_pairs` on ``pairs`` pairs (the same
    pairs for every seed and method, from the seed-independent stream), plus `verify`."""
    check_pairs(pairs)
    xa, xb, q, ka, kb = sample_pairs(pairs, generator(_PAIRS_STREAM))
    out: dict[str, Any] = {"pairs": pairs, "eps": EPS, "n_max": N_MAX, "seeds": {}}
    total, done = len(models) * len(methods), 0
    for seed, model in models.items():
        per = {}
        for method in methods:
            res = measure_pairs(model, xa, xb, q, ka, kb, method, coefficients)
            s = _summary(res)
            s["verify"] = verify(
                model, xa, xb, q, ka, res["n_fail"], method, verify_max, verify_count
            )
            per[method] = s
            done += 1
            emit(progress, "corollary B.1", f"seed {seed} {method}", done, total)
        out["seeds"][seed] = per
    return out


def _fmt_n(v: float) -> str:
    if not math.isfinite(v):
        return "–"
    return f"{v:,.0f}" if v < 1e6 else f"{v:.2e}"


def markdown(result: dict[str, Any]) -> str:
    header = [
        "seed",
        "method",
        "proper pairs",
        "misclassified by 10⁴⁰",
        "n_fail median [q25, q75]",
        "n_fail min / max",
        "n: α < ε (median)",
        "n_B1 = e^{βδ}/ε (median)",
        "δ (median)",
        "n_fail ≤ n_B1",
        "float32 forward: exact / ±5%",
    ]
    cells = []
    for seed, per in result["seeds"].items():
        for method, s in per.items():
            v = s["verify"]
            cells.append(
                [
                    str(seed),
                    method,
                    f"{s['proper']}/{s['pairs']}",
                    str(s["failed"]),
                    f"{_fmt_n(s['n_fail_median'])} [{_fmt_n(s['n_fail_q25'])}, {_fmt_n(s['n_fail_q75'])}]",
                    f"{_fmt_n(s['n_fail_min'])} / {_fmt_n(s['n_fail_max'])}",
                    _fmt_n(s["n_eps_median"]),
                    f"10^{s['log10_n_bound_median']:.1f}",
                    f"{s['delta_median']:.2f}",
                    f"{s['fail_within_bound']}/{s['failed']}",
                    f"{v['exact']}/{v['checked']} / {v['near']}/{v['checked']}",
                ]
            )
    return report.markdown_table(header, cells)


def write(run: Path, result: dict[str, Any]) -> Path:
    """corollary_b1.json and corollary_b1.md in the run folder."""
    run = Path(run)
    write_json(run / "corollary_b1.json", result)
    text = (
        f"Sets {{v_a, v_b × (n − 1)}} with ρ_a > ρ_b, κ_a ≠ κ_b: {result['pairs']} pairs from the "
        "task distribution (the same for every seed and method). *Proper*: the model classifies "
        "{v_a} as κ_a and {v_b} as κ_b (the corollary's assumption); statistics over proper "
        "pairs. n_fail: smallest n predicted ≠ κ_a (closed form in float64 with the model's "
        f"weights; search up to {N_MAX:.0e}); n: α < ε: where the weight of v_a falls below "
        f"float32's ε = {EPS:.3g}; n_B1 = e^{{βδ}}/ε, the proof's bound, δ = |e_a − e_b| "
        "(β = 1 for softmax, the polynomial's largest β for adaptive). Last column: sets of "
        "n_fail − 1 and n_fail items (exact), and of 0.95·n_fail and 1.05·n_fail items (±5%), "
        "through the model's own float32 forward: right, then wrong.\n\n" + markdown(result)
    )
    (run / "corollary_b1.md").write_text(text, encoding="utf-8")
    return run / "corollary_b1.md"


def median_over_seeds(result: dict[str, Any], method: str, key: str) -> float:
    vals = [per[method][key] for per in result["seeds"].values()]
    vals = [v for v in vals if math.isfinite(v)]
    return float(np.median(vals)) if vals else math.nan


def run(
    run_dir: str | Path,
    pairs: int = 200,
    seeds: list[int] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Measure every (or the given) seed of a trained max-retrieval run folder; write
    corollary_b1.{json,md} there and rewrite its report.md (which then includes them)."""
    from . import max_retrieval as mr

    run_dir = Path(run_dir)
    check_pairs(pairs)
    config = mr.read_config(run_dir)
    seeds = list(range(config.seeds)) if seeds is None else list(seeds)
    models = {s: mr.load_model(run_dir, config, s) for s in seeds}
    result = measure(models, pairs=pairs, coefficients=config.coefficients, progress=progress)
    write(run_dir, result)
    mr.write_report(run_dir)
    return result
