"""The cached C++ tile library (attention/cpu/native.py) against a hostile cache: a damaged file is
never handed to ctypes (a truncated one killed the process with SIGBUS, altered code with
SIGSEGV), builds at once both end with a library, a killed build's folder goes, and a relative
``XDG_CACHE_HOME`` is ignored. Each case runs a fresh process on a cache of its own, made from a
copy of this process's build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sharpattn.attention.cpu import native

# a fresh process: sigmoid through attend with the loops (auto), then in plain PyTorch; prints
# the largest difference, the loop calls, sharpattn's warnings and native.status()
CHILD = """
import json, os, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch, sharpattn
    from sharpattn.attention.cpu import native
    calls = []
    real = native.elementwise_forward
    native.elementwise_forward = lambda *a: calls.append(1) or real(*a)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 301, 8, generator=g) for _ in range(3))
    out = sharpattn.attend(q, k, v, method="sigmoid", causal=True)
    os.environ["SHARPATTN_COMPILE"] = "0"
    want = sharpattn.attend(q, k, v, method="sigmoid", causal=True)
    os.environ["SHARPATTN_COMPILE"] = "auto"
    status = native.status()
ours = [str(w.message) for w in caught if "sharpattn" in str(w.message)]
print(json.dumps({"err": float((out - want).abs().max()), "loops": len(calls),
                  "warnings": ours, "status": status}))
"""


@pytest.fixture(scope="module")
def built() -> Path:
    """This machine's library (built once per cache, usually before this module runs)."""
    cxx = native.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on the PATH: the loops are not built here")
    return native.build(cxx)


def cache_with(home: Path, built: Path) -> Path:
    """A copy of ``built`` in the cache folder of ``XDG_CACHE_HOME=home``."""
    folder = home / "sharpattn"
    folder.mkdir(parents=True)
    return Path(shutil.copy2(built, folder / built.name))


def start(home: Path) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    env.pop("SHARPATTN_COMPILE", None)
    return subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err[-2000:]}"
    got = json.loads(out.strip().splitlines()[-1])
    assert got["err"] < 1e-5, got  # the right answer, with the loops or without
    got["built"] = [line for line in err.splitlines() if "building the C++ tile loops" in line]
    return got


def whole(folder: Path) -> list[Path]:
    """The library files in ``folder``, each checked whole."""
    libs = sorted(folder.glob("tiles-*.so"))
    assert libs and all(native._damage(p) is None for p in libs)
    return libs


@pytest.mark.parametrize("harm", ["truncated", "flipped"])
def test_a_damaged_library_is_rebuilt_not_loaded(tmp_path, built, harm):
    lib = cache_with(tmp_path, built)
    data = lib.read_bytes()
    mid = len(data) // 2
    if harm == "truncated":  # loaded, this was SIGBUS (exit 135)
        lib.write_bytes(data[:mid])
    else:  # flipped code bytes: SIGSEGV
        lib.write_bytes(
            data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 256]) + data[mid + 256 :]
        )
    got = result(start(tmp_path))
    assert got["loops"] and got["status"]["active"]
    (warning,) = got["warnings"]
    assert str(lib) in warning and "sha256" in warning and "rebuilt" in warning
    assert got["status"]["library"] in map(str, whole(lib.parent))


def test_a_folder_in_its_place_is_one_warning_never_a_crash(tmp_path, built):
    lib = cache_with(tmp_path, built)
    lib.unlink()
    lib.mkdir()
    (lib / "something").write_text("not removed: a folder with files is not ours to delete")
    got = result(start(tmp_path))
    (warning,) = got["warnings"]
    assert str(lib) in warning and "not a file" in warning
    assert (lib / "something").is_file()


def test_two_fresh_processes_build_at_once_and_killed_builds_are_cleaned(tmp_path):
    """Two processes on an empty cache build at once (pytest-xdist workers): both load a whole
    library, each saying once that it builds. The build removes the folder of a build killed with kill -9 (its process
    gone) and an older version's ``tmp*`` folder over an hour old, not a running build's."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler on the PATH")
    folder = tmp_path / "sharpattn"
    folder.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    killed = folder / f".build-{gone.pid}-abc_123"
    running = folder / f".build-{os.getpid()}-xyz_789"  # this process: alive
    legacy = folder / "tmpq1w2e3r4"
    for d in (killed, running, legacy):
        d.mkdir()
        (d / "tiles.o").write_bytes(b"half an object")
    hour_ago = time.time() - 2 * native.STALE_S
    os.utime(legacy, (hour_ago, hour_ago))
    procs = [start(tmp_path) for _ in range(2)]
    said = [native.BUILDING.format(folder=folder)]
    built = []
    for got in map(result, procs):
        assert got["loops"] and got["status"]["active"] and got["warnings"] == []
        assert got["status"]["library"] in map(str, whole(folder))
        # one line from a process that compiles; none from one that found the other's library
        assert got["built"] in ([], said), got["built"]
        built += got["built"]
    assert built
    assert not killed.exists() and not legacy.exists() and running.exists()
    assert sorted(folder.glob(".build-*")) == [running]


def test_a_cache_hit_builds_nothing_and_says_nothing(tmp_path, built):
    cache_with(tmp_path, built)
    got = result(start(tmp_path))
    assert got["loops"] and got["status"]["active"] and got["warnings"] == []
    assert got["built"] == []


def test_ctypes_never_sees_a_file_whose_sha256_differs(tmp_path, built, monkeypatch):
    lib = cache_with(tmp_path, built)
    loaded = []
    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: loaded.append(path))
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="sha256"):
        native.load(lib)
    unnamed = lib.with_name("tiles.so")  # no digest in the name
    unnamed.write_bytes(data)
    with pytest.raises(RuntimeError, match="sha256"):
        native.load(unnamed)
    with pytest.raises(RuntimeError, match="not a file"):
        native.load(tmp_path)
    assert loaded == []


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    (tmp_path / "home").mkdir()  # a home folder that exists (a missing one is not created)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for relative in ("cache", "./cache", "../cache", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", relative)
        assert native.cache_dir() == tmp_path / "home" / ".cache" / "sharpattn"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "sharpattn"


def test_status(monkeypatch, built):
    monkeypatch.setenv("SHARPATTN_COMPILE", "auto")
    state = native.status()
    assert state["active"] and state["compiler"] == native.compiler()
    assert native._damage(Path(state["library"])) is None
    assert Path(state["cache"]).is_absolute()
    monkeypatch.setenv("SHARPATTN_COMPILE", "0")
    assert not native.status()["active"]
