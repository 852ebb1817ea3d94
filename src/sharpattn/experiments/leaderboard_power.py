"""The leaderboard's power: what a run can detect, planned before it trains.

A board that compares m methods with one reference (softmax) at Holm's level can only call a
difference larger than its seeds' spread allows. This module reads an existing run or record (a
pilot), estimates the seed-to-seed spread of each method's overall score and the CPU time of a
seed, and finds the seeds per arm that bring the median detectable difference (80 % power, at
Holm's strictest threshold α/m) to a chosen size at the least CPU time (`allocate`).

The arms may have different numbers of seeds (unequal allocation: the reference, compared m
times, gets more). The analysis that allows it is Welch's t-test over independent seeds
(`stats.welch_effect`); a method evaluated on the reference's own models (``adaptive
(inference)``, ``logn (inference)``) is paired with it seed by seed. Pairing by seed would buy
little for the others: on the standard board it removes about 8 % of the variance.
"""

from __future__ import annotations

import functools
import math
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..lab.runner import read_config
from ..lab.stats import at_power, welch_df
from . import sequence as seq

#: the arm every method is compared with
REFERENCE = "softmax"
#: a run is converged in distribution where its mean exact match over the training sizes is at
#: least this (the report lists the others; they are scored as measured, never dropped)
CONVERGED = 0.9


def read_rows(path: str | Path) -> tuple[seq.SequenceConfig, list[dict[str, Any]]]:
    """The configuration and rows of a leaderboard run folder, or of its record (``.tar.gz``:
    its one run folder, or the one named as the record), each job's rows read and checked as a resumed run reads them; jobs without rows (an
    unfinished run) are left out."""
    path = Path(path)
    if path.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with tarfile.open(path, mode="r:gz") as tar:
                    tar.extractall(tmp, filter="data")
            except (OSError, EOFError, tarfile.TarError) as err:
                raise ValueError(
                    f"{path} is not a readable record ({type(err).__name__})."
                ) from None
            folders = [p.parent for p in Path(tmp).glob("*/config.json")]
            named = [f for f in folders if f.name == path.name.removesuffix(".tar.gz")]
            if len(named) != 1 and len(folders) != 1:
                raise ValueError(
                    f"{path} holds no run folder named as the record (with a config.json)."
                )
            return read_rows(named[0] if named else folders[0])
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is neither a leaderboard run folder nor its record (.tar.gz).")
    stored = read_config(path, "leaderboard")
    fields = seq.SequenceConfig.__dataclass_fields__
    cfg = seq.SequenceConfig(**{k: v for k, v in stored.items() if k in fields})
    rows: list[dict[str, Any]] = []
    for job in seq.jobs(path, cfg):
        done = seq.rows_file(job, cfg)
        if done.is_file():
            rows += seq.read_rows(done, job, cfg)
    return cfg, rows


def in_distribution(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], float]:
    """{(task, method, seed): mean exact match over the sizes inside the task's training
    range} (`sequence.measures`' ``id``)."""
    return {
        (t, m, s): v["id"] for (t, m), per in seq.measures(rows).items() for s, v in per.items()
    }


def unconverged(
    rows: list[dict[str, Any]], threshold: float = CONVERGED
) -> list[tuple[str, str, int, float]]:
    """The runs below ``threshold`` in distribution (`in_distribution`), as (task, method,
    seed, exact match), in task, method and seed order."""
    return sorted((*k, v) for k, v in in_distribution(rows).items() if not v >= threshold)


def scores(rows: list[dict[str, Any]], method: str, tasks: list[str]) -> dict[int, float]:
    """{seed: the method's overall score}: its mean score over ``tasks`` on each seed that has
    every one of them."""
    per = seq.measures(rows)
    seeds = [set(per.get((t, method), {})) for t in tasks]
    common = set.intersection(*seeds) if seeds else set()
    return {s: float(np.mean([per[(t, method)][s]["auc"] for t in tasks])) for s in sorted(common)}


def same_models(method: str, reference: str = REFERENCE) -> bool:
    """Whether ``method`` is evaluated on the reference's trained models (the same recipe):
    then it is compared with the reference seed by seed."""
    known = seq.methods()
    return (
        method in known and reference in known and known[method].recipe == known[reference].recipe
    )


@dataclass(frozen=True)
class Arm:
    """What the pilot says of one method: ``sd``, the seed-to-seed standard deviation of its
    overall score (of its difference from the reference, seed by seed, where it is evaluated
    on the reference's models: ``paired``), over ``seeds`` seeds; ``cpu``, the CPU seconds of
    one seed's training over the tasks (0 where it trains nothing of its own); ``converged``,
    the share of its runs converged in distribution."""

    method: str
    sd: float
    seeds: int
    cpu: float
    converged: float
    paired: bool


def arms(
    rows: list[dict[str, Any]], tasks: list[str], methods: list[str], reference: str = REFERENCE
) -> dict[str, Arm]:
    """Every method's `Arm` (the reference's included) from a pilot's rows, on ``tasks``. A
    method the pilot did not run has NaN sd and the median CPU time of the others."""
    ids = in_distribution(rows)
    base = scores(rows, reference, tasks)
    seconds: dict[tuple[str, str], dict[int, float]] = {}  # each seed's, once (a row a size)
    for r in rows:
        if r.get("train_seconds") is not None:
            seconds.setdefault((r["task"], r["method"]), {})[r["seed"]] = float(r["train_seconds"])
    out: dict[str, Arm] = {}
    for m in methods:
        paired = m != reference and same_models(m, reference)
        mine = scores(rows, m, tasks)
        if paired:
            common = sorted(set(mine) & set(base))
            values = [mine[s] - base[s] for s in common]
        else:
            values = list(mine.values())
        sd = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
        per_task = [
            float(np.mean(list(seconds[(t, m)].values()))) for t in tasks if (t, m) in seconds
        ]
        cpu = (
            0.0
            if paired
            else (float(np.sum(per_task)) if len(per_task) == len(tasks) else math.nan)
        )
        runs = [v for (t, mm, _), v in ids.items() if mm == m and t in tasks]
        converged = float(np.mean([v >= CONVERGED for v in runs])) if runs else math.nan
        out[m] = Arm(m, sd, len(values), cpu, converged, paired)
    known = [a.cpu for a in out.values() if np.isfinite(a.cpu) and a.cpu > 0]
    fill = float(np.median(known)) if known else math.nan
    return {m: a if np.isfinite(a.cpu) else _replace_cpu(a, fill) for m, a in out.items()}


def _replace_cpu(arm: Arm, cpu: float) -> Arm:
    return Arm(arm.method, arm.sd, arm.seeds, cpu, arm.converged, arm.paired)


def pooled_sd(found: dict[str, Arm], reference: str = REFERENCE) -> float:
    """The spread a plan assumes for a trained method: the root mean square of the pilot's
    unpaired methods' sds (a method's own, from a few seeds, is too noisy to plan on)."""
    sds = [a.sd for m, a in found.items() if not a.paired and np.isfinite(a.sd) and m != reference]
    return float(np.sqrt(np.mean(np.square(sds)))) if sds else math.nan


@functools.lru_cache(maxsize=1 << 16)  # `allocate` asks the same few many times over
def detectable(
    sd: float, n: int, sd_ref: float, n_ref: int, alpha: float, power: float, paired: bool
) -> float:
    """The smallest true difference a two-sided test at ``alpha`` detects with ``power``: Welch's
    over ``n`` and ``n_ref`` independent seeds of spreads ``sd`` and ``sd_ref``, or, ``paired``,
    the paired t-test over ``n_ref`` seeds whose differences have spread ``sd``."""
    if paired:
        return at_power(sd / math.sqrt(n_ref), n_ref - 1, alpha, power) if n_ref > 1 else math.nan
    if n < 2 or n_ref < 2:
        return math.nan
    se = math.sqrt(sd**2 / n + sd_ref**2 / n_ref)
    return at_power(se, welch_df(sd_ref, n_ref, sd, n), alpha, power)


@dataclass(frozen=True)
class Allocation:
    """Seeds per arm (``seeds`` for every method, ``reference_seeds`` for the reference), the
    median over the methods of the difference each comparison detects (``median``, and each
    method's in ``detect``) and the CPU seconds of the training (``cpu``)."""

    seeds: int
    reference_seeds: int
    median: float
    detect: dict[str, float]
    cpu: float


def evaluate_allocation(
    found: dict[str, Arm],
    seeds: int,
    reference_seeds: int,
    alpha: float = 0.05,
    power: float = 0.8,
    reference: str = REFERENCE,
) -> Allocation:
    """What ``seeds`` per method and ``reference_seeds`` for the reference detect (`detectable`
    at Holm's strictest threshold α/m, m the methods compared with the reference; a trained
    method at the pooled spread, one on the reference's models at its own paired spread) and
    what they cost."""
    others = [m for m in found if m != reference]
    level = alpha / max(1, len(others))
    sd_ref = max(found[reference].sd, pooled_sd(found, reference))
    pooled = pooled_sd(found, reference)
    detect = {}
    for m in others:
        a = found[m]
        sd = a.sd if a.paired and np.isfinite(a.sd) else pooled  # none in the pilot: pooled
        detect[m] = detectable(sd, seeds, sd_ref, reference_seeds, level, power, a.paired)
    cpu = _cost(found, seeds, reference_seeds, reference)
    values = [v for v in detect.values() if np.isfinite(v)]
    median = float(np.median(values)) if values else math.nan
    return Allocation(seeds, reference_seeds, median, detect, cpu)


def _cost(found: dict[str, Arm], seeds: int, reference_seeds: int, reference: str) -> float:
    """The CPU seconds of training ``seeds`` per method and ``reference_seeds`` for the
    reference."""
    others = sum(a.cpu for m, a in found.items() if m != reference)
    return seeds * others + reference_seeds * found[reference].cpu


def allocate(
    found: dict[str, Arm],
    target: float,
    alpha: float = 0.05,
    power: float = 0.8,
    most: int = 60,
    reference: str = REFERENCE,
) -> Allocation | None:
    """The cheapest seeds per arm (up to ``most`` each, the reference at least as many as the
    others) whose median detectable difference is at most ``target``; None where none is."""
    best = None
    for n in range(2, most + 1):
        if best is not None and _cost(found, n, n, reference) >= best.cpu:
            break  # every allocation from here on costs at least as much
        for n_ref in range(n, most + 1):
            if best is not None and _cost(found, n, n_ref, reference) >= best.cpu:
                break
            a = evaluate_allocation(found, n, n_ref, alpha, power, reference)
            if a.median <= target and (best is None or a.cpu < best.cpu):
                best = a
                break  # more reference seeds cost more and are not needed at this n
    return best


def plan_text(
    source: str,
    found: dict[str, Arm],
    tasks: list[str],
    target: float,
    chosen: Allocation | None,
    alpha: float = 0.05,
    power: float = 0.8,
    reference: str = REFERENCE,
) -> str:
    """``--plan``'s report, in markdown: the pilot's spreads, costs and convergence per method,
    then the detectable difference and cost of a few allocations and the chosen one."""
    m = len(found) - 1
    lines = [
        f"Pilot: {source}; tasks {', '.join(tasks)}; {m} methods against {reference}, Holm's "
        f"strictest threshold α/m = {alpha:g}/{m}, {power:.0%} power.",
        "",
        "| method | seeds in the pilot | sd of the overall score | compared | CPU s a seed | "
        "converged in distribution |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, a in found.items():
        how = "reference" if name == reference else ("paired (its models)" if a.paired else "Welch")
        lines.append(
            f"| {name} | {a.seeds} | {a.sd:.4f} | {how} | {a.cpu:,.0f} | "
            + ("–" if not np.isfinite(a.converged) else f"{a.converged:.0%}")
            + " |"
        )
    pooled = pooled_sd(found, reference)
    lines += [
        "",
        f"A trained method is planned at the pooled sd {pooled:.4f} (root mean square over the "
        f"pilot's methods); {reference} at {max(found[reference].sd, pooled):.4f} (its own, or "
        "the pooled where that is larger). CPU time is the pilot's training time per seed.",
        "",
        "| seeds a method | seeds of the reference | median detectable | CPU-hours |",
        "|---:|---:|---:|---:|",
    ]
    for n, n_ref in ((3, 3), (5, 5), (5, 15), (8, 8), (8, 24), (10, 10)):
        a = evaluate_allocation(found, n, n_ref, alpha, power, reference)
        lines.append(f"| {n} | {n_ref} | {a.median:.3f} | {a.cpu / 3600:.1f} |")
    lines.append("")
    if chosen is None:
        lines.append(f"No allocation up to 60 seeds an arm detects {target:g}.")
    else:
        lines.append(
            f"**Cheapest allocation that detects {target:g} (median over the comparisons):** "
            f"{chosen.seeds} seeds a method and {chosen.reference_seeds} for {reference}: "
            f"median detectable {chosen.median:.3f}, {chosen.cpu / 3600:.1f} CPU-hours of "
            f"training ({chosen.cpu / 7200:.1f} h on 2 cores)."
        )
    return "\n".join(lines) + "\n"
