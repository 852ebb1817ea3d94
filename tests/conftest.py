"""Shared by every test folder. The helpers beside this file (precision, reference, tiny_hf,
slab_inputs, devices) are importable from every sub-folder through ``pythonpath = ["tests"]`` in
pyproject.toml."""

import os

# Triton's kernels run on the CPU in its interpreter (tests/paths/test_triton.py). Triton reads
# TRITON_INTERPRET when it is imported (its own jitted functions, tl.sum among them, are defined
# then), and any test that touches torch.compile imports it (torch._dynamo does; importing
# sharpattn does not: tests/api/test_import_cost.py), so it is set before any import here; not on
# a CUDA test run (SHARPATTN_TEST_DEVICE=cuda), where the kernels compile for the GPU.
if os.environ.get("SHARPATTN_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

from sharpattn import normalizers as nz  # noqa: E402

# Property tests: enough examples to find edge cases, no per-example deadline (CPU CI is shared).
# "default" draws the same examples on every run (derandomize), so a test suite that passed
# passes on the next machine; HYPOTHESIS_PROFILE=explore draws new ones, many more, to hunt for
# edge cases (it found the subnormal gap of test_proposition_3_2_extreme_beta...).
settings.register_profile("default", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
# Commands default --threads to the cores free now, which differs between runs (and between a
# killed run and its resumption); the suite runs every command with one thread, subprocesses
# included, unless a test passes --threads (tests/experiments/test_cli.py unsets it to test the
# default).
os.environ["SHARPATTN_THREADS"] = "1"
# Commands refuse to run from a checkout with uncommitted changes unless told (--allow-dirty):
# the suite runs in the checkout being edited, so it allows them (tests/experiments/test_cli.py
# unsets it to test the refusal).
os.environ["SHARPATTN_ALLOW_DIRTY"] = "1"
# SHARPATTN_TEST_TRITON_CPU=1: CPU tensors of float32 and float16 take the Triton kernels (in
# Triton's interpreter) wherever a CUDA tensor of that dtype would, so a suite written for every
# path (tests/contract/test_adversarial.py) meets the kernels without a GPU; bfloat16 stays on the
# tiles (the interpreter's bfloat16 tl.dot is wrong). Slow: a developer's tool, not CI's.
if os.environ.get("SHARPATTN_TEST_TRITON_CPU") == "1":
    from sharpattn.attention import devices  # noqa: E402

    def _triton_on_cpu(device: torch.device, dtype: torch.dtype) -> bool:
        return (
            dtype in (torch.float32, torch.float16)
            and os.environ.get("SHARPATTN_TRITON", "1").strip() != "0"
            and not torch.compiler.is_compiling()
        )

    devices.triton_ready = _triton_on_cpu  # the one readiness check every backend choice asks
# Under pytest-xdist (`make test` runs one worker per core) each worker takes one thread.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _device_tags(request):
    """On the CPU, in a module that takes ``DEVICE`` from tests/devices.py: every tensor tagged
    by where it would be on a GPU run, and an op that mixes the two refused (devices.py)."""
    import devices

    module = getattr(request, "module", None)
    if devices.DEVICE.type != "cpu" or getattr(module, "DEVICE", None) is not devices.DEVICE:
        yield
        return
    with devices.DeviceTags():
        yield


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored afterwards (``runner.threads(1)``): tiny models
    run many small ops, which two threads slow down badly on a shared 2-core machine, and a
    bitwise comparison of two runs needs one thread. Module-wide:
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from sharpattn.lab.runner import threads

    with threads(1) as n:
        yield n


@pytest.fixture
def register_normalizer():
    """``register_normalizer(entry)`` registers a throw-away normalizer for this test and returns
    its name; every entry registered this way is unregistered afterwards, even on failure."""
    names: list[str] = []

    def register(entry: nz.Normalizer) -> str:
        nz.register(entry)
        names.append(entry.name)
        return entry.name

    yield register
    for name in reversed(names):
        nz.unregister(name)


def scaled_softmax(scores, mask=None, *, gain=1.0, check_finite=True):
    """softmax(gain · scores): the test normalizer's function."""
    return nz.softmax(scores * gain, mask, check_finite=check_finite)


@pytest.fixture
def gain_normalizer(register_normalizer):
    """The test normalizer: softmax(g·s) with a learnable per-head gain g (the identity on
    softmax at g = 1, softmax at temperature 1/g otherwise), no fused path. Gives its name."""
    return register_normalizer(
        nz.Normalizer(
            name="test-gain",
            fn=scaled_softmax,
            formula="softmax(g·s)",
            citation="test",
            sums_to_one=True,
            params=(nz.Param("gain", 1.0, "per-head gain", learnable=True),),
        )
    )


_INTERPRET = os.environ.get("TRITON_INTERPRET")


@pytest.fixture(autouse=True)
def _triton_stays_interpreted(request):
    """TRITON_INTERPRET stays as the session set it: Triton reads it again when it imports a
    module late (its gluon language, on a kernel's first launch), so a test that changed it would
    break the kernels of every later test in its process. Restored, and that test fails."""
    yield
    changed = os.environ.get("TRITON_INTERPRET")
    if changed != _INTERPRET:
        if _INTERPRET is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _INTERPRET
        pytest.fail(f"the test changed TRITON_INTERPRET from {_INTERPRET!r} to {changed!r}")
