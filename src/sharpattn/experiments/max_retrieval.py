"""Reproduce the max-retrieval experiment of Veličković et al., *Softmax is not Enough*.

App. A: train the set model (:class:`~sharpattn.models.SetAttention`) on sets of 5–16 items;
Sec. 4.1 / Table 1: evaluate it on 16 … 16,384 items with its own normalizer ("baseline") and
with adaptive temperature switched on at inference only (same parameters), over seeds, with a
paired t-test per size; Figures 2/7 (attention over the 16 largest items), 5 (entropy of
softmax_θ), 9 (logit spread vs the Proposition 3.1 bound); App. F: refit the temperature
polynomial (:func:`fit_temperature`, Figure 6).

Run folder layout::

    RUN/config.json                 the configuration
    RUN/seeds/seed{s}/checkpoint.safetensors   while training (every ``checkpoint_every`` steps)
    RUN/seeds/seed{s}/model.safetensors        final parameters + training metrics (JSON)
    RUN/seeds/seed{s}/eval.json                accuracies, cached per (method, size, test sets)
    RUN/table1.{md,csv,json}, RUN/*.png, RUN/report.md
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .. import normalizers as nz
from ..models import SetAttention
from ..tasks import sample_max_retrieval
from .checkpoint import load_checkpoint, save_checkpoint, save_weights
from .runs import open_run, read_json, write_atomic, write_json
from .stats import paired_comparison

Tensor = torch.Tensor

PAPER_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Table 1 of the ICML version (accuracy %, averaged over ten seeds).
PAPER_TABLE1 = {
    "baseline": dict(
        zip(
            PAPER_SIZES,
            (98.6, 97.1, 94.3, 89.7, 81.3, 70.1, 53.8, 35.7, 22.6, 15.7, 12.4),
            strict=True,
        )
    ),
    "adaptive": dict(
        zip(
            PAPER_SIZES,
            (98.6, 97.1, 94.5, 89.9, 82.1, 72.5, 57.7, 39.4, 24.9, 17.5, 14.0),
            strict=True,
        )
    ),
    "p_value": dict(
        zip(
            PAPER_SIZES,
            (0.4, 0.4, 0.002, 2e-5, 2e-4, 3e-5, 1e-4, 6e-4, 0.02, 1e-3, 4e-3),
            strict=True,
        )
    ),
}


@dataclass
class Config:
    """Everything that defines a run; stored in config.json. Defaults are the paper's (App. A.4)."""

    seeds: int = 10
    steps: int = 100_000
    sizes: tuple[int, ...] = PAPER_SIZES
    method: str = "softmax"  # the normalizer trained with ("baseline")
    coefficients: str | list[float] = "icml"  # adaptive temperature at inference
    batch: int = 128
    lr: float = 1e-3
    l2: float = 1e-3  # λ in CE + λ·Σ w² over all parameters
    min_items: int = 5
    max_items: int = 16
    test_sets: int = 10_000  # per size: standard error <= 0.5 points
    checkpoint_every: int = 1_000
    log_every: int = 100
    workers: int = 1
    # torch threads per worker for training. The model is tiny: one thread beats two (thread
    # start-up per op costs more than it saves, and oversubscribed cores stall OpenMP).
    # Evaluation (large sets) uses cores // workers.
    train_threads: int = 1

    def __post_init__(self):
        self.sizes = tuple(int(n) for n in self.sizes)
        for name in (
            "seeds",
            "steps",
            "batch",
            "test_sets",
            "checkpoint_every",
            "log_every",
            "workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"sizes must be positive integers, got {list(self.sizes)}.")
        if not 1 <= self.min_items <= self.max_items:
            raise ValueError(
                f"need 1 <= min_items <= max_items, got {self.min_items}, {self.max_items}."
            )
        if not (self.lr > 0 and self.l2 >= 0):
            raise ValueError(f"need lr > 0 and l2 >= 0, got lr={self.lr}, l2={self.l2}.")
        nz.get(self.method)  # unknown names raise ValueError listing the known
        nz.resolve_coefficients(self.coefficients)


PROFILES: dict[str, dict[str, Any]] = {
    "quick": dict(seeds=1, steps=5_000, sizes=PAPER_SIZES[:9], test_sets=1_000, log_every=100),
    "paper": dict(seeds=10, steps=100_000, sizes=PAPER_SIZES, test_sets=10_000, log_every=1_000),
}


def _seed_int(*key: int) -> int:
    """A 63-bit seed for one purpose of one run seed (independent streams via SeedSequence)."""
    return int(
        np.random.SeedSequence(list(key)).generate_state(2, np.uint32).view(np.uint64)[0] >> 1
    )


_INIT, _DATA, _PROBE, _TEST, _FIGURE, _FIT = range(6)
_TEST_SEED = 20250101  # test sets are shared by all seeds and methods (paired comparison)


def build_model(config: Config, seed: int) -> SetAttention:
    """A freshly initialised model for ``seed`` (initialisation does not touch the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed_int(seed, _INIT))
        return SetAttention(method=config.method)


def seed_dir(run: Path, seed: int) -> Path:
    return Path(run) / "seeds" / f"seed{seed}"


# ---------------------------------------------------------------------------------------------
# Training (App. A.4)
# ---------------------------------------------------------------------------------------------


def make_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.Adam:
    """Adam on CE + λ·Σ w². ∇(λ·Σ w²) = 2λ·w, which is exactly what Adam's (coupled, not AdamW)
    ``weight_decay=2λ`` adds to every gradient, so the penalty costs no extra graph."""
    return torch.optim.Adam(
        model.parameters(), lr=config.lr, weight_decay=2 * config.l2, fused=True
    )


def l2_penalty(model: torch.nn.Module, l2: float) -> float:
    """λ·Σ w² over all parameters (the term Adam's weight decay differentiates)."""
    with torch.no_grad():
        return l2 * float(sum(p.pow(2).sum() for p in model.parameters()))


@torch.no_grad()
def logit_spread(model: SetAttention, x: Tensor, q: Tensor) -> tuple[float, float]:
    """Mean over sets of δ = max_i e_i − min_i e_i and of Proposition 3.1's bound on it.

    With biases, e_i = (Q'y')ᵀ(K'h_i')/√d with Q' = [W_q | b_q], y' = [y; 1] (same for K, h_i),
    so δ <= 2·σmax(Q')·σmax(K')·‖y'‖·max_i ‖h_i'‖/√d (Prop. 3.1 applied to the augmented
    vectors).
    """
    h, y = model.embed(x, q)
    e = model.scores(x, q)  # (B, n)
    delta = e.amax(-1) - e.amin(-1)

    def augmented(lin):
        return torch.cat((lin.weight, lin.bias[:, None]), dim=1)

    def with_one(t):
        return torch.cat((t, torch.ones_like(t[..., :1])), dim=-1)

    sq = torch.linalg.matrix_norm(augmented(model.query), ord=2)
    sk = torch.linalg.matrix_norm(augmented(model.key), ord=2)
    bound = (
        2
        * sq
        * sk
        * with_one(y).norm(dim=-1)
        * with_one(h).norm(dim=-1).amax(-1)
        / math.sqrt(model.width)
    )
    return float(delta.mean()), float(bound.mean())


ProgressFn = Callable[[dict[str, Any]], None]


def train_seed(
    run: Path,
    config: Config,
    seed: int,
    progress: ProgressFn | None = None,
    stop_at: int | None = None,
) -> Path:
    """Train seed ``seed`` of ``run`` to ``config.steps``, resuming from its checkpoint.

    Returns the final weights' path; a seed whose weights exist is not retrained. ``stop_at``
    (for tests and benchmarks) returns after that many steps in total, as a crash would, leaving
    the last checkpoint behind.
    """
    sdir = seed_dir(run, seed)
    final = sdir / "model.safetensors"
    if final.is_file():
        return final
    ckpt = sdir / "checkpoint.safetensors"
    model = build_model(config, seed)
    optimizer = make_optimizer(model, config)
    data = torch.Generator().manual_seed(_seed_int(seed, _DATA))
    probe = sample_max_retrieval(
        config.batch, config.max_items, torch.Generator().manual_seed(_seed_int(seed, _PROBE))
    )
    state: dict[str, Any] = {"step": 0, "metrics": []}
    if ckpt.is_file():
        state = load_checkpoint(ckpt, model=model, optimizer=optimizer, generators={"data": data})
    step = state["step"]
    metrics = state["metrics"]
    if step == 0:
        metrics.append(_log_record(model, config, probe, 0, None))  # before training: no loss yet
    model.train()
    report = max(1, min(25, config.log_every))
    start = time.perf_counter()
    while step < config.steps:
        if stop_at is not None and step >= stop_at:
            return final
        n = int(torch.randint(config.min_items, config.max_items + 1, (1,), generator=data))
        b = sample_max_retrieval(config.batch, n, data)
        ce = F.cross_entropy(model(b.x, b.q, check_finite=False), b.target)
        optimizer.zero_grad(set_to_none=True)
        ce.backward()
        optimizer.step()
        step += 1
        if step % config.log_every == 0 or step == config.steps:
            metrics.append(_log_record(model, config, probe, step, float(ce.detach())))
            if not math.isfinite(metrics[-1]["ce"]):
                raise FloatingPointError(
                    f"seed {seed}: the loss became {metrics[-1]['ce']} at step {step}."
                )
        if step % config.checkpoint_every == 0 and step < config.steps:
            save_checkpoint(
                ckpt,
                model=model,
                optimizer=optimizer,
                generators={"data": data},
                state={"step": step, "metrics": metrics},
            )
        if progress is not None and (step % report == 0 or step == config.steps):
            progress(
                {
                    "seed": seed,
                    "phase": "train",
                    "step": step,
                    "total": config.steps,
                    "loss": float(ce.detach()) + l2_penalty(model, config.l2)
                    if step % (report * 8) == 0
                    else None,
                    "elapsed": time.perf_counter() - start,
                }
            )
    done = step - state["step"]
    speed = done / (time.perf_counter() - start) if done else None
    save_weights(
        final, model, {"step": step, "metrics": metrics, "seed": seed, "steps_per_s": speed}
    )
    ckpt.unlink(missing_ok=True)
    return final


def _log_record(model, config, probe, step, ce: float | None) -> dict[str, float | None]:
    """One metrics record: CE of the step's batch, λ·Σw², their sum, and on a fixed probe batch
    of in-distribution sets the logit spread δ and its Prop. 3.1 bound (Figure 9)."""
    penalty = l2_penalty(model, config.l2)
    delta, bound = logit_spread(model, probe.x, probe.q)
    return {
        "step": step,
        "ce": ce,
        "l2": penalty,
        "loss": None if ce is None else ce + penalty,
        "delta": delta,
        "bound": bound,
    }


def load_model(run: Path, config: Config, seed: int) -> tuple[SetAttention, dict[str, Any]]:
    """The trained model of ``seed`` and its training record (step, metrics)."""
    path = seed_dir(run, seed) / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"seed {seed} of {run} is not trained yet ({path} is missing).")
    model = build_model(config, seed)
    record = load_checkpoint(path, model=model)
    return model.eval(), record


# ---------------------------------------------------------------------------------------------
# Evaluation (Sec. 4.1, Table 1)
# ---------------------------------------------------------------------------------------------

#: Items per evaluation chunk (bounds memory: about 2·d floats per item in flight).
_CHUNK_ITEMS = 1 << 18


def test_batches(size: int, test_sets: int):
    """The fixed test set of ``size``: ``test_sets`` sets, yielded in memory-bounded chunks."""
    g = torch.Generator().manual_seed(_seed_int(_TEST_SEED, size, _TEST))
    chunk = max(1, _CHUNK_ITEMS // size)
    for start in range(0, test_sets, chunk):
        yield sample_max_retrieval(min(chunk, test_sets - start), size, g)


def eval_methods(config: Config) -> dict[str, tuple[str, dict[str, Any]]]:
    """Table 1's rows: the trained normalizer, and adaptive temperature at inference."""
    return {
        "baseline": (config.method, {}),
        "adaptive": ("adaptive", {"coefficients": config.coefficients}),
    }


def _eval_key(method: str, params: dict[str, Any], size: int, test_sets: int) -> str:
    params = dict(params)
    if "coefficients" in params:
        params["coefficients"] = list(nz.resolve_coefficients(params["coefficients"]))
    return json.dumps([method, params, size, test_sets], sort_keys=True)


@torch.inference_mode()
def accuracy(
    model: SetAttention, size: int, test_sets: int, methods: dict[str, tuple[str, dict[str, Any]]]
) -> dict[str, float]:
    """Accuracy (%) of each method on the fixed test set of ``size``; embeddings are shared."""
    correct = dict.fromkeys(methods, 0)
    for b in test_batches(size, test_sets):
        qkv = model._qkv(*model.embed(b.x, b.q))
        for label, (method, params) in methods.items():
            att = model.attention(*qkv, method, check_finite=False, **params)
            pred = model.readout(att).argmax(-1)
            correct[label] += int((pred == b.target).sum())
    return {label: 100.0 * c / test_sets for label, c in correct.items()}


def evaluate_seed(
    run: Path,
    config: Config,
    seed: int,
    methods: dict[str, tuple[str, dict[str, Any]]],
    progress: ProgressFn | None = None,
) -> dict[str, dict[int, float]]:
    """Accuracy per method and size for ``seed``, cached in its eval.json."""
    path = seed_dir(run, seed) / "eval.json"
    cache: dict[str, float] = read_json(path) if path.is_file() else {}
    model = None
    out: dict[str, dict[int, float]] = {label: {} for label in methods}
    for i, size in enumerate(config.sizes):
        keys = {lb: _eval_key(m, p, size, config.test_sets) for lb, (m, p) in methods.items()}
        missing = {lb: methods[lb] for lb, k in keys.items() if k not in cache}
        if missing:
            if progress is not None:
                progress(
                    {"seed": seed, "phase": f"eval n={size}", "step": i, "total": len(config.sizes)}
                )
            if model is None:
                model, _ = load_model(run, config, seed)
            for lb, acc in accuracy(model, size, config.test_sets, missing).items():
                cache[keys[lb]] = acc
            write_json(path, cache)
        for lb, k in keys.items():
            out[lb][size] = cache[k]
    if progress is not None:
        progress(
            {"seed": seed, "phase": "done", "step": len(config.sizes), "total": len(config.sizes)}
        )
    return out


# ---------------------------------------------------------------------------------------------
# Seeds in worker processes, with one progress bar per seed
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch intra-op threads, then restore the previous count."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _eval_threads(config: Config) -> int:
    return max(1, (os.cpu_count() or 1) // config.workers)


def _seed_job(run: str, config_dict: dict, seed: int, queue=None) -> dict[str, dict[int, float]]:
    config = Config(**config_dict)
    progress = queue.put if queue is not None else None
    return _train_and_evaluate(Path(run), config, seed, progress)


def _train_and_evaluate(run: Path, config: Config, seed: int, progress) -> dict:
    with torch_threads(config.train_threads):
        train_seed(run, config, seed, progress)
    with torch_threads(_eval_threads(config)):
        return evaluate_seed(run, config, seed, eval_methods(config), progress)


def run_seeds(run: Path, config: Config, progress: ProgressFn | None = None) -> dict[int, dict]:
    """Train (or resume) and evaluate every seed; ``config.workers`` processes in parallel."""
    results: dict[int, dict] = {}
    if config.workers == 1:
        for seed in range(config.seeds):
            results[seed] = _train_and_evaluate(run, config, seed, progress)
        return results
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    ctx = mp.get_context("spawn")
    manager = SyncManager(ctx=ctx)
    manager.start(die_with_parent)
    pool = ProcessPoolExecutor(config.workers, mp_context=ctx, initializer=die_with_parent)
    try:
        queue = manager.Queue()
        futures = {
            pool.submit(_seed_job, str(run), asdict(config), seed, queue): seed
            for seed in range(config.seeds)
        }
        pending = set(futures)
        while pending:
            while not queue.empty():
                msg = queue.get()
                if progress is not None:
                    progress(msg)
            for f in [f for f in pending if f.done()]:
                results[futures[f]] = f.result()  # re-raises a worker's error here
                pending.discard(f)
            time.sleep(0.05)
        while not queue.empty() and progress is not None:
            progress(queue.get())
    except BaseException:  # Ctrl-C, SIGTERM (raised as KeyboardInterrupt by the CLI), an error
        # stop the workers now rather than wait for their seeds to finish; checkpoints resume
        workers = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers:
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True)
        manager.shutdown()
    return dict(sorted(results.items()))


def die_with_parent() -> None:
    """In a worker process: exit when the parent dies, even by ``kill -9`` (Linux asks the kernel
    to send SIGTERM then; elsewhere a thread polls the parent's pid)."""
    import signal
    import sys

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------------------------------------
# Table 1
# ---------------------------------------------------------------------------------------------


def table1(
    results: dict[int, dict[str, dict[int, float]]], sizes, treatment: str = "adaptive"
) -> list[dict[str, Any]]:
    """One row per size: ours (mean, std over seeds, paired t-test p) beside the paper's."""
    seeds = sorted(results)
    a = np.array([[results[s]["baseline"][n] for n in sizes] for s in seeds])
    b = np.array([[results[s][treatment][n] for n in sizes] for s in seeds])
    cmp = paired_comparison(a, b)
    rows = []
    for j, n in enumerate(sizes):
        rows.append(
            {
                "size": n,
                "seeds": len(seeds),
                "baseline_mean": cmp.mean_a[j],
                "baseline_std": cmp.std_a[j],
                f"{treatment}_mean": cmp.mean_b[j],
                f"{treatment}_std": cmp.std_b[j],
                "p_value": cmp.p_value[j],
                "paper_baseline": PAPER_TABLE1["baseline"].get(n),
                "paper_adaptive": PAPER_TABLE1["adaptive"].get(n),
                "paper_p_value": PAPER_TABLE1["p_value"].get(n),
            }
        )
    return rows


def _fmt(mean, std) -> str:
    if std is None or not np.isfinite(std):
        return f"{mean:.1f}"
    return f"{mean:.1f} ± {std:.1f}"


def _fmt_p(p) -> str:
    return "n/a" if p is None or not np.isfinite(p) else f"{p:.2g}"


def _paper(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def write_table1(
    run: Path,
    rows: list[dict[str, Any]],
    name: str = "table1",
    treatment: str = "adaptive",
    label: str = "adaptive θ",
) -> str:
    """Write ``name``.md/.csv/.json into ``run``; return the markdown.

    With a ``treatment`` other than "adaptive" (the refit), rows that also carry "adaptive_mean"
    get a column for adaptive θ with the paper's coefficients too.
    """
    extra = treatment != "adaptive" and "adaptive_mean" in rows[0]
    header = "| size | baseline (ours) | baseline (paper) | "
    header += "adaptive θ (ours) | " if extra else ""
    header += f"{label} (ours) | adaptive θ (paper) | p (ours) | p (paper) |"
    lines = [header, "|" + "---:|" * (8 if extra else 7)]
    for r in rows:
        cells = [
            f"{r['size']:,}",
            _fmt(r["baseline_mean"], r["baseline_std"]),
            _paper(r["paper_baseline"]),
            *([_fmt(r["adaptive_mean"], r["adaptive_std"])] if extra else []),
            _fmt(r[f"{treatment}_mean"], r[f"{treatment}_std"]),
            _paper(r["paper_adaptive"]),
            _fmt_p(r["p_value"]),
            _fmt_p(r["paper_p_value"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    write_atomic(run / f"{name}.md", md)
    cols = list(rows[0])
    csv = (
        ",".join(cols)
        + "\n"
        + "".join(
            ",".join(
                "" if r[c] is None else f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c])
                for c in cols
            )
            + "\n"
            for r in rows
        )
    )
    write_atomic(run / f"{name}.csv", csv)
    write_json(run / f"{name}.json", [{k: _json_num(v) for k, v in r.items()} for r in rows])
    return md


def _json_num(v):
    if isinstance(v, (float, np.floating)):
        return None if not np.isfinite(v) else float(v)
    return v


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, dpi: int = 120) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)


def plot_accuracy(
    path: Path, rows: list[dict[str, Any]], extra: dict[str, list[float]] | None = None
) -> None:
    """Accuracy vs size (log x), ours with ±std bands and the paper's curves dashed."""
    plt = _plt()
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, color in (("baseline", "baseline", "C0"), ("adaptive", "adaptive θ", "C1")):
        mean = np.array([r[f"{key}_mean"] for r in rows])
        std = np.nan_to_num(np.array([r[f"{key}_std"] for r in rows]))
        ax.plot(sizes, mean, "o-", color=color, label=f"{label} (ours)")
        ax.fill_between(sizes, mean - std, mean + std, color=color, alpha=0.2)
        paper = [
            (n, r[f"paper_{key}"])
            for n, r in zip(sizes, rows, strict=True)
            if r[f"paper_{key}"] is not None
        ]
        if paper:
            ax.plot(
                *zip(*paper, strict=True), "s--", color=color, alpha=0.6, label=f"{label} (paper)"
            )
    for label, values in (extra or {}).items():
        ax.plot(sizes, values, "^-", color="C2", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of items n (trained on 5–16)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Max retrieval: accuracy vs set size")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path, dpi=120)


@torch.inference_mode()
def plot_attention(
    path: Path, model: SetAttention, config: Config, max_size: int, sets: int = 32
) -> None:
    """Figures 2 and 7: weights of ``sets`` sets over their 16 largest-priority items (max
    rightmost), one panel per size 16, 32, …, ``max_size``; softmax above, adaptive below."""
    plt = _plt()
    sizes = [16 * 2**i for i in range(int(math.log2(max(max_size, 16) / 16)) + 1)]
    g = torch.Generator().manual_seed(_seed_int(_TEST_SEED, _FIGURE))
    methods = eval_methods(config)
    fig, axes = plt.subplots(2, len(sizes), figsize=(1.6 * len(sizes) + 1, 6), squeeze=False)
    for j, n in enumerate(sizes):
        b = sample_max_retrieval(sets, n, g)
        top = b.priority.argsort(dim=-1)[:, -16:]  # (sets, 16), max rightmost
        for i, (label, (method, params)) in enumerate(methods.items()):
            _, w = model(b.x, b.q, method=method, return_weights=True, **params)
            ax = axes[i, j]
            ax.imshow(w.gather(-1, top).numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(f"n = {n:,}", fontsize=9)
            if j == 0:
                ax.set_ylabel(
                    "softmax"
                    if label == "baseline" and method == "softmax"
                    else (method if label == "baseline" else "adaptive θ")
                )
    fig.suptitle("Attention over the 16 largest items of 32 sets (max rightmost)")
    _save(fig, path, dpi=110)


def plot_entropy_landscape(path: Path, items: int = 10) -> None:
    """Figure 5: entropy of softmax_θ(a) for a_i = λ^i, i = 1…10, over (λ, θ)."""
    plt = _plt()
    lam = torch.linspace(0.01, 2.0, 200, dtype=torch.float64)
    theta = torch.linspace(0.01, 2.0, 200, dtype=torch.float64)
    a = lam[:, None] ** torch.arange(1, items + 1, dtype=torch.float64)  # (λ, items)
    h = torch.stack(
        [nz.entropy(nz.softmax(a, temperature=float(t))) for t in theta], dim=0
    )  # (θ, λ)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    im = ax.pcolormesh(lam.numpy(), theta.numpy(), h.numpy(), shading="auto", cmap="magma")
    fig.colorbar(im, ax=ax, label="entropy H (nats)")
    ax.set_xlabel("λ  (logits a_i = λ^i, i = 1…10)")
    ax.set_ylabel("temperature θ")
    ax.set_title(
        f"Entropy of softmax_θ over {items} logits (max log {items} = {math.log(items):.2f})"
    )
    _save(fig, path, dpi=120)


def plot_logit_spread(path: Path, records: list[list[dict[str, float]]]) -> None:
    """Figure 9: logit spread δ and its Proposition 3.1 bound over training (mean ± std over seeds)."""
    plt = _plt()
    steps = np.array([m["step"] for m in records[0]])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, color in (
        ("delta", "logit spread δ", "C0"),
        ("bound", "bound 2·σmax(Q)·σmax(K)·‖y‖·max‖x_i‖ (Prop. 3.1)", "C3"),
    ):
        v = np.array([[m[key] for m in rec] for rec in records])
        mean, std = v.mean(0), (v.std(0) if len(records) > 1 else np.zeros(v.shape[1]))
        ax.plot(steps, mean, color=color, label=label)
        ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("logits (sets of 16)")
    ax.set_title(f"Logit spread vs its upper bound ({len(records)} seed{'s' * (len(records) > 1)})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, dpi=120)


# ---------------------------------------------------------------------------------------------
# The whole reproduction
# ---------------------------------------------------------------------------------------------


def read_config(run: Path) -> Config:
    path = Path(run) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run} is not a max-retrieval run folder (no config.json).")
    data = read_json(path)
    if not isinstance(data, dict) or data.pop("experiment", None) != "max-retrieval":
        raise ValueError(f"{run} is not a max-retrieval run folder (its config.json is another's).")
    return Config(**data)


# Settings that change what a seed's training produces: a run folder keeps them fixed.
_TRAINING = ("steps", "method", "batch", "lr", "l2", "min_items", "max_items", "log_every")


def reproduce(out: Path, config: Config, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Train and evaluate every seed (resuming what exists), then write tables, figures, report."""
    out = Path(out)
    if (out / "config.json").is_file():
        old = read_config(out)
        diff = [k for k in _TRAINING if getattr(old, k) != getattr(config, k)]
        if diff:
            raise ValueError(
                f"{out} holds a run with a different {', '.join(diff)}; use another --out or the same "
                "settings to resume it."
            )
    run = open_run(out, {"experiment": "max-retrieval", **asdict(config)})
    t0 = time.perf_counter()
    results = run_seeds(run, config, progress)
    elapsed = time.perf_counter() - t0
    rows = table1(results, config.sizes)
    write_table1(run, rows)
    plot_accuracy(run / "accuracy.png", rows)
    model, record = load_model(run, config, 0)
    plot_attention(run / "attention.png", model, config, max(config.sizes))
    plot_entropy_landscape(run / "entropy_landscape.png")
    records = [load_model(run, config, s)[1]["metrics"] for s in range(config.seeds)]
    plot_logit_spread(run / "logit_spread.png", records)
    summary = {"elapsed_s": elapsed, "steps_per_s": _steps_per_s(run, config)}
    write_json(run / "summary.json", summary)
    write_report(run)
    return {"run": run, "rows": rows, **summary}


def _steps_per_s(run: Path, config: Config) -> float | None:
    """Mean training speed (steps/s per seed) recorded in the seeds' final weights."""
    speeds = []
    for s in range(config.seeds):
        rec = load_checkpoint(seed_dir(run, s) / "model.safetensors", model=build_model(config, s))
        if rec.get("steps_per_s"):
            speeds.append(rec["steps_per_s"])
    return float(np.mean(speeds)) if speeds else None


# ---------------------------------------------------------------------------------------------
# App. F: the temperature fit
# ---------------------------------------------------------------------------------------------

THETA_GRID = tuple(round(0.1 * i, 1) for i in range(1, 101))  # (0, 10] step 0.1


def optimal_temperature(e: Tensor, target: Tensor, grid=THETA_GRID) -> Tensor:
    """θ_opt per row: the grid θ maximising softmax(e/θ)[target] (first on ties), ``(B,)``.

    ``e`` ``(B, n)`` logits, ``target`` ``(B,)`` the item to retrieve.
    """
    thetas = torch.tensor(grid, dtype=torch.float64)
    e = e.to(torch.float64)
    z = e[None] / thetas[:, None, None]  # (G, B, n)
    log_p = z.gather(-1, target[None, :, None].expand(len(grid), -1, 1))[..., 0] - z.logsumexp(-1)
    return thetas[log_p.argmax(0)]  # (B,)


def collect_fit_data(
    model: SetAttention, sizes, sets: int, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(H, 1/θ_opt) over sets whose max-priority item does not get the largest logit (App. F)."""
    hs, betas = [], []
    with torch.inference_mode():
        for n in sizes:
            chunk = max(1, (1 << 20) // (n * len(THETA_GRID)))
            for start in range(0, sets, chunk):
                b = sample_max_retrieval(min(chunk, sets - start), n, generator)
                e = model.scores(b.x, b.q).to(torch.float64)  # (B, n)
                keep = e.argmax(-1) != b.argmax
                if not bool(keep.any()):
                    continue
                e, target = e[keep], b.argmax[keep]
                # H of softmax(e) as the adaptive normalizer computes it (reference code's eps).
                hs.append(nz.entropy(torch.softmax(e, -1), eps=1e-9).numpy())
                betas.append(1.0 / optimal_temperature(e, target).numpy())
    if not hs:
        raise ValueError("no set had its max item below another item's logit; nothing to fit.")
    return np.concatenate(hs), np.concatenate(betas)


def fit_temperature(
    run: Path,
    sizes=None,
    sets: int = 256,
    degree: int = 4,
    seeds: list[int] | None = None,
    evaluate: bool = True,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Refit β(H) = 1/θ_opt (App. F) on the trained models of ``run``; write fit_temperature.json
    (which ``adaptive(coefficients=path)`` reads), Figure 6 and Table 1 with the refit."""
    run = Path(run)
    config = read_config(run)
    sizes = tuple(sizes or config.sizes)
    seeds = list(range(config.seeds)) if seeds is None else list(seeds)
    hs, betas = [], []
    for s in seeds:
        model, _ = load_model(run, config, s)
        g = torch.Generator().manual_seed(_seed_int(s, _FIT))
        h, beta = collect_fit_data(model, sizes, sets, g)
        hs.append(h)
        betas.append(beta)
        if progress is not None:
            progress({"seed": s, "phase": "fit", "step": 1, "total": 1})
    h, beta = np.concatenate(hs), np.concatenate(betas)
    if len(h) <= degree:
        raise ValueError(
            f"only {len(h)} usable sets for a degree-{degree} fit; use more --sets or larger --sizes."
        )
    coefficients = np.polyfit(h, beta, degree)  # highest power first, as numpy.polyval
    path = run / "fit_temperature.json"
    write_json(
        path,
        {
            "coefficients": [float(c) for c in coefficients],
            "degree": degree,
            "samples": int(len(h)),
            "sizes": list(sizes),
            "sets_per_size": sets,
            "seeds": seeds,
            "theta_grid": [THETA_GRID[0], THETA_GRID[-1], 0.1],
            "paper_coefficients": list(nz.COEFFICIENTS["icml"]),
        },
    )
    nz.resolve_coefficients(str(path))  # what adaptive(coefficients=path) will read
    plot_fit(run / "fit_temperature.png", h, beta, coefficients)
    out: dict[str, Any] = {"path": path, "coefficients": coefficients, "samples": len(h)}
    if evaluate:
        methods = {**eval_methods(config), "refit": ("adaptive", {"coefficients": str(path)})}
        results = {s: evaluate_seed(run, config, s, methods, progress) for s in range(config.seeds)}
        rows = table1(results, config.sizes, treatment="refit")
        for r, base in zip(rows, table1(results, config.sizes), strict=True):
            r["adaptive_mean"], r["adaptive_std"] = base["adaptive_mean"], base["adaptive_std"]
        write_table1(run, rows, name="table1_refit", treatment="refit", label="adaptive θ, refit")
        out["rows"] = rows
    write_report(run)
    return out


def plot_fit(path: Path, h: np.ndarray, beta: np.ndarray, coefficients) -> None:
    """Figure 6: (H, 1/θ_opt) samples, our degree-4 fit and the paper's polynomial."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rng = np.random.default_rng(0)
    idx = rng.choice(len(h), size=min(len(h), 4000), replace=False)
    ax.scatter(h[idx], beta[idx], s=4, alpha=0.3, color="gray", label=f"samples ({len(h):,})")
    grid = np.linspace(0, max(float(h.max()), 1.0), 300)
    ax.plot(grid, np.polyval(coefficients, grid), color="C0", lw=2, label="our fit")
    ax.plot(
        grid,
        np.polyval(nz.COEFFICIENTS["icml"], grid),
        "--",
        color="C3",
        lw=2,
        label="paper (ICML Fig. 6)",
    )
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xlabel("entropy H of softmax(e)")
    ax.set_ylabel("1/θ_opt")
    ax.set_ylim(0, max(3.0, float(np.quantile(beta, 0.99))))
    ax.set_title("Adaptive temperature: polynomial fit of 1/θ_opt against H (App. F)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path, dpi=120)


# ---------------------------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------------------------


def write_report(run: Path) -> Path:
    """report.md from what the run folder holds (Table 1, refit table, figures, speed)."""
    run = Path(run)
    config = read_config(run)
    summary = read_json(run / "summary.json") if (run / "summary.json").is_file() else {}
    parts = [
        "# Max retrieval (Veličković et al., *Softmax is not Enough*, App. A, Table 1)\n",
        f"{config.seeds} seed(s) × {config.steps:,} Adam steps (lr {config.lr:g}, batch {config.batch}, "
        f"n ~ U{{{config.min_items}..{config.max_items}}}, CE + {config.l2:g}·Σw²); trained normalizer "
        f"`{config.method}`; adaptive θ with coefficients `{config.coefficients}` at inference only. "
        f"{config.test_sets:,} test sets per size; p: paired t-test over seeds (scipy `ttest_rel`).\n",
    ]
    if summary.get("steps_per_s"):
        parts.append(
            f"Training speed: {summary['steps_per_s']:.0f} steps/s per seed; wall time "
            f"{summary['elapsed_s']:.0f} s for training + evaluation.\n"
        )
    for name, title in (
        ("table1", "Table 1"),
        ("table1_refit", "Table 1 with the refitted temperature (App. F)"),
    ):
        if (run / f"{name}.md").is_file():
            parts.append(f"## {title}\n\n{(run / f'{name}.md').read_text()}")
    if (run / "fit_temperature.json").is_file():
        fit = read_json(run / "fit_temperature.json")
        coeffs = ", ".join(f"{c:.4g}" for c in fit["coefficients"])
        parts.append(
            f"Refitted β(H) = polyval([{coeffs}], H) from {fit['samples']:,} sets "
            f"(paper: {list(nz.COEFFICIENTS['icml'])}); file `fit_temperature.json`, usable as "
            "`adaptive(coefficients=path)`.\n"
        )
    for png, caption in (
        ("accuracy.png", "Accuracy vs set size, ours (±std) and the paper's."),
        (
            "attention.png",
            "Figures 2/7: attention over the 16 largest items of 32 sets; softmax above, adaptive θ below.",
        ),
        ("entropy_landscape.png", "Figure 5: entropy of softmax_θ over 10 logits a_i = λ^i."),
        (
            "logit_spread.png",
            "Figure 9: logit spread δ and the Proposition 3.1 bound during training.",
        ),
        ("fit_temperature.png", "Figure 6: the temperature fit, ours and the paper's."),
    ):
        if (run / png).is_file():
            parts.append(f"![{caption}]({png})\n\n*{caption}*\n")
    path = run / "report.md"
    write_atomic(path, "\n".join(parts))
    return path
