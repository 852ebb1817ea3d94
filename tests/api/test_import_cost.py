"""``import sharpattn`` stays cheap: it imports neither ``torch._dynamo`` (over a second on the
2-core CI machine; ``torch.compiler.assume_constant_result`` imports it) nor ``triton`` nor
``torch._inductor``. The C++ loops' operators are registered when their library loads
(attention/cpu/native.py), the Triton kernels on first CUDA use (attention/devices.py).

``sharpattn --help`` imports no torch at all: the package's names are imported on first use
(``sharpattn.__getattr__``) and the command line imports what a command runs when it runs."""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from sharpattn.attention.cpu import native

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("triton", "torch._dynamo", "torch._inductor")

CODE = f"""
import sys
import sharpattn
import sharpattn.cli
from sharpattn.attention.cpu import native
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
print(hasattr(native._LOOPS[0].op, "register_fake"))
"""


def test_import_does_not_load_dynamo_or_triton():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    loaded, registered = out.stdout.split()
    assert loaded == "[]", f"import sharpattn imported {loaded}"
    assert registered == "False", "the loops' operators were registered on import"


#: what the command's first screen must not import (torch alone takes one to two seconds)
NOT_ON_HELP = ("torch", "numpy", "scipy", "matplotlib", "transformers", "sharpattn.attention")

#: `python -m sharpattn ARGS`, then the loaded modules among NOT_ON_HELP (atexit: after the
#: command's SystemExit)
HELP_CODE = f"""
import atexit, runpy, sys
names = {NOT_ON_HELP!r}
atexit.register(lambda: print("LOADED", sorted(n for n in names if n in sys.modules)))
sys.argv = ["sharpattn", *sys.argv[1:]]
runpy.run_module("sharpattn", run_name="__main__", alter_sys=True)
"""


def _sharpattn(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-c", HELP_CODE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


def test_help_imports_no_torch():
    """``python -m sharpattn --help`` (and ``-h``, and bare ``sharpattn``) lists the commands
    without importing torch, numpy or the library's layers; so does a hand-written command's
    ``--help``. The wall-clock time is printed as a measurement, not asserted."""
    for args in (["--help"], ["-h"], [], ["list", "--help"], ["demo", "--help"]):
        start = time.perf_counter()
        proc = _sharpattn(*args)
        seconds = time.perf_counter() - start
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("Usage: sharpattn"), proc.stdout
        assert proc.stdout.rstrip().splitlines()[-1] == "LOADED []", (args, proc.stdout)
        print(f"sharpattn {' '.join(args)}: {seconds:.2f} s")


def test_import_sharpattn_imports_no_torch_until_a_name_is_used():
    """``import sharpattn`` is cheap; ``sharpattn.attend`` (and every name of ``__all__``)
    imports what defines it on first use."""
    code = (
        "import sys, sharpattn; before = 'torch' in sys.modules; "
        "names = [n for n in sharpattn.__all__ if getattr(sharpattn, n) is None]; "
        "from sharpattn.attention import attend; "
        "print(before, names, sharpattn.attend is attend, 'attend' in dir(sharpattn))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "[]", "True", "True"], out.stdout


def test_constant_marks_as_dynamo_does():
    """`native._constant` (used instead of ``torch.compiler.assume_constant_result``, which
    imports dynamo) sets what dynamo's own decorator sets."""

    def a():
        return 1

    def b():
        return 1

    torch.compiler.assume_constant_result(a)
    native._constant(b)
    assert vars(a) == vars(b) == {"_dynamo_marked_constant": True}
