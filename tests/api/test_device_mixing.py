"""The device suites cannot leave a tensor on the CPU beside the device's and still pass on the
CPU: the test bugs of the first CUDA run are caught here, before a GPU is at hand.

Every test file that can run on another device takes ``DEVICE`` from tests/devices.py (checked
below on the source of every file under tests/), and tests/conftest.py runs each test of such a
module under ``devices.DeviceTags`` on the CPU, which refuses an op that meets a tensor on
``DEVICE`` and one left on the CPU. The tests here hold the tags to the two patterns that failed
on the H200 (a CPU ``torch.eye`` as ``v`` beside CUDA q and k, and a CPU output gradient beside
a CUDA ``v``) and to what must pass: the library's own tensors, moves, CPU references compared
on the CPU, 0-dim CPU scalars. This module takes ``DEVICE`` too, so its tests run under the
fixture's tags as a device suite's do.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch

from devices import DEVICE, DeviceMixing, DeviceTags, tag_of
from precision import assert_close
from sharpattn import attend, causal_mask

TESTS = Path(__file__).resolve().parents[1]
VARIABLE = "SHARPATTN_TEST_DEVICE"
#: the files that may read SHARPATTN_TEST_DEVICE themselves: devices.py (DEVICE) and conftest.py
#: (no TRITON_INTERPRET on a CUDA run)
READERS = {"devices.py", "conftest.py"}
#: the tags run where DEVICE is the CPU (on a GPU the device itself refuses a mix)
on_the_cpu = pytest.mark.skipif(DEVICE.type != "cpu", reason="the tags run on the CPU only")


@functools.cache
def _modules() -> tuple[tuple[Path, ast.Module], ...]:
    """(path under tests/, syntax tree) of every file that names the variable or devices.py."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        text = path.read_text()
        if VARIABLE in text or "devices" in text:
            found.append((path.relative_to(TESTS), ast.parse(text, str(path))))
    return tuple(found)


def _reads_the_variable(tree: ast.Module) -> bool:
    """Whether the code hands SHARPATTN_TEST_DEVICE to a call or a subscript (``os.environ.get``,
    ``os.getenv``, ``os.environ[...]``); a docstring may mention it."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            args = [*n.args, *(kw.value for kw in n.keywords)]
        elif isinstance(n, ast.Subscript):
            args = [n.slice]
        else:
            continue
        if any(isinstance(a, ast.Constant) and a.value == VARIABLE for a in args):
            return True
    return False


def _imports_devices(tree: ast.Module) -> bool:
    return any(
        (isinstance(n, ast.ImportFrom) and n.module == "devices")
        or (isinstance(n, ast.Import) and any(a.name == "devices" for a in n.names))
        for n in ast.walk(tree)
    )


def _binds_device(tree: ast.Module) -> bool:
    """``from devices import DEVICE`` at module level: what tests/conftest.py looks for."""
    return any(
        isinstance(n, ast.ImportFrom)
        and n.module == "devices"
        and any(a.name == "DEVICE" and a.asname is None for a in n.names)
        for n in tree.body
    )


def _skips_the_device_suite_on_the_cpu(tree: ast.Module) -> bool:
    """A module-level ``pytestmark`` with a ``skipif`` on DEVICE: the tags would never see it."""
    for n in tree.body:
        targets = n.targets if isinstance(n, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            for call in ast.walk(n.value):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "skipif"
                    and "DEVICE" in ast.unparse(call)
                ):
                    return True
    return False


# ---------------------------------------------------------------------------------------------
# every device suite is covered


def test_only_devices_py_reads_the_test_device():
    """A new device suite takes DEVICE from tests/devices.py, so the tags cover it."""
    readers = [str(p) for p, tree in _modules() if _reads_the_variable(tree)]
    assert set(readers) <= READERS, (
        f"{sorted(set(readers) - READERS)} read SHARPATTN_TEST_DEVICE: take the device with "
        "`from devices import DEVICE` (tests/devices.py), whose tags catch a tensor left on the "
        "CPU beside the device's on the CPU"
    )


def test_every_device_suite_binds_device_and_runs_on_the_cpu():
    """tests/conftest.py turns the tags on for a module whose ``DEVICE`` is devices.py's, and only
    a test that runs on the CPU meets them: a suite too slow for the CPU runs small cases there
    (tests/paths/test_devices.py), not a module-wide skip."""
    suites = [(p, t) for p, t in _modules() if p.name.startswith("test_") and _imports_devices(t)]
    assert len(suites) >= 5  # the four device suites and this module
    unbound = [str(p) for p, tree in suites if not _binds_device(tree)]
    assert not unbound, f"{unbound}: take the device as `from devices import DEVICE`"
    skipped = [str(p) for p, tree in suites if _skips_the_device_suite_on_the_cpu(tree)]
    assert not skipped, f"{skipped}: skipped on the CPU, where the tags run; run small cases"


@on_the_cpu
def test_the_tags_are_on_in_this_module():
    assert any(
        isinstance(m, DeviceTags) for m in torch.overrides._get_current_function_mode_stack()
    )
    assert tag_of(torch.randn(3)) == "host"
    assert tag_of(torch.randn(3, device=DEVICE)) == "device"
    assert tag_of(torch.randn(3).to(DEVICE)) == "device"


# ---------------------------------------------------------------------------------------------
# the two patterns of the first CUDA run


def _local_rows():
    """tests/paths/test_triton.py's block-support inputs, smaller: q, k, v on the CPU."""
    g = torch.Generator().manual_seed(5)
    angle = torch.arange(32.0)[:, None] * torch.logspace(-1.5, 0, 4)[None, :]
    k = torch.cat([angle.cos(), angle.sin()], -1).expand(1, 2, 32, 8)
    k = k + 0.01 * torch.randn(1, 2, 32, 8, generator=g)
    return k[:, :, 16:] * 2.0, k, torch.randn(1, 2, 32, 4, generator=g)


@on_the_cpu
def test_a_cpu_identity_as_values_beside_device_q_and_k_is_refused():
    """The block-support test before its fix: ``torch.eye`` made on the CPU as v, q and k on
    DEVICE (refused inside attend, naming this line); and the CPU copy of the kernel's block
    table against flags from the device's weights."""
    q, k, v = _local_rows()
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    ref64 = [t.detach().double().requires_grad_() for t in leaves]
    with pytest.raises(DeviceMixing, match=r"called from \S*test_device_mixing\.py:\d+"):
        attend(
            *(t.detach() for t in ref64[:2]),
            torch.eye(32, dtype=torch.float64).expand(1, 2, 32, 32),
            "sparsemax",
            scale=0.25,
            causal=True,
            impl="naive",
        )
    eye = torch.eye(32, dtype=torch.float64, device=DEVICE).expand(1, 2, 32, 32)  # the fix
    w = attend(
        *(t.detach() for t in ref64[:2]), eye, "sparsemax", scale=0.25, causal=True, impl="naive"
    )
    flagged = w.cpu() > 0  # the kernel's table, read on the host
    with pytest.raises(DeviceMixing, match=r"__or__ at \S*test_device_mixing\.py"):
        _ = flagged | ~(w > 0)
    assert bool((flagged | ~(w > 0).cpu()).all())  # the fix: compared on the CPU


@on_the_cpu
def test_a_cpu_output_gradient_beside_device_tensors_is_refused():
    """The stick-breaking large-score test before its fix: the output gradient drawn on the CPU
    and multiplied with v on DEVICE; and the same gradient handed to autograd for a DEVICE
    output (``torch.autograd.grad``, ``Tensor.backward``)."""
    q, k, v = (t.to(DEVICE).requires_grad_() for t in _local_rows())
    out = attend(q, k, v, "stick_breaking", causal=True)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))  # run's dO
    with pytest.raises(DeviceMixing, match=r"matmul at \S*test_device_mixing\.py"):
        g @ v.detach().repeat_interleave(1, 1).transpose(-1, -2)
    with pytest.raises(DeviceMixing, match=r"grad at \S*test_device_mixing\.py"):
        torch.autograd.grad(out, (q, k, v), g)
    with pytest.raises(DeviceMixing, match=r"backward at \S*test_device_mixing\.py"):
        out.backward(g)
    g = g.to(out)  # the fix
    assert tag_of(g) == "device"
    dp = g @ v.detach().transpose(-1, -2)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert tag_of(dp) == "device" and all(tag_of(d) == "device" for d in grads)


# ---------------------------------------------------------------------------------------------
# what must pass


@on_the_cpu
@pytest.mark.parametrize("impl", ["fused", "chunked", "naive"])
def test_the_librarys_own_tensors_and_cpu_references_pass(impl):
    """Tensors the library makes (``device=q.device``: the DEVICE object for a tagged q), masks
    made on DEVICE, 0-dim CPU scalars, ``*_like``, a CPU reference compared after ``.cpu()``."""
    q, k, v = (t.to(DEVICE).requires_grad_() for t in _local_rows())
    mask = torch.rand(16, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE) < 0.8
    mask = mask & causal_mask(16, 32, device=DEVICE)
    out = attend(q, k, v, "softmax", mask=mask, impl=impl)
    assert tag_of(out) == "device" and out.device is DEVICE
    (out * torch.tensor(2.0) + torch.ones_like(out)).sum().backward()
    cpu = [t.detach().cpu() for t in (q, k, v)]
    assert all(tag_of(t) == "host" for t in cpu)
    ref = attend(*(t.double() for t in cpu), "softmax", mask=mask.cpu(), impl="naive")
    assert_close(out, ref, n=32)
    with pytest.raises(DeviceMixing):
        attend(*cpu[:2], v, "softmax")


@on_the_cpu
def test_a_move_on_the_cpu_leaves_the_original_where_it_was():
    """On a GPU ``x.to(DEVICE)`` is a copy and x stays on the CPU; on the CPU torch gives x
    itself, so the tags give a copy: x beside its moved copy is a mix, as on a GPU."""
    x = torch.randn(3, 4)
    y = x.to(DEVICE)
    assert y is not x and tag_of(x) == "host" and tag_of(y) == "device"
    with pytest.raises(DeviceMixing):
        x + y
    assert tag_of(y.cpu()) == "host" and tag_of(y.to(torch.float64)) == "device"
