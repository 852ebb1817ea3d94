"""Fused per-tile loops in C++ for the tiled paths' element-wise work (``native/tiles.cpp``).

Eagerly, every element-wise op of a score tile is one pass over it (adaptive's statistics take
six, softpick's forward eight, each Newton step of the entmax threshold four), and on a CPU whose
GEMMs are fast these passes cost more than the tile's matrix products. The C++ loops do each
row's work in one or two sweeps while the row is in cache: adaptive temperature on whole rows
(statistics, β(H) and weights; backward with β's gradient) and its statistics pass over tiles,
the element-wise maps ``sigmoid`` and ``relu`` and the normalised ones ``power``, ``signed``,
``softpick`` and ``stablemax`` (forward and backward; exported once per map under the name of
its kernel record, `map_loop`), the
entmax family's slab preparation and threshold (forward), stick-breaking's log-space running sums
(forward and backward; on reversed tiles, and on whole rows in key order for decoding), and
top-k's selection of each row's largest keys. The maths is the PyTorch tile functions', which
stay the reference and the fallback;
``tests/paths/test_native.py`` holds the two to each other.

The library is plain C++ on raw pointers (no PyTorch headers), built on first use with the C++
compiler on the ``PATH`` (``CXX``, c++, g++ or clang++; about a second) into
``$XDG_CACHE_HOME/sharpattn`` (else ``~/.cache/sharpattn``; a relative ``XDG_CACHE_HOME`` is
ignored, as the XDG specification asks; a home folder that does not exist is not created: a
private folder under the temporary directory serves instead), with one line on stderr while it
compiles (`BUILDING`), named by a hash of its source, the compiler and the CPU
(``-march=native`` ties it to the machine) and by the sha256 of its own bytes:
``tiles-KEY-SHA256.so``. A build runs in a folder of its own (``.build-PID-*``, removed by the
next build once that process is gone or after an hour, so a build killed with ``kill -9`` leaves
nothing for long), and the file is published by one ``os.replace`` after an fsync, so a reader
never sees half of it and processes building at once each end with a whole library. Before
ctypes loads it, its sha256 is computed again and compared with its name: a damaged file
(truncated, altered, a folder in its place) would kill the process (SIGBUS, SIGSEGV) if loaded,
so it is removed and rebuilt, with one warning that names it and what was wrong.

Each loop is a PyTorch operator, ``torch.ops.sharpattn.NAME`` (``torch.library.custom_op``):
its real implementation calls the ctypes function, its fake one (``register_fake``) gives the
shapes, dtypes and strides of what it returns, and the tensors it writes in place are declared in
``mutates_args``. So a graph that ``torch.compile`` traces calls the loops as it would any
operator (``fullgraph=True`` included; ``tests/paths/test_compile.py``). The operators are
registered when the library loads (`library`, which every path reaches through `wanted` before
it calls a loop, in a traced graph too), not on import: ``custom_op`` costs ~1 ms an operator,
and nothing here imports ``torch._dynamo`` (over a second) on ``import sharpattn``. A call goes through the
dispatcher once per tile: on the 2-core AMD EPYC, one thread, 23 µs against 2.7 µs for the
ctypes call alone; at n = 4,096 (causal, 2 threads, a shared machine) that measured 0-5% of
the CPU time of sigmoid, softpick, sparsemax and adaptive and 6-8% of stick-breaking's
(136 tiles of 2^18 scores a forward). So eagerly the same function is called directly
(`_Loop`), and only a traced graph goes through the operator.

When it runs (`wanted`, `usable`): on float32 CPU tiles in which every key is visible or whose
only mask is causal (each row sees a prefix of the tile's keys), eagerly or in a traced graph,
unless ``SHARPATTN_COMPILE=0`` (`mode`: every path in plain PyTorch, nothing built; ``1`` and
``auto``, the default, use the loops). Where no compiler is found it is not used; a build or
load that fails warns once (on stderr where warnings are errors) and leaves the PyTorch path for
the process. `status` says which.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

Tensor = torch.Tensor

_ENV = "SHARPATTN_COMPILE"
_MODES = ("0", "1", "auto")


def mode() -> str:
    """``SHARPATTN_COMPILE``: "0" (every path in plain PyTorch, nothing built), "1" or "auto"
    (the loops, where a C++ compiler builds them; unset or empty: "auto"); another value is
    refused in one sentence."""
    value = os.environ.get(_ENV, "").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{_ENV} must be 0, 1 or auto, got {value!r}.")
    return value


def compiler() -> str | None:
    """The path of the C++ compiler on the PATH (``CXX``, else c++, g++, clang++), or None."""
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


SOURCE = Path(__file__).with_name("native") / "tiles.cpp"
#: compile flags. ``-ffast-math`` lets the row reductions vectorise (the inputs are finite); it
#: is given to the compile step only: linked with it, GCC adds crtfastmath.o, which switches the
#: whole process to flush subnormal numbers to zero when the library loads
FLAGS = (
    *("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"),
    # x86: 512-bit vectors where the CPU has them (GCC prefers 256 by default)
    *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()),
)
LINK = ("-shared", "-fopenmp")

_F, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_FL = ctypes.c_float
_SIGNATURES = {  # (..., rows, cols, ends, tile rows, ...): see native/tiles.cpp
    "entropy_forward": [_F, _I64, _I64, _F, _I64, _F, _F, _F, _I],
    "entropy_backward": [_F, _I64, _I64, _F, _I64, _F, _F, _F, _I],
    "adaptive_forward": [_F, _I64, _I64, _F, _I64, _F, _I, _FL, _FL, *[_F] * 6, _I],
    "tempered_backward": [_F, _F, _I64, _I64, _F, _I64, *[_F] * 8, _I],
    "sparse_prepare": [_F, _I64, _I64, _F, _I64, _F, _FL, _F, _F, _F, _I64, _I64, _I],
    "stick_forward": [_F, _I64, _I64, _F, _I64, _F, _F, _F, _I],
    "stick_backward": [_F, _F, _F, _I64, _I64, _F, _I64, _F, _F, _F, _I],
    "stick_forward_rows": [_F, _I64, _I64, _F, _I64, _F, _F, _I],
    "stick_backward_rows": [_F, _F, _F, _I64, _I64, _F, _I64, _I],
    "topk_select": [_F, _I64, _I64, _F, _I64, _I64, _F, _F, _F, _I],
    "decode_adaptive": [*[_F] * 7, _I, _FL, _FL, *[_F] * 5, _I],
    "abs_max": [_F, _I64, _F, _I],
    "decode_scores": [*[_F] * 6, _I],
    "decode_values": [*[_F] * 7, _I],
}
#: the loops exported once per map, ``{loop}_{name}`` with ``name`` the name of the map's kernel
#: record (`families.Kernel`; `map_loop`)
_MAP_SIGNATURES = {
    "elementwise_forward": [_FL, _F, _I64, _I64, _F, _I64, _F, _I],
    "elementwise_backward": [_FL, _F, _F, _I64, _I64, _F, _I64, _F, _I],
    "normalised_forward": [_FL, _FL, _F, _I64, _I64, _F, _I64, _F, _F, _F, _I],
    "normalised_backward": [_FL, _FL, _F, _F, _F, _I64, _I64, _F, _I64, _F, _F, _F, _I],
    # the entmax family's threshold, ``sparse_solve_{kind}`` (kind: sparse_tiled's Newton step)
    "sparse_solve": [_FL, _F, _I64, _I64, _F, _F, _F, _I, _F, _I],
    # a decoding step, ``decode_{name}`` (also ``decode_softmax``): see `decode`
    "decode": [_FL, _FL, *[_F] * 12, _I],
}


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sharpattn``, else ``~/.cache/sharpattn``: a relative ``XDG_CACHE_HOME``
    is ignored (the XDG specification), never a folder under the current directory. A home
    folder that does not exist (``HOME`` pointing nowhere, a service account) is not created:
    the cache is then this user's private folder under the temporary directory
    (`_private_temp`)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(base):
        return Path(base) / "sharpattn"
    try:
        home = Path.home()
    except RuntimeError:  # no HOME and no user database entry
        home = None
    if home is None or not home.is_dir():
        return _private_temp()
    return home / ".cache" / "sharpattn"


@functools.cache
def _private_temp() -> Path:
    """``TMPDIR/sharpattn-cache-UID``, made with mode 0700 and used only where it is this user's
    folder that no one else may write to (in a shared temporary directory another user could
    otherwise plant a library there); else a new folder of its own (`tempfile.mkdtemp`), the
    same for the rest of the process."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(tempfile.gettempdir()) / f"sharpattn-cache-{uid}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="sharpattn-cache-"))


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags where Linux tells them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [x for x in lines if x.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))


def _damage(path: Path) -> str | None:
    """What is wrong with the cached library ``path`` (``tiles-KEY-SHA256.so``), or None when its
    bytes have the sha256 its name gives."""
    if not path.is_file():
        return "not a file" if path.exists() else "missing"
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if hashlib.sha256(data).hexdigest() != path.stem.rsplit("-", 1)[-1]:
        return f"its {len(data)} bytes do not have the sha256 its name gives"
    return None


#: a build folder (``.build-PID-*``) whose process is gone, or this old, is left over
STALE_S = 3600


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _clean(folder: Path) -> None:
    """Remove build folders that no running build owns (a build killed with ``kill -9``); also
    the ``tmp*`` folders of older versions' builds."""
    for tmp in [*folder.glob(".build-*"), *folder.glob("tmp*")]:
        try:
            old = time.time() - tmp.stat().st_mtime > STALE_S
        except OSError:
            continue
        pid = tmp.name.split("-")[1] if tmp.name.startswith(".build-") else ""
        if tmp.is_dir() and (old or (pid.isdigit() and not _alive(int(pid)))):
            shutil.rmtree(tmp, ignore_errors=True)


def _discard(path: Path) -> None:
    try:
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink()
    except OSError:
        pass  # a folder with files in it: publishing over it fails and says so


def build(cxx: str, compile_flags: tuple[str, ...] = FLAGS) -> Path:
    """The library for this source, compiler and CPU: a whole file from the cache, else built
    into it (``compile_flags``: another target, e.g. a portable one in the tests). A damaged
    cached file is removed and rebuilt, with a warning."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    text = SOURCE.read_text()
    flags = " ".join(compile_flags + LINK)
    key = "\n".join([text, cxx, version.stdout, flags, _cpu(), platform.machine()])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = cache_dir()
    damaged = []
    for path in sorted(folder.glob(f"tiles-{key}-*.so")):
        why = _damage(path)
        if why is None:
            return path
        damaged.append(f"{path} ({why})")
        _discard(path)
    try:
        target = _compile(cxx, compile_flags, folder, key)
    except Exception as exc:
        if damaged:
            raise RuntimeError(f"{exc}; and the cached library was damaged: {damaged[0]}") from exc
        raise
    if damaged:
        _warn(
            f"sharpattn: the cached native tile library was damaged: {damaged[0]}; rebuilt it as "
            f"{target.name}."
        )
    return target


def _warn(message: str) -> None:
    """``message`` as a RuntimeWarning, shown once as Python shows warnings; where warnings are
    turned into errors (``PYTHONWARNINGS=error``, ``-W error``) it is printed on stderr instead,
    for what it reports (a fallback, a rebuilt file) is no error: the work goes on."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    except RuntimeWarning:
        print(message, file=sys.stderr, flush=True)


#: the one line on stderr when a process compiles the loops (never on a cache hit)
BUILDING = "sharpattn: building the C++ tile loops once (~10 s) into {folder}"


def _compile(cxx: str, compile_flags: tuple[str, ...], folder: Path, key: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _clean(folder)
    print(BUILDING.format(folder=folder), file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=folder))
    try:
        obj, out = tmp / "tiles.o", tmp / "tiles.so"
        for step in (
            [cxx, *compile_flags, "-c", str(SOURCE), "-o", str(obj)],
            [cxx, *LINK, str(obj), "-o", str(out)],
        ):
            done = subprocess.run(step, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["failed"]
                raise RuntimeError(next((x for x in lines if "error" in x), lines[-1]).strip())
        with open(out, "rb+") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
            os.fsync(f.fileno())
        target = folder / f"tiles-{key}-{digest}.so"
        # atomic: a reader sees no file or a whole one, and builds at once each publish theirs
        os.replace(out, target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions typed, once its bytes are checked against the sha256 in
    its name (ctypes on a damaged file would kill the process)."""
    why = _damage(path)
    if why is not None:
        raise RuntimeError(f"{path}: {why}")
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.path = path
    return lib


@functools.cache
def map_loop(loop: str, name: str):
    """The C++ loop ``loop`` (a key of `_MAP_SIGNATURES`) of the map whose kernel record is
    named ``name``: the library's ``{loop}_{name}``, typed."""
    fn = getattr(library(), f"{loop}_{name}")
    fn.argtypes, fn.restype = _MAP_SIGNATURES[loop], None
    return fn


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (no compiler; a failed build or load warns once)."""
    cxx = compiler()
    if cxx is None:
        return None
    try:
        lib = load(build(cxx))
    except Exception as exc:  # a compiler that cannot build it (no OpenMP, another platform)
        _warn(
            f"sharpattn: the native tile loops could not be built or loaded "
            f"({type(exc).__name__}: {exc}); "
            "the tiled paths run in plain PyTorch (set SHARPATTN_COMPILE=0 to skip building)."
        )
        return None
    _register()
    return lib


def status() -> dict:
    """Whether this process's float32 CPU tiles use the native loops (``active``; building them
    if not yet done), the C++ compiler, the cache folder and the library file (None if none)."""
    lib = None if mode() == "0" else library()
    return {
        "active": lib is not None,
        "compiler": compiler(),
        "cache": str(cache_dir()),
        "library": None if lib is None else str(lib.path),
    }


def _constant(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (over a
    second, triton with it) on ``import sharpattn``: dynamo's decorator sets this one attribute
    (``torch._dynamo.decorators``), which ``tests/paths/test_compile.py`` checks."""
    fn._dynamo_marked_constant = True
    return fn


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a call's tiles (on ``device``, computed in ``dtype``) may use the loops; also
    inside a graph that ``torch.compile`` traces (the loops are operators with fake tensors)."""
    if device.type != "cpu" or dtype != torch.float32 or mode() == "0":
        return False
    return _built()


@_constant
def _built() -> bool:
    """Whether the library is loaded (built on first use); a constant in a traced graph."""
    return library() is not None


def usable(ends: Tensor | None, masked: bool, *tensors: Tensor) -> bool:
    """Whether a tile can go to the loops: every key visible (not ``masked``) or a causal prefix
    per row (``ends`` from `prefix`), its tensors contiguous float32."""
    if masked and ends is None:
        return False
    return all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors)


def _p(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ends(ends: Tensor | None) -> tuple[int | None, int]:
    return (None, 1) if ends is None else (ends.data_ptr(), ends.numel())


def _rows(s: Tensor) -> tuple[int, int]:
    return s.numel() // max(1, s.shape[-1]), s.shape[-1]


def _threads() -> int:
    return torch.get_num_threads()


# ---------------------------------------------------------------------------------------------
# The loops as operators: ``torch.ops.sharpattn.*``. Each real implementation calls the ctypes
# function; each fake one gives the shapes, dtypes and strides of what it returns, so that
# ``torch.compile`` traces through the loops. The arguments a loop writes are declared in
# ``mutates_args``; what it makes is returned as new tensors.


class _Loop:
    """A loop as ``torch.ops.sharpattn.NAME`` inside a graph that ``torch.compile`` traces, and
    as its plain function eagerly: the dispatcher costs a call about 20 µs more (23 µs against
    2.7 µs on the 2-core AMD EPYC, one thread), and stick-breaking makes 136 calls a forward at
    n = 4,096. The operator's real implementation is that same function; it is registered by
    `_register` when the library loads (``op`` is None before)."""

    def __init__(self, fn, name: str, mutates: tuple[str, ...]):
        self.fn, self.name, self.mutates = fn, name, mutates
        self.fake = self.op = None

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        return self.fn(*args)

    def register_fake(self, fake):
        self.fake = fake
        return fake


#: every loop, in the order defined below; `_register` makes each an operator
_LOOPS: list[_Loop] = []


def _op(name: str, mutates: tuple[str, ...]):
    def wrap(fn):
        _LOOPS.append(loop := _Loop(fn, name, mutates))
        return loop

    return wrap


@functools.cache
def _register() -> None:
    """Every loop as ``torch.ops.sharpattn.NAME`` with its fake implementation, once a process
    (`library` calls it when the library loads; a traced graph reaches it through `wanted`)."""
    for loop in _LOOPS:
        op = torch.library.custom_op(
            f"sharpattn::{loop.name}", mutates_args=loop.mutates, device_types="cpu"
        )(loop.fn)
        op.register_fake(loop.fake)
        loop.op = op


@_op("entropy_forward", ("m", "z", "a"))
def _entropy_forward(s: Tensor, ends: Tensor | None, m: Tensor, z: Tensor, a: Tensor) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    library().entropy_forward(_p(s), rows, cols, e, tr, _p(m), _p(z), _p(a), _threads())


@_entropy_forward.register_fake
def _(s, ends, m, z, a):
    return None


@_op("entropy_backward", ("s",))
def _entropy_backward(s: Tensor, ends: Tensor | None, m: Tensor, a: Tensor, c: Tensor) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    library().entropy_backward(_p(s), rows, cols, e, tr, _p(m), _p(a), _p(c), _threads())


@_entropy_backward.register_fake
def _(s, ends, m, a, c):
    return None


@_op("adaptive_forward", ("s",))
def _adaptive_forward(
    s: Tensor, ends: Tensor | None, coef: list[float], threshold: float, floor: float
) -> Tensor:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    stats = s.new_empty(6, *s.shape[:-1], 1)
    c = torch.tensor(coef, dtype=torch.float32)
    library().adaptive_forward(
        *(_p(s), rows, cols, e, tr, _p(c), len(coef) - 1, threshold, floor),
        *(_p(x) for x in stats.unbind(0)),
        _threads(),
    )
    return stats


@_adaptive_forward.register_fake
def _(s, ends, coef, threshold, floor):
    return s.new_empty(6, *s.shape[:-1], 1)


@_op("tempered_backward", ("s", "dp"))
def _tempered_backward(
    s: Tensor,
    dp: Tensor,
    ends: Tensor | None,
    m: Tensor,
    z: Tensor,
    a: Tensor,
    beta: Tensor,
    c: Tensor,
    total: Tensor,
    d: Tensor,
    dbeta: Tensor,
) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    library().tempered_backward(
        *(_p(s), _p(dp), rows, cols, e, tr, _p(m), _p(z), _p(a), _p(beta), _p(c), _p(total)),
        *(_p(d), _p(dbeta), _threads()),
    )


@_tempered_backward.register_fake
def _(s, dp, ends, m, z, a, beta, c, total, d, dbeta):
    return None


@_op("elementwise_forward", ("s",))
def _elementwise_forward(kind: str, p: float, s: Tensor, ends: Tensor | None, row: Tensor) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    map_loop("elementwise_forward", kind)(p, _p(s), rows, cols, e, tr, _p(row), _threads())


@_elementwise_forward.register_fake
def _(kind, p, s, ends, row):
    return None


@_op("elementwise_backward", ("s", "dp"))
def _elementwise_backward(
    kind: str, p: float, s: Tensor, ends: Tensor | None, dp: Tensor, row: Tensor
) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    map_loop("elementwise_backward", kind)(p, _p(s), _p(dp), rows, cols, e, tr, _p(row), _threads())


@_elementwise_backward.register_fake
def _(kind, p, s, ends, dp, row):
    return None


@_op("normalised_forward", ("s",))
def _normalised_forward(
    kind: str, p: float, shift: float, s: Tensor, ends: Tensor | None, m: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    m_new = m.clone(memory_format=torch.contiguous_format)
    f, total = torch.empty_like(m_new), torch.empty_like(m_new)
    map_loop("normalised_forward", kind)(
        p, shift, _p(s), rows, cols, e, tr, _p(m_new), _p(f), _p(total), _threads()
    )
    return m_new, f, total


@_normalised_forward.register_fake
def _(kind, p, shift, s, ends, m):
    return tuple(torch.empty_like(m, memory_format=torch.contiguous_format) for _ in range(3))


@_op("normalised_backward", ("s", "w"))
def _normalised_backward(
    kind: str,
    p: float,
    shift: float,
    s: Tensor,
    ends: Tensor | None,
    dp: Tensor,
    m: Tensor,
    d: Tensor,
    z: Tensor,
    w: Tensor,
) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    map_loop("normalised_backward", kind)(
        *(p, shift, _p(s), _p(dp), _p(w), rows, cols, e, tr),
        *(_p(m), _p(d), _p(z), _threads()),
    )


@_normalised_backward.register_fake
def _(kind, p, shift, s, ends, dp, m, d, z, w):
    return None


@_op("sparse_solve", ("y",))
def _sparse_solve(
    kind: str, e: float, y: Tensor, tau: Tensor, lo: Tensor, hi: Tensor, steps: int
) -> tuple[Tensor, Tensor]:
    rows, cols = _rows(y)
    tau = tau.clone(memory_format=torch.contiguous_format)
    total = torch.empty_like(tau)
    map_loop("sparse_solve", kind)(
        *(e, _p(y), rows, cols, _p(tau), _p(lo), _p(hi), steps),
        *(_p(total), _threads()),
    )
    return tau, total


@_sparse_solve.register_fake
def _(kind, e, y, tau, lo, hi, steps):
    return tuple(torch.empty_like(tau, memory_format=torch.contiguous_format) for _ in range(2))


def _dims(q: Tensor, k: Tensor, v: Tensor, runs: int):
    """The decoding loops' dims and strides (ctypes arrays; see `decode`)."""
    b, h, lq, d = q.shape
    dims = (ctypes.c_int64 * 8)(b, h, k.shape[1], lq, k.shape[2], d, v.shape[-1], runs)
    return dims, (ctypes.c_int64 * 6)(*k.stride()[:3], *v.stride()[:3])


@_op("decode", ())
def _decode(
    kind: str,
    p: float,
    shift: float,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ends: Tensor | None,
    row: Tensor | None,
    runs: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dims, strides = _dims(q, k, v, runs)
    part = q.new_empty(q.shape[0] * q.shape[1] * q.shape[2] * runs * (v.shape[-1] + 2))
    out, m, z, mags = _decoded(q, v)
    map_loop("decode", kind)(
        *(p, shift, _p(q), _p(k), _p(v), ctypes.addressof(dims), ctypes.addressof(strides)),
        *(_ends(ends)[0], _p(row), _p(part), _p(out), _p(m), _p(z), _p(mags), _threads()),
    )
    return out, m, z, mags


def _decoded(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`decode`'s outputs, uninitialised: out ``[B, H, Lq, Dv]``, m and Z ``[B, H, Lq, 1]``,
    the three magnitudes."""
    lead = q.shape[:3]
    return (
        q.new_empty(*lead, v.shape[-1]),
        q.new_empty(*lead, 1),
        q.new_empty(*lead, 1),
        q.new_empty(3),
    )


@_decode.register_fake
def _(kind, p, shift, q, k, v, ends, row, runs):
    return _decoded(q, v)


@_op("decode_adaptive", ())
def _decode_adaptive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ends: Tensor | None,
    coef: list[float],
    threshold: float,
    floor: float,
    runs: int,
) -> tuple[Tensor, Tensor]:
    dims, strides = _dims(q, k, v, runs)
    rows, lk = q.shape[0] * q.shape[1] * q.shape[2], k.shape[2]
    scores = q.new_empty(rows * runs * -(-lk // runs))
    part = q.new_empty(rows * runs * (v.shape[-1] + 5))
    stats = q.new_empty(rows * 4)
    c = torch.tensor(coef, dtype=torch.float32)
    out, mags = _valued(q, v)
    library().decode_adaptive(
        *(_p(q), _p(k), _p(v), ctypes.addressof(dims), ctypes.addressof(strides)),
        *(_ends(ends)[0], _p(c), len(coef) - 1, threshold, floor),
        *(_p(scores), _p(part), _p(stats), _p(out), _p(mags), _threads()),
    )
    return out, mags


@_decode_adaptive.register_fake
def _(q, k, v, ends, coef, threshold, floor, runs):
    return _valued(q, v)


@_op("decode_scores", ())
def _decode_scores(q: Tensor, k: Tensor, runs: int) -> tuple[Tensor, Tensor]:
    dims, strides = _dims(q, k, k, runs)
    s, mags = _scored(q, k)
    library().decode_scores(
        *(_p(q), _p(k), ctypes.addressof(dims), ctypes.addressof(strides), _p(s), _p(mags)),
        _threads(),
    )
    return s, mags


def _scored(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_empty(*q.shape[:3], k.shape[2]), q.new_empty(3)


@_decode_scores.register_fake
def _(q, k, runs):
    return _scored(q, k)


@_op("decode_values", ())
def _decode_values(w: Tensor, v: Tensor, runs: int) -> tuple[Tensor, Tensor]:
    b, h, lq, lk = w.shape
    dims = (ctypes.c_int64 * 8)(b, h, v.shape[1], lq, lk, 0, v.shape[-1], runs)
    strides = (ctypes.c_int64 * 6)(0, 0, 0, *v.stride()[:3])
    part = w.new_empty(b * h * lq * runs * v.shape[-1])
    out, mags = _valued(w, v)
    library().decode_values(
        *(_p(w), _p(v), ctypes.addressof(dims), ctypes.addressof(strides), _p(part), _p(out)),
        *(_p(mags), _threads()),
    )
    return out, mags


def _valued(x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The outputs of the loops that end with w·v, uninitialised: out ``[B, H, Lq, Dv]`` (x
    ``[B, H, Lq, ·]``), the three magnitudes."""
    return x.new_empty(*x.shape[:3], v.shape[-1]), x.new_empty(3)


@_decode_values.register_fake
def _(w, v, runs):
    return _valued(w, v)


@_op("abs_max", ())
def _abs_max(x: Tensor) -> Tensor:
    out = x.new_empty(1)
    library().abs_max(_p(x), x.numel(), _p(out), _threads())
    return out


@_abs_max.register_fake
def _(x):
    return x.new_empty(1)


@_op("sparse_prepare", ("s",))
def _sparse_prepare(
    s: Tensor, ends: Tensor | None, coef: Tensor, floor: float, count: int, width: int
) -> tuple[Tensor, Tensor, Tensor]:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    m, live, cand = _prepared(s, count)
    library().sparse_prepare(
        *(_p(s), rows, cols, e, tr, _p(coef), floor, _p(m), _p(live), _p(cand), count, width),
        _threads(),
    )
    return m, live, cand


def _prepared(s: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor]:
    """`sparse_prepare`'s outputs, uninitialised: m and live ``[.., r, 1]``, the chunk maxima
    ``[.., r, count]``."""
    lead = s.shape[:-1]
    return s.new_empty(*lead, 1), s.new_empty(*lead, 1), s.new_empty(*lead, count)


@_sparse_prepare.register_fake
def _(s, ends, coef, floor, count, width):
    return _prepared(s, count)


@_op("stick_forward", ("s", "carry", "ent", "mass"))
def _stick_forward(
    s: Tensor,
    ends: Tensor | None,
    carry: Tensor,
    ent: Tensor | None,
    mass: Tensor | None,
) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    library().stick_forward(_p(s), rows, cols, e, tr, _p(carry), _p(ent), _p(mass), _threads())


@_stick_forward.register_fake
def _(s, ends, carry, ent, mass):
    return None


@_op("stick_backward", ("s", "carry", "later"))
def _stick_backward(
    s: Tensor, gv: Tensor, ends: Tensor | None, carry: Tensor, later: Tensor, d: Tensor
) -> Tensor:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    w = torch.empty_like(s)
    library().stick_backward(
        *(_p(s), _p(gv), _p(w), rows, cols, e, tr, _p(carry), _p(later), _p(d)), _threads()
    )
    return w


@_stick_backward.register_fake
def _(s, gv, ends, carry, later, d):
    return torch.empty_like(s)


@_op("stick_forward_rows", ("s", "ent", "mass"))
def _stick_forward_rows(
    s: Tensor, ends: Tensor | None, ent: Tensor | None, mass: Tensor | None
) -> None:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    library().stick_forward_rows(_p(s), rows, cols, e, tr, _p(ent), _p(mass), _threads())


@_stick_forward_rows.register_fake
def _(s, ends, ent, mass):
    return None


@_op("stick_backward_rows", ("s",))
def _stick_backward_rows(s: Tensor, gv: Tensor, ends: Tensor | None) -> Tensor:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    w = torch.empty_like(s)
    library().stick_backward_rows(_p(s), _p(gv), _p(w), rows, cols, e, tr, _threads())
    return w


@_stick_backward_rows.register_fake
def _(s, gv, ends):
    return torch.empty_like(s)


@_op("topk_select", ())
def _topk_select(s: Tensor, ends: Tensor | None, k: int) -> tuple[Tensor, Tensor, Tensor]:
    rows, cols = _rows(s)
    e, tr = _ends(ends)
    val, idx, count = _selected(s, k)
    library().topk_select(_p(s), rows, cols, e, tr, k, _p(val), _p(idx), _p(count), _threads())
    return val, idx, count


def _selected(s: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """`topk_select`'s outputs, uninitialised."""
    lead = s.shape[:-1]
    val = s.new_empty(*lead, k)
    return val, s.new_empty(*lead, k, dtype=torch.int64), s.new_empty(lead, dtype=torch.int64)


@_topk_select.register_fake
def _(s, ends, k):
    return _selected(s, k)


# ---------------------------------------------------------------------------------------------
# What the tile paths call


def entropy_forward(s: Tensor, ends: Tensor | None, m: Tensor, z: Tensor, a: Tensor) -> None:
    """Adaptive's running (m, Z, A) updated in place with the base-2 score tile ``s`` (keys past
    ``ends`` unseen)."""
    _entropy_forward(s, ends, m, z, a)


def entropy_backward(s: Tensor, ends: Tensor | None, m: Tensor, a: Tensor, c: Tensor) -> Tensor:
    """dL/ds of adaptive's statistics on one tile, written over ``s`` (returned)."""
    _entropy_backward(s, ends, m, a, c)
    return s


def adaptive_forward(s: Tensor, ends: Tensor | None, coef, threshold: float, floor: float):
    """Adaptive temperature's forward on whole rows of base-2 scores ``s`` ``[.., r, c]``: the
    weights 2^{β·(s − m) − c} written over ``s``, and the rows' (m, Z, a, β, c, Σ weights) as
    one ``[6, .., r, 1]`` tensor (``coef`` the polynomial's coefficients, highest power first)."""
    return _adaptive_forward(s, ends, [float(c) for c in coef], threshold, floor)


def tempered_backward(s, dp, ends, m, z, a, beta, c, total, d, dbeta):
    """(dL/ds written over ``s``, w over ``dp``) of adaptive temperature on whole rows, with
    dp = dO·vᵀ, d = dO·out and dbeta = β'(H) per row (contiguous)."""
    _tempered_backward(s, dp, ends, m, z, a, beta, c, total, d, dbeta)
    return s, dp


def elementwise_forward(kind: str, p: float, s: Tensor, ends: Tensor | None, row: Tensor):
    """The weights of an element-wise kernel (``sigmoid``: σ(s + row); ``relu``:
    ReLU(s)^p / row) on one tile, written over ``s`` (returned); ``row`` contiguous per row."""
    _elementwise_forward(kind, p, s, ends, row)
    return s


def elementwise_backward(kind: str, p: float, s: Tensor, ends: Tensor | None, dp, row: Tensor):
    """(dL/ds written over ``s``, w over ``dp``) of an element-wise kernel on one tile."""
    _elementwise_backward(kind, p, s, ends, dp, row)
    return s, dp


def normalised_forward(kind: str, p: float, shift: float, s: Tensor, ends: Tensor | None, m):
    """(m', f, u, Σ a) of a normalised kernel on one tile; u is written over ``s``."""
    m_new, f, total = _normalised_forward(kind, p, shift, s, ends, m)
    return m_new, f, s, total


def normalised_backward(
    kind: str, p: float, shift: float, s, ends: Tensor | None, dp, m, d, z, w=None
):
    """(dL/ds written over ``s``, w) of a normalised kernel on one tile (w written into ``w``,
    contiguous like ``s``, where given)."""
    w = torch.empty_like(s) if w is None else w
    _normalised_backward(kind, p, shift, s, ends, dp, m, d, z, w)
    return s, w


def decode(kind: str, p: float, shift: float, q, k, v, ends, row, runs: int):
    """(out, m, Z, magnitudes) of a decoding step with the map ``kind`` (a kernel record's name,
    or ``softmax``) in one pass over the cache (`native/tiles.cpp`, ``decode_step``): q
    ``[B, H, Lq, D]`` float32 contiguous and already scaled; k and v ``[B, Hkv, Lk, D|Dv]``
    float32 with unit stride in their last dimension; ``ends`` `prefix_ends` of the rows (a
    causal step) or None; ``row`` ``[B, H, Lq, 1]`` contiguous (the element-wise maps) or None;
    the keys split into ``runs`` runs. m and Z are a normalised map's row reference and Σ a
    relative to it; the magnitudes ``[3]`` are max |k| and max |v| over the whole cache and
    max |q·kᵀ| over every score (infinite or NaN where a value is)."""
    return _decode(kind, p, shift, q, k, v, ends, row, runs)


def decode_scores(q: Tensor, k: Tensor, runs: int) -> tuple[Tensor, Tensor]:
    """(s = q·kᵀ ``[B, H, Lq, Lk]``, magnitudes) of a decoding step in one pass over the keys
    (`native/tiles.cpp`, ``decode_scores``): q float32 contiguous, carrying the scale; k as
    `decode`'s; the magnitudes max |k|, 0, max |s|."""
    return _decode_scores(q, k, runs)


def decode_values(w: Tensor, v: Tensor, runs: int) -> tuple[Tensor, Tensor]:
    """(out = w·v ``[B, H, Lq, Dv]``, magnitudes) of a decoding step in one pass over the values
    (``decode_values``; zero weights skipped): w float32 contiguous ``[B, H, Lq, Lk]``, v as
    `decode`'s; the magnitudes 0, max |v|, 0."""
    return _decode_values(w, v, runs)


def abs_max(x: Tensor) -> float:
    """max |x| of a contiguous float32 tensor in one parallel pass (infinite or NaN where a value
    is); a host read."""
    return float(_abs_max(x))


def decode_adaptive(q, k, v, ends, coef, threshold: float, floor: float, runs: int):
    """(out, magnitudes) of a decoding step of adaptive temperature in one pass over the cache
    (`native/tiles.cpp`, ``decode_adaptive``): q ``[B, H, Lq, D]`` float32 contiguous, carrying
    scale·log₂e; k, v, ``ends`` and ``runs`` as `decode`; β(H) = max(poly(H), ``floor``) above
    ``threshold`` (``coef`` highest power first), else 1; the magnitudes as `decode`'s but the
    last, max |β·s| over the rows' own β (base-2 scores)."""
    return _decode_adaptive(q, k, v, ends, [float(c) for c in coef], threshold, floor, runs)


def sparse_solve(kind: str, e: float, y: Tensor, tau: Tensor, lo: Tensor, hi: Tensor, steps: int):
    """(τ, p, Σ p) of the entmax family on a slab ``y`` ``[.., r, c]``: ``steps`` safeguarded
    Newton steps from ``tau`` in [lo, hi], then p = [y − τ]_+^e written over ``y``."""
    tau, total = _sparse_solve(kind, e, y, tau, lo, hi, steps)
    return tau, y, total


def sparse_prepare(s: Tensor, ends: Tensor | None, coef, floor: float, chunks: int):
    """(y, m, live, chunk maxima) of an entmax slab ``s`` ``[B, H, r, c]``: m the rows' largest
    visible score (0 where none), y = max((s − m)·coef, floor) written over ``s`` (floor past a
    row's causal end), the largest y of each of ``chunks`` runs of keys, unsorted."""
    cols = s.shape[-1]
    width = max(1, cols // chunks)
    count = cols // width + (1 if cols % width else 0)  # the rest of the keys: one more run
    coef = torch.as_tensor(coef, dtype=s.dtype).expand(*s.shape[:-1], 1).contiguous()
    m, live, cand = _sparse_prepare(s, ends, coef, floor, count, width)
    return s, m, live, cand


def stick_forward(s: Tensor, ends: Tensor | None, carry: Tensor, ent=None, mass=None) -> Tensor:
    """Stick-breaking's weights on one tile whose keys are reversed, written over ``s``
    (returned); ``carry`` (Σ log σ(−s) to the right, per row) updated in place, and ``ent`` and
    ``mass`` (contiguous, per row) accumulated when given. ``ends``: `prefix`
    of the tile in its own key order."""
    _stick_forward(s, ends, carry, ent, mass)
    return s


def stick_backward(s: Tensor, gv: Tensor, ends: Tensor | None, carry, later, d):
    """(dL/ds written over ``s``, w) of stick-breaking on one reversed tile, with gv = dO·vᵀ;
    ``carry`` (float32) and ``later`` (Σ w·g to the right, float64) updated in place, ``d`` =
    Σ_j w_j·g_j over the whole row (float64, from the same products)."""
    return s, _stick_backward(s, gv, ends, carry, later, d)


def stick_forward_rows(s: Tensor, ends: Tensor | None, ent=None, mass=None) -> Tensor:
    """Stick-breaking's weights on whole rows with the keys in order (the decoding path: each
    row of ``s`` ``[.., c]`` is every key its query may see, the first ``ends`` of them visible
    per row, `prefix`), written over ``s`` (returned); ``ent`` and ``mass`` (contiguous, one
    per row) written when given."""
    _stick_forward_rows(s, ends, ent, mass)
    return s


def stick_backward_rows(s: Tensor, gv: Tensor, ends: Tensor | None):
    """(dL/ds written over ``s``, w) of stick-breaking on whole rows with the keys in order,
    with gv = dO·vᵀ: dL/ds_j = w_j·g_j − σ(s_j)·Σ_{k<=j} w_k·g_k."""
    return s, _stick_backward_rows(s, gv, ends)


def topk_select(s: Tensor, ends: Tensor | None, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(values, key indices, count) of each row's ``k`` largest visible scores of ``s``
    ``[.., r, c]``, in descending order with ties in key order: values and indices ``[.., r, k]``
    (slots past a row's visible keys hold 0), count ``[.., r]`` int64 the filled slots."""
    return _topk_select(s, ends, k)
