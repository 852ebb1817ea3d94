"""Training checkpoints as one safetensors file: tensors, plus a JSON state in its metadata.

Model parameters, Adam moments and RNG states are tensors (safetensors: no pickle, nothing
executed on load); the step count, optimizer hyperparameters and metrics so far are JSON in the
file's metadata. One file, written atomically, so a crash never leaves a model and a state that
disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from .runs import damaged as _damaged
from .runs import mismatch, write_atomic

_STATE_KEY = "sharpattn.state"


def save_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    generators: dict[str, torch.Generator] | None = None,
    state: dict[str, Any] | None = None,
) -> None:
    """Write model (+ optimizer, generator states, JSON ``state``) to ``path`` atomically (its
    tensors copied to the CPU from wherever they are)."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta: dict[str, Any] = {"state": state or {}}
    if optimizer is not None:
        sd = optimizer.state_dict()
        for idx, per_param in sd["state"].items():
            for name, value in per_param.items():
                tensors[f"optim.{idx}.{name}"] = torch.as_tensor(value).cpu().contiguous()
        meta["param_groups"] = sd["param_groups"]
    for name, g in (generators or {}).items():
        tensors[f"rng.{name}"] = g.get_state()
    blob = safetensors.torch.save(tensors, metadata={_STATE_KEY: json.dumps(meta)})
    write_atomic(path, blob)


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    generators: dict[str, torch.Generator] | None = None,
) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote into ``model``/``optimizer``/``generators``;
    return the JSON ``state``. A model whose parameters changed layout reads the files of the
    layout before through its ``upgrade_checkpoint(tensors) -> tensors`` (keys ``model.<name>``,
    ``optim.<index>.<state>``, ``rng.<name>``), called before anything is checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}.")
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(_STATE_KEY)
            if raw is None:
                raise damaged(path, f"not a sharpattn checkpoint: no {_STATE_KEY} metadata")
            meta = json.loads(raw)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (safetensors.SafetensorError, json.JSONDecodeError, OSError) as e:
        raise damaged(path, str(e) or type(e).__name__) from None
    upgrade = getattr(model, "upgrade_checkpoint", None)  # a model whose layout changed
    if upgrade is not None:
        tensors = upgrade(tensors)
    problem = mismatch(meta, {"state": dict}) or _model_mismatch(tensors, model)
    if optimizer is not None and problem is None:
        problem = mismatch(meta, {"param_groups": [dict]}) and "it holds no optimizer state"
    if problem is None:
        problem = next(
            (
                f"it has no generator state {n!r}"
                for n in generators or {}
                if f"rng.{n}" not in tensors
            ),
            None,
        )
    if problem is not None:
        raise damaged(path, f"{problem}: another run's file or a damaged one")
    model_sd = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    try:
        model.load_state_dict(model_sd)
        if optimizer is not None:
            per_param: dict[int, dict[str, torch.Tensor]] = {}
            for k, v in tensors.items():
                if k.startswith("optim."):
                    _, idx, name = k.split(".", 2)
                    per_param.setdefault(int(idx), {})[name] = v
            optimizer.load_state_dict({"state": per_param, "param_groups": meta["param_groups"]})
        for name, g in (generators or {}).items():
            g.set_state(tensors[f"rng.{name}"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise damaged(path, f"another run's file or a damaged one: {first}") from None
    return meta["state"]


def _model_mismatch(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> str | None:
    """How the file's model tensors differ from ``model``'s parameters and buffers, or None."""
    found = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    for name, want in model.state_dict().items():
        if name not in found:
            return f"it has no tensor {name!r}"
        if tuple(found[name].shape) != tuple(want.shape):
            return f"its {name!r} is {list(found[name].shape)}, this run's {list(want.shape)}"
    extra = sorted(found.keys() - model.state_dict().keys())
    return f"it has a tensor {extra[0]!r} this run's model does not" if extra else None


def damaged(path: Path, error: Exception | str) -> ValueError:
    """The one-sentence error for a checkpoint that cannot be used (a crash mid-write elsewhere, a
    full disk, another run's file): which file, and what to do."""
    return _damaged(
        path,
        error if isinstance(error, str) else str(error).strip() or type(error).__name__,
        "delete it to restart this run from the beginning (or restore it from a backup) and run "
        "the command again",
    )


def save_weights(
    path: Path, model: torch.nn.Module, metadata: dict[str, Any] | None = None
) -> None:
    """Final parameters only (safetensors), with optional JSON metadata; atomic."""
    save_checkpoint(path, model=model, state=metadata)
