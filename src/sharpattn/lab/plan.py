"""A run planned before it starts and carried between machines.

* **The plan** (`fix_plan`): what a long run will train and how it will be analysed (tasks,
  methods, seeds per arm, comparisons, α, power, what counts as a failed run, and the commit of
  the code), written into the run folder as ``plan.json`` before the first job. A later
  invocation with another plan, or from another commit, is refused in one sentence: the
  analysis cannot change once results exist, and every job comes from one code version.
* **The record** (`pack`, `unpack`): a run that outlives its machine is resumed in sittings.
  After each sitting the run folder's small files (configuration, plan, each finished job's
  rows and evaluations; never weights, checkpoints or training logs) are packed into one
  ``.tar.gz``; the next sitting unpacks it into a fresh folder and resumes at the same commit.
  A finished job whose folder holds its rows and no training files counts as done
  (`sequence.run_job`), so only the jobs a sitting had not finished run again.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from .runner.folder import code_version
from .runs import read_json, write_atomic, write_json

#: the plan's file in a run folder
PLAN = "plan.json"
#: the record's own summary: the plan, the sittings so far and their times
SITTINGS = "sittings.json"
#: files a record never carries: a trainer's (weights, checkpoint, training log)
NOT_PACKED = ("model.safetensors", "checkpoint.safetensors", "metrics.jsonl")


def pinned_commit(allow_modified: bool = False) -> str:
    """The code version a plan pins (`code_version`): the git commit of a clean checkout, or
    "sharpattn VERSION" for an installed package. A checkout with uncommitted changes is
    refused in one sentence, unless ``allow_modified`` (tests), where it is "COMMIT with
    uncommitted changes", which no later invocation can be sure to match."""
    here = code_version()
    if here["commit"] is None:
        return f"sharpattn {here['version']}"
    if here["modified"]:
        if allow_modified:
            return f"{here['commit']} with uncommitted changes"
        raise ValueError(
            f"a planned run is pinned to one commit, and this checkout has uncommitted changes "
            f"at {here['commit'][:12]}: commit them, or run from a clean checkout of the commit "
            "the plan names."
        )
    return str(here["commit"])


def fix_plan(folder: str | Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Write ``plan`` (JSON-able, with its ``commit``) to ``folder/plan.json`` if the folder
    has none; where it has one, it must be the same plan at the same commit, else one sentence
    saying what differs. Returns the plan as stored."""
    path = Path(folder) / PLAN
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(plan, indent=2, sort_keys=True) + "\n")
        return plan
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path} is damaged ({type(err).__name__}); restore it from the run's record, or "
            "start the run in another --out."
        ) from None
    if not isinstance(stored, dict):
        raise ValueError(f"{path} is damaged (not a JSON object); restore it from the record.")
    check_plan(stored, plan, folder, "--out")
    return stored


def read_plan(folder: str | Path) -> dict[str, Any] | None:
    """The plan stored in ``folder`` (None where it has none)."""
    path = Path(folder) / PLAN
    return read_json(path, dict) if path.is_file() else None


def pack(folder: str | Path, record: str | Path, seconds: dict[str, float] | None = None) -> Path:
    """Pack run folder ``folder`` into the record ``record`` (a ``.tar.gz``, written
    atomically): every file but a trainer's (`NOT_PACKED`) and the report's figures, under the
    folder's name. ``seconds`` ({"wall", "cpu"}: this sitting's) is added to the folder's
    ``sittings.json`` first, so the record says how many sittings made it and what they cost."""
    folder, record = Path(folder), Path(record)
    if seconds is not None:
        path = folder / SITTINGS
        sittings = read_json(path, list) if path.is_file() else []
        sittings.append(
            {
                **{k: round(float(v), 1) for k, v in seconds.items()},
                "commit": code_version()["commit"],
                "ended": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            }
        )
        write_json(path, sittings)
    buffer = io.BytesIO()
    earlier = record.resolve()  # a record kept in its own folder: never packed into the next
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            packed = path.name not in NOT_PACKED and path.suffix != ".png"
            if path.is_file() and packed and path.resolve() != earlier:
                tar.add(path, arcname=str(Path(folder.name) / path.relative_to(folder)))
    record.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(record, buffer.getvalue())
    return record


def unpack(record: str | Path, folder: str | Path, plan: dict[str, Any]) -> int:
    """Unpack ``record`` (made by `pack`) into run folder ``folder`` to resume it: refused in
    one sentence where the record's plan is not ``plan`` (another plan or another commit:
    `fix_plan`'s sentences) or the record is damaged. Files already in ``folder`` are kept (a
    sitting's newer results win over the record's). Returns how many files were added."""
    record, folder = Path(record), Path(folder)
    try:
        with tarfile.open(record, mode="r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            top = {Path(m.name).parts[0] for m in members}
            if len(top) != 1:
                raise ValueError(f"{record} is not a run's record (no single run folder in it).")
            root = top.pop()
            planned = tar.extractfile(f"{root}/{PLAN}")
            if planned is None:
                raise KeyError(PLAN)
            check_plan(json.loads(planned.read().decode("utf-8")), plan, record, "--record")
            inside = [(m, Path(m.name).relative_to(root)) for m in members]
            for m, relative in inside:  # every name checked before any file is written
                if ".." in relative.parts or relative.is_absolute():
                    raise ValueError(f"{record} names a file outside its run folder: {m.name}.")
            added = 0
            for m, relative in inside:
                target = folder / relative
                if target.exists():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                data = tar.extractfile(m)
                write_atomic(target, data.read() if data is not None else b"")
                added += 1
    except KeyError:
        raise ValueError(f"{record} has no {PLAN}: it is not a planned run's record.") from None
    except (OSError, EOFError, tarfile.TarError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{record} is damaged ({type(err).__name__}): restore it from the repository's "
            "history, or start the run afresh in another --out."
        ) from None
    return added


def check_plan(
    stored: dict[str, Any], plan: dict[str, Any], where: str | Path, option: str
) -> None:
    """Refuse in one sentence a run folder's or record's (``where``) plan ``stored`` that is
    not ``plan``: made at another commit, or planned otherwise (``option``: where another plan
    goes instead)."""
    commit = str(stored.get("commit"))[:12]
    if stored.get("commit") != plan.get("commit"):
        raise ValueError(
            f"{where} was planned at commit {commit} and this code is at "
            f"{str(plan.get('commit'))[:12]}: every job of a planned run comes from one commit, "
            f"so resume it from a checkout of that commit (git worktree add DIR {commit})."
        )
    differ = sorted(k for k in stored.keys() | plan.keys() if stored.get(k) != plan.get(k))
    if differ:
        raise ValueError(
            f"{where} was planned otherwise ({', '.join(differ)} differ): a plan cannot change "
            f"once its run has started; use another {option} for another plan."
        )
