"""Run folders: one directory per run with config.json, metrics, plots and report.md."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

#: the file of a run folder that lists the code versions that ran it, in order
CODE_VERSIONS = "code_versions.json"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so a crash never leaves a
    half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except IsADirectoryError as e:  # name the file the user sees, not our temporary one
            raise IsADirectoryError(
                e.errno, "a directory is where this file belongs", str(path)
            ) from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def damaged(path: Path, why: str, fix: str | None = None) -> ValueError:
    """The one-sentence error for a run-folder file that cannot be used: which file, why, and
    what to do (``fix``; by default delete the file so the command computes it again)."""
    fix = fix or "delete it (or restore it from a backup) and run the command again"
    return ValueError(f"{path} is damaged ({why.strip().rstrip('.')}); {fix}.")


def read_json(path: Path, shape: Any = None, fix: str | None = None) -> Any:
    """Parse the JSON file ``path`` and check it has ``shape`` (see `conforms`; None: any
    JSON); a damaged file or a value of another shape raises ``ValueError`` naming it, with
    ``fix`` (what to do; by default delete it and run the command again)."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise damaged(
            path, f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}", fix
        ) from None
    except UnicodeDecodeError:
        raise damaged(path, "not valid JSON: not UTF-8 text", fix) from None
    problem = mismatch(value, shape)
    if problem is not None:
        raise damaged(path, problem, fix)
    return value


def conforms(value: Any, shape: Any) -> bool:
    """Whether the JSON ``value`` has ``shape``: None (anything); a type (``float`` also takes
    an int; ``bool`` is not an int); a tuple of shapes (any of them); ``[shape]`` (a list of
    them); ``{key: shape}`` (a dict with at least these keys); ``{str: shape}`` (a dict whose
    every value has ``shape``)."""
    return mismatch(value, shape) is None


def mismatch(value: Any, shape: Any, where: str = "") -> str | None:
    """Why ``value`` does not have ``shape`` (`conforms`), or None when it does."""
    if shape is None:
        return None
    if isinstance(shape, tuple):
        problems = [mismatch(value, s, where) for s in shape]
        return None if None in problems else problems[0]
    if isinstance(shape, list):
        if not isinstance(value, list):
            return _expected(value, "a list", where)
        for i, item in enumerate(value):
            problem = mismatch(item, shape[0], f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return _expected(value, "an object", where)
        if list(shape) == [str]:
            items = [(k, shape[str]) for k in value]
        else:
            missing = [k for k in shape if k not in value]
            if missing:
                return f"{where or 'it'} has no {missing[0]!r}"
            items = list(shape.items())
        for k, s in items:
            problem = mismatch(value[k], s, f"{where}[{k!r}]")
            if problem is not None:
                return problem
        return None
    if shape is type(None):
        return None if value is None else _expected(value, "null", where)
    ok = isinstance(value, shape) and not (isinstance(value, bool) and shape is not bool)
    if shape is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return None if ok else _expected(value, _JSON_NAMES.get(shape, f"a {shape.__name__}"), where)


#: Python types by their names in JSON, for the messages
_JSON_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
}


def _expected(value: Any, what: str, where: str) -> str:
    found = _JSON_NAMES.get(type(value), "null" if value is None else f"a {type(value).__name__}")
    return f"{where or 'it'} is {found}, not {what}"


def check_memory(nbytes: float, what: str, smaller: str = "sizes") -> None:
    """Refuse, before any work, a computation that needs more memory than this machine has
    available now (Linux's MemAvailable; elsewhere its physical memory): one sentence naming
    ``what`` and telling the user to choose smaller ``smaller``."""
    free = available_memory()
    if free is not None and nbytes > free:
        raise ValueError(
            f"{what} needs about {nbytes / 2**30:,.1f} GiB, more than the "
            f"{free / 2**30:,.1f} GiB of memory available on this machine; choose smaller "
            f"{smaller}."
        )


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation: ``MemAvailable`` of /proc/meminfo, else the
    physical memory (None where neither is known)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no check
        return None


def write_json(path: Path, obj: Any, *, if_changed: bool = False) -> None:
    """Write ``obj`` as indented JSON, atomically; ``if_changed``: not when the file already
    holds exactly that (its modification time then says when it last changed)."""
    text, path = json.dumps(obj, indent=2, sort_keys=False) + "\n", Path(path)
    if if_changed and path.is_file():
        with contextlib.suppress(OSError, UnicodeDecodeError):  # unreadable: written anew
            if path.read_text(encoding="utf-8") == text:
                return
    write_atomic(path, text)


def open_run(out: str | Path, config: dict[str, Any]) -> Path:
    """Create (or reuse) the run folder ``out`` and record ``config`` in its config.json."""
    run = make_dir(out)
    write_json(run / "config.json", config)
    return run


def make_dir(out: str | Path) -> Path:
    """Create the folder ``out`` (and its parents); an unusable path raises ``ValueError`` in one
    sentence (a file in the way, no permission, a symlink loop)."""
    run = Path(out)
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / ".sharpattn-write-test"
        probe.touch()
        probe.unlink()
    except OSError as e:
        reason = (e.strerror or type(e).__name__).lower()
        if os.path.islink(run) and not os.path.exists(run):
            reason = "it is a symbolic link that loops or leads nowhere; remove it or choose another --out"
        raise ValueError(f"cannot use {str(run)!r} as a run folder: {reason}.") from None
    return run
