"""Max retrieval's evaluation (Sec. 4.1, Table 1): every seed at once on one shared test set
per size, in cached blocks, as many as the test-set standard error asks for."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ... import normalizers as nz
from ...lab.runner import Progress, emit, generator, threads
from ...lab.runs import check_memory, write_atomic
from ...models import SetAttention
from ...tasks import sample_max_retrieval
from .config import STREAM_TEST, TEST_SEED, Config, group_dir, groups, run_jobs
from .training import load_ensemble

Tensor = torch.Tensor


#: items per evaluation chunk of one member (activations of about 2 MB: the cache, not memory)
_CHUNK_ITEMS = 1 << 12
#: test sets per block: each block has its own stream, so any prefix of blocks is a test set
BLOCK = 1000
#: the largest test-set standard error of a cell's mean over seeds (points) the evaluation accepts
TARGET_SE = 0.5


#: peak bytes per item of a batch of sets through a member of the model (float32 features and
#: its width-sized activations): 1,085 measured (peak RSS growth of `correct_sets` on one
#: set of 2^20 items), about twice that here
_ITEM_BYTES = 4 * 128 * 4


def batch_bytes(size: int, sets: int, per_item: int = 0) -> int:
    """Peak memory of ``sets`` sets of ``size`` items through one member of the model, plus
    ``per_item`` bytes of the caller's own per item: the estimate every size is checked with
    (`check_sizes`)."""
    return sets * size * (_ITEM_BYTES + per_item)


def check_sizes(sizes, per_item: int = 0, chunk=None) -> None:
    """Refuse, before any work, sizes whose evaluation batches (``chunk(size)`` sets of a size;
    default: `test_batches`'s) would not fit in the memory available."""
    chunk = chunk or (lambda n: max(1, _CHUNK_ITEMS // n))
    size = max(sizes, key=lambda n: batch_bytes(n, chunk(n), per_item))
    need = batch_bytes(size, chunk(size), per_item)
    check_memory(need, f"a set of {size:,} items", "--sizes")


def test_batches(size: int, block: int, sets: int = BLOCK, chunk_sets: int | None = None):
    """Block ``block`` of the fixed test set of ``size`` (its first ``sets`` sets), in
    memory-bounded chunks. Blocks are independent streams shared by every seed and method."""
    g = generator(TEST_SEED, size, STREAM_TEST, block)
    chunk = chunk_sets or max(1, _CHUNK_ITEMS // size)
    for start in range(0, sets, chunk):
        yield sample_max_retrieval(min(chunk, sets - start), size, g)


def eval_methods(config: Config) -> dict[str, tuple[str, dict[str, Any]]]:
    """Table 1's rows: the trained normalizer, and adaptive temperature at inference."""
    return {
        "baseline": (config.method, {}),
        "adaptive": ("adaptive", {"coefficients": config.coefficients}),
    }


def _method_key(method: str, params: dict[str, Any]) -> str:
    """A short stable name for (method, params); coefficients by value, not by file name."""
    params = dict(params)
    if "coefficients" in params:
        params["coefficients"] = list(nz.resolve_coefficients(params["coefficients"]))
    text = json.dumps([method, params], sort_keys=True)
    return f"{method}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


@torch.inference_mode()
def correct_sets(
    model: SetAttention,
    size: int,
    block: int,
    methods: dict[str, tuple[str, dict[str, Any]]],
    sets: int = BLOCK,
) -> dict[str, Tensor]:
    """Per method, which sets of test block ``block`` of ``size`` each member gets right:
    ``(S, sets)`` bool. Members run one after another on chunks of about ``_CHUNK_ITEMS`` items
    (cache-sized activations); each chunk is embedded once for every method.

    The answers go into tensors allocated up front: thousands of small result tensors kept
    between the megabyte-sized activations of large sets fragment glibc's heap so that it grew
    by about 1 MB per set at 16,384 items (13 GB by the end of a block)."""
    models = [model.member(s) for s in range(model.members)] if model.members else [model]
    out = {label: torch.zeros(len(models), sets, dtype=torch.bool) for label in methods}
    start = 0
    for b in test_batches(size, block, sets):
        stop = start + b.target.shape[0]
        for i, m in enumerate(models):
            qkv = m.qkv(*m.embed(b.x, b.q))
            for label, (method, params) in methods.items():
                att = m.attention(*qkv, method, check_finite=False, **params)
                out[label][i, start:stop] = m.readout(att).argmax(-1) == b.target
        start = stop
    return out


def _block_path(run: Path, seeds: list[int], size: int, block: int, key: str, sets: int) -> Path:
    return (
        group_dir(run, seeds).parent.parent
        / "eval"
        / group_dir(run, seeds).name
        / f"n{size}"
        / f"{key}.b{block}x{sets}.safetensors"
    )


def eval_block(
    run: Path, config: Config, seeds: list[int], size: int, block: int, methods
) -> dict[str, Tensor]:
    """Correctness ``(len(seeds), sets)`` per method of one group on one test block of
    ``sets = min(BLOCK, config.test_sets)`` sets, cached
    in RUN/eval/<group>/n<size>/ (one safetensors file per method and block)."""
    keys = {lb: _method_key(m, p) for lb, (m, p) in methods.items()}
    sets = min(BLOCK, config.test_sets)
    paths = {lb: _block_path(run, seeds, size, block, k, sets) for lb, k in keys.items()}
    todo = {lb: methods[lb] for lb, p in paths.items() if not p.is_file()}
    if todo:
        with threads(config.threads):
            model = load_ensemble(run, config, seeds)
            for lb, c in correct_sets(model, size, block, todo, sets).items():
                write_atomic(paths[lb], safetensors.torch.save({"correct": c.to(torch.uint8)}))
    out = {}
    for lb, p in paths.items():
        try:
            out[lb] = safetensors.torch.load_file(str(p))["correct"].bool()
        except Exception as e:  # a damaged cache file: name it
            raise ValueError(
                f"{p} is damaged ({e}); delete it and run the command again."
            ) from None
    return out


def _eval_job(job: dict[str, Any], progress: Progress | None = None) -> dict[str, Tensor]:
    config = Config(**job["config"])
    methods = {lb: (m, p) for lb, (m, p) in job["methods"].items()}
    return eval_block(Path(job["run"]), config, job["seeds"], job["size"], job["block"], methods)


def evaluate(
    run: Path,
    config: Config,
    methods: dict[str, tuple[str, dict[str, Any]]],
    progress: Progress | None = None,
    ray: str | None = None,
) -> dict[str, Any]:
    """Accuracy (%) per method, seed and size on a test set shared by every seed and method.

    The number of test sets per size is chosen so that the test-set standard error of each
    cell's mean over seeds stays <= ``TARGET_SE`` points: a first block of ``BLOCK`` sets, then
    as many blocks as the measured error asks for (SE² falls as 1/sets), up to
    ``config.test_sets``. SE = std over test sets of the seeds' mean correctness / √sets.
    """
    seeds, max_blocks = list(range(config.seeds)), max(1, config.test_sets // BLOCK)
    out: dict[str, Any] = {
        "accuracy": {lb: {s: {} for s in seeds} for lb in methods},
        "se_of_mean": {lb: {} for lb in methods},
        "test_sets": {},
    }
    wire = {lb: [m, p] for lb, (m, p) in methods.items()}
    for i, size in enumerate(config.sizes):
        emit(progress, "evaluation", f"n={size:,}", i, len(config.sizes))
        blocks: list[dict[str, Tensor]] = []  # per block: method -> (seeds, sets)
        want = 1
        while len(blocks) < want:
            jobs = [
                {
                    "run": str(run),
                    "config": asdict(config),
                    "seeds": g,
                    "size": size,
                    "block": k,
                    "methods": wire,
                }
                for k in range(len(blocks), want)
                for g in groups(config)
            ]
            results = run_jobs(_eval_job, jobs, config, ray, progress)
            per = len(groups(config))
            for j in range(0, len(results), per):
                blocks.append(
                    {lb: torch.cat([r[lb] for r in results[j : j + per]]) for lb in methods}
                )
            se = max(_se(torch.cat([b[lb] for b in blocks], dim=1)) for lb in methods)
            if se > TARGET_SE and len(blocks) == 1:
                want = min(max_blocks, math.ceil((se / TARGET_SE) ** 2))
        for lb in methods:
            c = torch.cat([b[lb] for b in blocks], dim=1).double()  # (seeds, sets)
            for s in seeds:
                out["accuracy"][lb][s][size] = float(100 * c[s].mean())
            out["se_of_mean"][lb][size] = _se(c)
        out["test_sets"][size] = len(blocks) * min(BLOCK, config.test_sets)
    emit(progress, "evaluation", "done", len(config.sizes), len(config.sizes))
    return out


def _se(correct: Tensor) -> float:
    """Test-set standard error (points) of the seeds' mean accuracy: correctness (seeds, sets)."""
    per_set = correct.double().mean(0)
    return (
        float(100 * per_set.std() / math.sqrt(per_set.numel())) if per_set.numel() > 1 else math.nan
    )
