"""The paper's seven findings, each checked on the trained runs (`Finding`: number, title,
verdict, text)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...diagnostics import (
    sink_logit_stats,
)
from ...lab import report, runner
from ...lab.stats import linear_fit
from ...models.transformer import (
    Transformer,
)
from ...tasks.bigram_backcopy import KIND_BIGRAM, BigramBackcopy
from .config import CONVERGED, STREAM_BETA0
from .measures import internals, query_mask
from .training import Run

Tensor = torch.Tensor


@dataclass
class Finding:
    number: int
    title: str
    verdict: str  # "reproduced", "partly reproduced", "not reproduced"
    text: str


def series(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    steps = np.array([m["step"] for m in metrics], dtype=float)
    return steps, np.array([m[key] for m in metrics], dtype=float)


def _misses(checks: list[bool], notes: list[str]) -> str:
    """A plain sentence naming the parts of a finding that did not reproduce ('' if none)."""
    missed = [n for ok, n in zip(checks, notes, strict=True) if not ok]
    return (" **Does not reproduce here:** " + "; ".join(missed) + ".") if missed else ""


def findings_markdown(findings: list[Finding]) -> str:
    """Each finding's number, title and verdict."""
    rows = [[str(f.number), f.title, f.verdict] for f in findings]
    return report.markdown_table(["#", "finding", "verdict"], rows, "lll")


def _verdict(checks: list[bool]) -> str:
    if all(checks):
        return "reproduced"
    return "partly reproduced" if any(checks) else "not reproduced"


@torch.no_grad()
def bos_value_rank(model: Transformer, tokens: Tensor, layer: int = 0) -> float:
    """Fraction of sequences in which BOS has the smallest value-state norm of all positions."""
    _, cap = internals(model, tokens)
    n = cap[f"layers.{layer}.attn.values"].mean(1)  # (B, T)
    return float((n[:, 0] < n[:, 1:].amin(-1)).double().mean())


def finding_1(run: Run, task, tokens, inter: list[dict]) -> Finding:
    last = run.metrics[-1]
    bos_w, prev_w = last["layers.0.attn.bos_weight"], last["layers.0.attn.prev_weight_trigger"]
    smallest = bos_value_rank(run.model, tokens)
    rows = {r["zeroed"]: r for r in inter}
    base, no_mlp, no_attn = rows["none"], rows["layers.0.mlp"], rows["layers.0.attn"]
    log_v = math.log(task.V)
    checks = [
        bos_w > 0.5,
        prev_w > 0.5,
        smallest >= 0.9,
        no_mlp["bigram_excess"] > 1.0 and no_mlp["backcopy_risk"] < log_v,
        no_attn["backcopy_risk"] > log_v
        and abs(no_attn["bigram_excess"] - base["bigram_excess"]) < 0.1,
    ]
    text = (
        f"Non-trigger queries put {bos_w:.2f} of their weight on BOS (claim: most, > 0.5: "
        f"{'yes' if checks[0] else 'no'}); trigger queries put {prev_w:.2f} on the previous "
        f"position (> 0.5: {'yes' if checks[1] else 'no'}). BOS has the smallest value norm in "
        f"{smallest:.0%} of the {len(tokens)} evaluation sequences (‖Val_BOS‖ = "
        f"{last['layers.0.attn.val_bos']:.3f} vs mean ‖Val_other‖ = "
        f"{last['layers.0.attn.val_other']:.3f}). Zeroing the MLP takes the bigram excess risk "
        f"from {base['bigram_excess']:.3f} to {no_mlp['bigram_excess']:.3f} nats while the "
        f"backcopy risk stays {no_mlp['backcopy_risk']:.3f} < log V = {log_v:.3f} (random guess); "
        f"zeroing attention takes the backcopy risk to {no_attn['backcopy_risk']:.3f} nats "
        f"(random guess {log_v:.3f}) and moves the bigram excess risk by "
        f"{no_attn['bigram_excess'] - base['bigram_excess']:+.3f}."
    ) + _misses(
        checks,
        [
            "non-trigger queries do not put most of their weight on BOS",
            "trigger queries do not mostly attend to the previous position",
            "BOS does not have the smallest value norm in at least 90% of the sequences",
            "zeroing the MLP does not ruin the bigram risk while keeping backcopy better than random",
            "zeroing attention does not ruin the backcopy risk while leaving the bigram risk alone",
        ],
    )
    return Finding(
        1,
        "One layer, softmax: sink on BOS, backcopy head, value drain, division of labour",
        _verdict(checks),
        text,
    )


def converged_step(metrics: list[dict]) -> int | None:
    for m in metrics:
        if m["bigram_excess"] < CONVERGED and m["backcopy_excess"] < CONVERGED:
            return m["step"]
    return None


def finding_2(run: Run) -> Finding:
    t_conv = converged_step(run.metrics)
    if t_conv is None:
        return Finding(
            2,
            "Δlogit keeps growing after convergence; ‖Val_BOS‖ keeps falling",
            "not reproduced",
            f"The risks never fell below {CONVERGED} nats, so there is no 'after convergence'.",
        )
    after = [m for m in run.metrics if m["step"] >= t_conv]
    steps, dl = series(after, "layers.0.attn.delta_logit")
    _, vb = series(after, "layers.0.attn.val_bos")
    _, vo = series(after, "layers.0.attn.val_other")
    _, bw = series(after, "layers.0.attn.bos_weight")
    slope, r2 = linear_fit(np.log(steps), dl)
    falls = float(np.mean(np.diff(vb) < 0)) if len(vb) > 1 else float("nan")
    checks = [len(steps) >= 3, slope > 0 and r2 > 0.8, vb[-1] < vb[0]]
    text = (
        f"Both excess risks are below {CONVERGED} nats from step {t_conv} on; over the "
        f"{len(steps)} measurements from there to step {int(steps[-1])}, Δlogit goes from "
        f"{dl[0]:.2f} to {dl[-1]:.2f}, a least-squares slope of {slope:.2f} per unit of "
        f"log(step) with R² = {r2:.2f} (claim: grows roughly linearly in log step). The BOS "
        f"weight goes from {bw[0]:.2f} to {bw[-1]:.2f}. ‖Val_BOS‖ goes from {vb[0]:.3f} to "
        f"{vb[-1]:.3f} (falling in {falls:.0%} of the intervals; mean ‖Val_other‖ "
        f"{vo[0]:.3f} → {vo[-1]:.3f}, ratio {vb[0] / vo[0]:.2f} → {vb[-1] / vo[-1]:.2f})."
    ) + _misses(
        checks,
        [
            "fewer than 3 measurements after convergence",
            "Δlogit does not grow linearly in log(step) after convergence (slope > 0, R² > 0.8)",
            "‖Val_BOS‖ does not fall after convergence",
        ],
    )
    return Finding(
        2, "Δlogit keeps growing after convergence; ‖Val_BOS‖ keeps falling", _verdict(checks), text
    )


def finding_3(relu: Run, soft: Run) -> Finding:
    r, s = relu.metrics[-1], soft.metrics[-1]
    ratio_r, ratio_s = r["layers.0.attn.val_drain"], s["layers.0.attn.val_drain"]
    checks = [
        r["bigram_excess"] < CONVERGED and r["backcopy_excess"] < CONVERGED,
        r["layers.0.attn.bos_share"] < 0.5,
        ratio_r > 0.5 and ratio_r > 2 * ratio_s,
    ]
    text = (
        f"ReLU attention: bigram / backcopy excess risks {r['bigram_excess']:.3f} / "
        f"{r['backcopy_excess']:.3f} nats at step {r['step']} (softmax: "
        f"{s['bigram_excess']:.3f} / {s['backcopy_excess']:.3f}; converged = both < "
        f"{CONVERGED}). BOS takes {r['layers.0.attn.bos_share']:.2f} of a non-trigger query's "
        f"total weight (raw weight {r['layers.0.attn.bos_weight']:.3f}; softmax: "
        f"{s['layers.0.attn.bos_share']:.2f}); Δlogit {r['layers.0.attn.delta_logit']:.2f} "
        f"(softmax {s['layers.0.attn.delta_logit']:.2f}). ‖Val_BOS‖ / mean ‖Val_other‖ = "
        f"{ratio_r:.2f} (softmax {ratio_s:.2f}): no value drain means this ratio stays near "
        f"or above 1 (criterion: > 0.5 and more than twice softmax's)."
    ) + _misses(
        checks,
        [
            "ReLU attention does not reach the Bayes risk",
            "BOS still takes most of the ReLU weight (a sink)",
            "BOS's value state is still drained",
        ],
    )
    return Finding(
        3, "ReLU attention: Bayes risk without sink or value drain", _verdict(checks), text
    )


def finding_4(adam: Run, sgd: Run, relu: Run) -> Finding:
    parts, fits = [], {}
    for name, run in (("Adam", adam), ("SGD", sgd), ("ReLU attention with Adam", relu)):
        steps, peak = series(run.metrics, "layers.0.res_peak")
        _, rb = series(run.metrics, "layers.0.res_bos")
        late = steps >= steps[-1] / 8
        slope, r2 = linear_fit(steps[late], rb[late])
        fits[name] = (slope, r2, rb, peak)
        parts.append(
            f"{name}: ‖Res_BOS‖ at layer 0 goes {rb[0]:.2f} → {rb[-1]:.2f} (peak over the mean "
            f"of other tokens {peak[0]:+.2f} → {peak[-1]:+.2f}); linear fit over steps ≥ "
            f"{int(steps[-1] / 8)}: slope {slope * 1000:.3f} per 1000 steps, R² = {r2:.2f}"
        )
    a, s, r = fits["Adam"], fits["SGD"], fits["ReLU attention with Adam"]
    checks = [
        a[0] > 0 and a[1] > 0.9,
        a[3][-1] > 0 and a[3][-1] > 2 * max(s[3][-1], 0) and a[0] > 3 * max(s[0], 0),
        a[3][-1] > 2 * max(r[3][-1], 0) and a[0] > 3 * max(r[0], 0),
    ]
    text = (
        "; ".join(parts)
        + (
            ". Claim: with Adam the BOS residual norm grows roughly linearly (slope > 0, R² > 0.9); "
            "with SGD it does not (Adam's final peak more than twice SGD's and its slope more than "
            "three times), nor with ReLU attention trained by Adam (same criterion against the "
            "ReLU run)."
        )
        + _misses(
            checks,
            [
                "the Adam run's BOS residual norm does not grow linearly in steps",
                "no residual-state peak forms with Adam: BOS's residual is not well above the other "
                "tokens' (or its growth is not well above SGD's)",
                "ReLU attention also forms a residual-state peak (or grows BOS's residual as fast "
                "as softmax attention does)",
            ],
        )
    )
    last_sgd = sgd.metrics[-1]
    if max(last_sgd["bigram_excess"], last_sgd["backcopy_excess"]) >= CONVERGED:
        text += (
            f" Caveat: the SGD run has not converged (bigram / backcopy excess "
            f"{last_sgd['bigram_excess']:.3f} / {last_sgd['backcopy_excess']:.3f} nats at step "
            f"{last_sgd['step']}), so it is compared with Adam at an earlier stage of learning."
        )
    return Finding(
        4,
        "Three layers: residual-state peak with Adam, not with SGD or ReLU attention",
        _verdict(checks),
        text,
    )


def finding_5(
    task, t_alpha: float = 1e16, t_beta: float = 1e9, alpha_fixed: float = 3.0, seed: int = 0
):
    """Theorem 2 on the tiny-Shakespeare simplified model; returns the Finding and the flows."""
    from .theory import SimplifiedModel, gradient_flow

    sm = SimplifiedModel.from_task(task)
    off = sm.alpha_offset()
    moving = np.isfinite(off)
    fa = gradient_flow(sm, 0.0, 0.0, t_alpha, train=("alpha",))
    late = fa.t >= t_alpha / 100
    slopes = np.array(
        [linear_fit(np.log(fa.t[late]), fa.alpha[late, v])[0] for v in np.flatnonzero(moving)]
    )
    r = fa.alpha[1:] - 0.5 * np.log(fa.t[1:])[:, None]
    r_range = (float(r[:, moving].min()), float(r[:, moving].max()))
    dev = float(np.abs(r[-1, moving] - off[moving]).max())
    frozen = [task.chars[v] for v in np.flatnonzero((sm.pi_tilde > 0) & ~moving)]
    beta0 = runner.numpy_generator(seed, STREAM_BETA0).normal(size=sm.V)
    fb = gradient_flow(sm, alpha_fixed, beta0, t_beta, train=("beta",))
    printed, exact = sm.beta_limit(alpha_fixed, beta0), sm.beta_limit_exact(alpha_fixed, beta0)
    mx = sm.M * sm.xi
    shorthand = beta0.mean() - np.exp(-alpha_fixed) * mx

    def rel(target):
        return float(np.linalg.norm(fb.beta[-1] - target) / np.linalg.norm(beta0 - target))

    alone = [
        task.chars[v] for v in range(sm.V) if (sm.components() == sm.components()[v]).sum() == 1
    ]
    checks = [bool(np.all(np.abs(slopes - 0.5) < 0.05)), rel(exact) < 1e-4]
    text = (
        f"(a) β = 0·1 fixed, α(0) = 0, integrated to t = {t_alpha:.0e}: for the "
        f"{int(moving.sum())} non-trigger tokens whose bigram row is not a point mass, the slope of "
        f"α_v against log t over the last two decades is {slopes.min():.3f} … {slopes.max():.3f} "
        f"(theory ½), and r_v(t) = α_v − ½ log t stays within [{r_range[0]:.2f}, {r_range[1]:.2f}] "
        f"for t ≥ 1e-2, ending within {dev:.3f} of our leading-order constant "
        f"½ log(2 π̃_v Var_p(Mξ)). Tokens whose row is a point mass ({', '.join(map(repr, frozen)) or 'none'}) "
        f"are predicted exactly whatever α is, so their α never moves. "
        f"(b) α = {alpha_fixed:g}·1 fixed, β(0) ~ N(0, I), to t = {t_beta:.0e}: ‖β(t) − β*‖ / "
        f"‖β(0) − β*‖ = {rel(exact):.1e} for the limit computed per connected component, "
        f"{rel(printed):.3f} for Theorem 2(b) as printed, and {rel(shorthand):.3f} for the "
        f"issue's shorthand β̄(0)·1 − e^{{−α}} M∘ξ (it drops the constant e^{{−α}} B̄ = "
        f"{np.exp(-alpha_fixed) * mx.mean():.3f}). The printed formula is off only because "
        f"{', '.join(map(repr, alone)) or 'no token'} never follows a non-trigger in tiny "
        f"Shakespeare, so its β_v gets no gradient and keeps β_v(0); on every other token the "
        f"printed limit holds (mean of β conserved to "
        f"{abs(fb.beta[-1].mean() - beta0.mean()):.1e})."
    ) + _misses(
        checks,
        [
            "some α_v does not grow with slope ½ in log t",
            "the β flow does not reach the per-component limit",
        ],
    )
    return Finding(
        5, "Simplified model: α ≈ ½ log t + O(1); β → β̄(0)·1 − e^{−α}M∘ξ", _verdict(checks), text
    ), (sm, fa, fb, off, beta0, exact, alpha_fixed)


@torch.no_grad()
def sink_logit_concentration(
    model: Transformer, task: BigramBackcopy, tokens: Tensor, layer: int = 0
) -> dict[str, float]:
    """`sink_logit_stats` of ``layer``'s scores (heads averaged) over the non-trigger
    queries of ``tokens``."""
    _, cap = internals(model, tokens)
    sc = cap[f"layers.{layer}.attn.scores"].mean(1)
    return sink_logit_stats(sc, tokens, query_mask(task, tokens, KIND_BIGRAM))


def finding_6(soft: Run, task, tokens) -> Finding:
    """Table 1 / Fig. 10b: sink-logit concentration on the one-layer softmax run."""
    c = sink_logit_concentration(soft.model, task, tokens)
    checks = [c["delta_mean"] > 0, 0 <= c["rel_spread"] < 0.25]
    text = (
        f"Over the {c['tokens']} non-trigger tokens seen as queries in the evaluation "
        f"sequences, the per-token mean logit on BOS is {c['bos_logit_mean']:.2f} with a "
        f"standard deviation of {c['bos_logit_std']:.2f} across tokens, against a mean Δlogit "
        f"(BOS over the other keys) of {c['delta_mean']:.2f}: a relative spread of "
        f"{c['rel_spread']:.2f} (claim: nearly identical logits; criterion < 0.25). The paper "
        "states it qualitatively (✓ in Table 1; Fig. 10b for OLMo)."
    ) + _misses(
        checks,
        [
            "BOS does not get a larger logit than the other keys",
            "the BOS logits of different query tokens are not concentrated (spread ≥ 0.25)",
        ],
    )
    return Finding(6, "Sink-logit concentration (Table 1, Fig. 10b)", _verdict(checks), text)


def finding_7(steps: int = 10_000, fit_from: int = 1_000) -> tuple[Finding, dict]:
    """Prop. B.0 / Fig. 15: m trained on dm = log t / (√t m³) by Adam grows linearly, by SGD
    it stays small (lr 0.3 both)."""
    from .theory import prop_b0_simulation

    adam, sgd = prop_b0_simulation("adam", steps), prop_b0_simulation("sgd", steps)
    t = np.arange(steps + 1)
    fits = {n: linear_fit(t[fit_from:], m[fit_from:]) for n, m in (("adam", adam), ("sgd", sgd))}
    (sa, ra), (ss, _) = fits["adam"], fits["sgd"]
    checks = [sa > 0 and ra > 0.98, adam[-1] > 3 * sgd[-1]]
    text = (
        f"Adam (lr 0.3, betas (0.9, 0.999), weight decay 1e-8), m(0) = 1: m = "
        f"{adam[fit_from]:.2f} at step {fit_from}, {adam[-1]:.2f} at step {steps}; least "
        f"squares over steps {fit_from}-{steps}: {sa * 1000:.2f} per 1,000 steps, R² = {ra:.3f} "
        f"(claim: linear growth after a warm-up). SGD (lr 0.3): m = {sgd[-1]:.2f} at step "
        f"{steps} ({ss * 1000:.3f} per 1,000 steps; m⁴ ~ √t log t). Adam's slope is far below "
        "its lr: the second-moment average remembers the larger early gradients."
    ) + _misses(
        checks,
        ["Adam does not grow m linearly (R² ≤ 0.98)", "SGD grows m as much as Adam"],
    )
    return Finding(
        7,
        "Prop. B.0 / Fig. 15: Adam grows the residual scalar linearly, SGD does not",
        _verdict(checks),
        text,
    ), {"adam": adam, "sgd": sgd}
