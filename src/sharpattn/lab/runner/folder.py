"""One folder per run: its configuration written once and checked on resume, the code versions that
ran it, its metrics files and the profiles that set it."""

from __future__ import annotations

import copy
import functools
import json
import math
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..runs import CODE_VERSIONS, damaged, make_dir, mismatch, read_json, write_atomic, write_json

# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------


def profile_settings(
    profiles: Mapping[str, Mapping[str, Any]],
    name: str,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings of profile ``name`` (a key of ``profiles``), then ``overrides`` (None
    values ignored: an option not given keeps the profile's value). A new dict whose profile
    values are copies, so what the caller does with it never changes ``profiles``; an unknown
    name is refused in one sentence that lists the profiles."""
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; profiles: {', '.join(profiles)}.")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    return {**copy.deepcopy(dict(profiles[name])), **given}


# ---------------------------------------------------------------------------------------------
# Run folders
# ---------------------------------------------------------------------------------------------


@functools.cache
def code_version() -> dict[str, Any]:
    """The code this process runs: sharpattn's version, and where the package is a git checkout,
    its commit and whether tracked files differ from it (``modified``); ``commit`` is None where
    git or the checkout is not there (an installed package)."""
    from ... import __version__

    here = Path(__file__).resolve()
    out: dict[str, Any] = {"version": __version__, "commit": None, "modified": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(here.parent), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # only a checkout that tracks this very file is the code running (not a venv inside one)
    if git("ls-files", "--error-unmatch", here.name) is not None:
        out["commit"] = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
        out["modified"] = None if status is None else bool(status)
    return out


def require_committed(allow: bool = False) -> None:
    """Refuse in one sentence, unless ``allow``, to run from a git checkout whose tracked files
    differ from its commit (`code_version`): its report could not name the code that wrote it.
    An installed package (no checkout) runs."""
    here = code_version()
    if here["modified"] and not allow:
        raise ValueError(
            f"the checkout at commit {here['commit'][:12]} has uncommitted changes, so the "
            "report could not name the code that wrote it: commit them, or pass --allow-dirty "
            "and the report says so."
        )


def record_code_version(folder: str | Path) -> list[dict[str, Any]]:
    """Append this process's `code_version` to ``folder/code_versions.json`` where it differs
    from the last one listed (a run resumed by other code lists both); returns the list."""
    path = Path(folder) / CODE_VERSIONS
    versions = read_json(path, list) if path.is_file() else []
    if not versions or {k: versions[-1].get(k) for k in code_version()} != code_version():
        versions.append({**code_version(), "first_run": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
        write_json(path, versions)
    return versions


class RunFolder:
    """A run folder: ``config.json`` (experiment name + configuration), ``code_versions.json``
    (the code that ran it: `record_code_version`), ``metrics.jsonl``, checkpoints, tables,
    figures and ``report.md``.

    ``identity`` names the configuration keys that define what the run computes (its training
    settings); a folder whose config.json differs in any of them, or holds another experiment,
    is refused. Other keys (evaluation sizes, threads, ...) may change between invocations;
    config.json then records the latest. ``identity=None`` means every key; a dotted key
    ("lm.steps") names a key of a nested configuration. ``missing`` gives, for a key added to
    the configuration after a folder was written, the value such a folder was run with.
    """

    def __init__(
        self,
        out: str | Path,
        experiment: str,
        config: dict[str, Any],
        identity: Iterable[str] | None = None,
        missing: dict[str, Any] | None = None,
    ):
        self.path = Path(out)
        self.experiment = experiment
        record = {"experiment": experiment, **jsonable(config)}
        path = self.path / "config.json"
        if path.is_file():
            old = read_json(path, dict, fix="restore it from a backup, or use another --out")
            old = {**(missing or {}), **old}
            if old.get("experiment") != experiment:
                found = old.get("experiment")
                raise ValueError(
                    f"{self.path} holds a {found or 'different'} run, not a {experiment} run; "
                    "use another --out."
                )
            keys = record.keys() | old.keys() if identity is None else set(identity)
            diff = sorted(k for k in keys if k != "experiment" and _get(old, k) != _get(record, k))
            if diff:
                what = ", ".join(
                    f"{k} ({_get(old, k)!r} there, {_get(record, k)!r} now)" for k in diff
                )
                raise ValueError(
                    f"{self.path} holds a {experiment} run with a different {what}; use another "
                    "--out or the same settings to resume it."
                )
            if old != record:
                write_json(path, record)
        else:
            make_dir(self.path)
            write_json(path, record)
        record_code_version(self.path)
        self.config = record

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def sub(self, *parts: str) -> Path:
        """A sub-folder, created."""
        p = self.path.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p


METRICS = "metrics.json"


def write_metrics(folder: RunFolder | str | Path, metrics: Any, name: str = METRICS) -> Path:
    """Write a run's measurements ``metrics`` into ``folder`` (a `RunFolder` or its path)
    as indented JSON, atomically (a crash leaves the previous file or none, never half of one);
    ``name``: the file, ``metrics.json`` unless the run keeps its results under another name.
    Returns the file's path."""
    path = (folder.path if isinstance(folder, RunFolder) else Path(folder)) / name
    write_json(path, metrics)
    return path


def _get(config: dict[str, Any], key: str) -> Any:
    """``config[key]``, following dots into nested dicts (None where a level is missing)."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def read_config(out: str | Path, experiment: str) -> dict[str, Any]:
    """The configuration stored in ``out``/config.json by a run of ``experiment``."""
    path = Path(out) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out} is not a {experiment} run folder (no config.json).")
    data = read_json(path, dict, fix="restore it from a backup, or name another run folder")
    if data.pop("experiment", None) != experiment:
        raise ValueError(f"{out} is not a {experiment} run folder (its config.json is another's).")
    return data


def jsonable(obj: Any) -> Any:
    """Tuples become lists (what JSON gives back), so a stored config compares equal."""
    return json.loads(json.dumps(obj))


class MetricsLog:
    """``metrics.jsonl``: one JSON record per line, appended; records carry a ``step``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self) -> list[dict[str, Any]]:
        """The records; a damaged file raises ``ValueError`` naming it (a line cut by a crash
        mid-append can only be the last one, and is dropped)."""
        if not self.path.is_file():
            return []
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise self.damaged("not UTF-8 text") from None
        out = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines):
                    break
                raise self.damaged(f"line {i} is not valid JSON") from None
            problem = mismatch(record, {"step": int})
            if problem is not None:
                raise self.damaged(f"line {i}: {problem.replace('it ', 'the record ', 1)}")
            out.append(record)
        return out

    def damaged(self, why: str) -> ValueError:
        """The error for a damaged log: its run's measurements are lost, so the run is redone."""
        return damaged(
            self.path, why, f"delete the folder {self.path.parent} to train this run again"
        )

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_finite(record)) + "\n")

    def keep_until(self, step: int) -> list[dict[str, Any]]:
        """Drop records after ``step`` (written after the checkpoint a resume starts from)."""
        records = self.read()
        kept = [r for r in records if r.get("step", 0) <= step]
        if len(kept) != len(records) or self.path.is_file():
            write_atomic(self.path, "".join(json.dumps(_finite(r)) + "\n" for r in kept))
        return kept


def _finite(obj: Any) -> Any:
    """NaN/inf as null: metrics.jsonl stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
