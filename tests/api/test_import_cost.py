"""``import sharpattn`` stays cheap: it imports neither ``torch._dynamo`` (over a second on the
2-core CI machine; ``torch.compiler.assume_constant_result`` imports it) nor ``triton`` nor
``torch._inductor``. The C++ loops' operators are registered when their library loads
(attention/native.py), the Triton kernels on first CUDA use (attention/devices.py)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from sharpattn.attention import native

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("triton", "torch._dynamo", "torch._inductor")

CODE = f"""
import sys
import sharpattn
import sharpattn.cli
from sharpattn.attention import native
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
