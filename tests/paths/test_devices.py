"""Every method's ``impl="auto"`` path on another device, at sizes where the tiled paths walk many
tiles: the same output and gradients as the naive path in float64 on that device.

Runs where ``SHARPATTN_TEST_DEVICE`` names a device other than the CPU (``cuda``), as the
adversarial suite does with the same variable::

    SHARPATTN_TEST_DEVICE=cuda pytest tests/paths/test_devices.py tests/contract/test_adversarial.py

On the CPU (whose paths have their own tests, against float64 formulas, in this folder) it runs
small cases only, so that ``tests/devices.py``'s check sees every tensor the test makes: one
left on the CPU beside the device's fails there, not on the next GPU run.
"""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE
from precision import assert_close
from sharpattn import attend
from sharpattn import normalizers as nz

pytestmark = pytest.mark.numerical

#: (Lq, Lk, causal): a square call of ~9M scores (several tiles per head group), and
#: a causal one whose queries end at the last key (Lk − Lq = 1,100 keys before the first query)
CASES = [(1500, 1500, False), (700, 1800, True)]
#: the tile budgets: the CPU's (SHARPATTN_DEVICE_TILES=1: many tiles per call), the device's own
TILES = ["1", "default"]
if DEVICE.type == "cpu":
    # the same shapes, small; the CPU's budgets are the same either way. What this checks here is
    # the test's own tensors (tests/devices.py), which no CPU code path changes: not run again
    # under the CPU's other paths (tests/cpu_paths.py)
    CASES, TILES = [(40, 40, False), (20, 50, True)], ["1"]
    pytestmark = [pytestmark, pytest.mark.cpu_independent]


def inputs(lq: int, lk: int):
    """q, k, v ``[1, 4, L, 32]`` with two key/value heads (grouped queries), |s| of a few units."""
    g = torch.Generator().manual_seed(lq + lk)
    q = torch.randn(1, 4, lq, 32, generator=g, dtype=torch.float64) * 0.5
    k = torch.randn(1, 2, lk, 32, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, lk, 32, generator=g, dtype=torch.float64)
    cot = torch.randn(1, 4, lq, 32, generator=g, dtype=torch.float64)
    return [t.to(DEVICE) for t in (q, k, v, cot)]


def output_and_grads(method, q, k, v, cot, causal, impl, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    # the reference checks its input (stick_breaking's causal check needs check_finite=True)
    out = attend(q, k, v, method, causal=causal, impl=impl, check_finite=impl == "naive")
    grads = torch.autograd.grad(out, (q, k, v), cot.to(dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads, strict=True)]
    return out.detach(), grads


@pytest.mark.parametrize("tiles", TILES, ids={"1": "cpu-tiles", "default": "device-tiles"}.get)
@pytest.mark.parametrize("case", CASES, ids=["full", "causal"])
@pytest.mark.parametrize("method", nz.available())
def test_auto_path_on_the_device_equals_naive_float64(method, case, tiles, monkeypatch):
    """With the CPU's tile budgets (many tiles per call) and the device's own (a few)."""
    lq, lk, causal = case
    if tiles == "default":
        monkeypatch.delenv("SHARPATTN_DEVICE_TILES", raising=False)
    else:
        monkeypatch.setenv("SHARPATTN_DEVICE_TILES", tiles)
    q, k, v, cot = inputs(lq, lk)
    try:
        ref, ref_grads = output_and_grads(method, q, k, v, cot, causal, "naive", torch.float64)
    except ValueError as err:  # stick_breaking refuses a non-causal call on every path
        with pytest.raises(ValueError):
            output_and_grads(method, q, k, v, cot, causal, "auto", torch.float32)
        pytest.skip(str(err))
    out, grads = output_and_grads(method, q, k, v, cot, causal, "auto", torch.float32)
    assert out.device.type == DEVICE.type and out.dtype == torch.float32
    s_max = float(q.norm(dim=-1).max() * k.norm(dim=-1).max()) / 32**0.5  # |s| bound
    v_max = float(v.abs().max())
    # stick_breaking's weights are products of up to Lk factors (as in the adversarial suite)
    grow = lk if method == "stick_breaking" else 1
    mag = v_max * (1 + s_max) * grow
    assert_close(out, ref, dtype=torch.float32, n=lk, magnitude=mag, ulps=16, msg="output")
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert_close(
            got,
            want,
            dtype=torch.float32,
            n=lk,
            magnitude=mag * (1 + s_max),
            ulps=64 * grow,
            msg=f"d/d{name}",
        )
