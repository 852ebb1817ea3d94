"""The device the device suites run on, and the check that keeps them from mixing devices.

``DEVICE`` is ``SHARPATTN_TEST_DEVICE`` (default ``cpu``) as one ``torch.device`` object: every
test file that can run on another device takes it from here (``from devices import DEVICE``),
and ``tests/api/test_device_mixing.py`` holds every file that reads the variable to that.

On a GPU a test that hands a CPU tensor to an op with a CUDA one fails, but on the CPU, where
``DEVICE`` is the CPU too, it passes: the first CUDA run of these suites had such test bugs
among its failures. :class:`DeviceTags` makes the two distinguishable on the CPU. While it is
active (``tests/conftest.py`` turns it on for every test of a module whose ``DEVICE`` is this
one, when ``DEVICE`` is the CPU), every tensor carries a tag:

* ``"device"``: made with ``device=DEVICE`` or moved by ``.to(DEVICE)``, anywhere; the library
  makes its tensors with ``device=q.device``, so ``.device`` of a tagged tensor answers the
  ``DEVICE`` object itself and what is made from it is tagged too;
* ``"host"``: made in test code (a file under tests/) without ``device=DEVICE`` (a factory
  such as ``torch.eye``, ``torch.randn(..., generator=g)``), or moved there by ``.cpu()`` or
  ``.to("cpu")``: what would stay on the CPU on a GPU run;
* no tag: made by the library or by torch from no tagged tensor (it cannot be on the wrong
  device by the test's doing).

An op's result takes its inputs' tag. Any op that meets a ``"device"`` and a ``"host"`` tensor
of one or more dimensions (a 0-dim CPU tensor may meet a CUDA one) raises
:class:`DeviceMixing`, naming the op and the test line: in test code, inside the library
(``attend`` given a CPU ``v``), and in ``torch.autograd.grad`` / ``Tensor.backward`` (a CPU
output gradient for a device output). Moves and copies (``.to``, ``.cpu()``, ``copy_``) are no
mix; on the CPU, where ``x.to(DEVICE)`` is ``x`` itself, the move gives a copy, so ``x`` stays
``"host"`` as it stays on the CPU on a GPU run.

What it cannot see: code that runs only on a GPU (``if DEVICE.type != "cpu"``), and a device
that travels as a ``torch.device`` rather than a tensor through code that makes a new one
(``Masking.build(mask, causal, lq, lk, cpu_q.device)`` for kernels given DEVICE tensors).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

#: where the device suites run: one object, so the check below can tell ``device=DEVICE`` from
#: ``device="cpu"`` on the CPU
DEVICE = torch.device(os.environ.get("SHARPATTN_TEST_DEVICE", "cpu"))

TESTS = str(Path(__file__).resolve().parent) + os.sep
_TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
_HERE = str(Path(__file__).resolve())

_DEVICE_GETTER = torch._C.TensorBase.device
_TO = {torch.Tensor.to, torch._C.TensorBase.to}
_CPU = {torch.Tensor.cpu, torch._C.TensorBase.cpu}
_CUDA = {torch.Tensor.cuda, torch._C.TensorBase.cuda}
#: moves and copies between devices: no mixing
_MOVES = _TO | _CPU | _CUDA | {torch.Tensor.copy_, torch._C.TensorBase.copy_}


class DeviceMixing(AssertionError):
    """A test handed a tensor left on the CPU to an op with a tensor on ``DEVICE``."""


#: the tensor attribute that holds a tag (an attribute, not a weak dictionary: looked up on
#: every op)
_TAG = "_sharpattn_device_tag"


def tag_of(t: torch.Tensor) -> str | None:
    """``"device"``, ``"host"`` or None: the tag :class:`DeviceTags` gave ``t``."""
    return getattr(t, _TAG, None)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments, in lists and tuples too (``torch.cat``, the outputs
    and gradients of ``torch.autograd.grad``)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    found.append(b)
                elif isinstance(b, (list, tuple)):
                    found.extend(x for x in b if isinstance(x, torch.Tensor))
    return found


def _frames():
    """The frames that called the op, innermost first, past torch's own and this module's."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != _HERE:
            yield frame
        frame = frame.f_back


def _in_tests() -> bool:
    """Whether the op was called from test code (a file under tests/), not the library."""
    frame = next(_frames(), None)
    return frame is not None and frame.f_code.co_filename.startswith(TESTS)


def _site(frame) -> str:
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"


class DeviceTags(TorchFunctionMode):
    """Tags tensors ``"device"`` or ``"host"`` (module docstring) and refuses an op that mixes
    them; :func:`tag_of` reads a tag."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_GETTER:
            (t,) = args
            return DEVICE if getattr(t, _TAG, None) == "device" else func(t)
        inputs = _tensors(args, kwargs)
        tags = {getattr(t, _TAG, None) for t in inputs if t.dim() > 0}
        if "device" in tags and "host" in tags and func not in _MOVES:
            self._refuse(func, inputs)
        out = func(*args, **kwargs)
        tag = self._result_tag(func, args, kwargs, inputs)
        if func in _MOVES and out is args[0]:
            # a move to where the tensor already is (the CPU) gives the tensor itself; on a GPU
            # it gives a copy on the other device, and the original stays where it was
            if getattr(out, _TAG, None) not in (None, tag):
                out = out.clone()
            if tag is not None:
                setattr(out, _TAG, tag)
            return out
        if tag is None and not any(getattr(t, _TAG, None) for t in inputs):
            return out  # nothing tagged in, nothing to tag out (most of the library's ops)
        for r in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(r, torch.Tensor) and not any(r is t for t in inputs):
                setattr(r, _TAG, tag)  # in-place results (the input itself) keep theirs
        return out

    @staticmethod
    def _refuse(func, inputs):
        dev = next(t for t in inputs if t.dim() > 0 and getattr(t, _TAG, None) == "device")
        host = next(t for t in inputs if t.dim() > 0 and getattr(t, _TAG, None) == "host")
        frames = list(_frames())
        tests = [f for f in frames if f.f_code.co_filename.startswith(TESTS)]
        where = _site(frames[0]) if frames else "?"
        if tests and tests[0] is not frames[0]:
            where += f", called from {_site(tests[0])}"
        name = getattr(func, "__name__", None) or repr(func)
        raise DeviceMixing(
            f"{name} at {where} mixes a tensor on DEVICE {tuple(dev.shape)} with one left on "
            f"the CPU {tuple(host.shape)}: on a GPU this fails. Make it with device=DEVICE or "
            "move it with .to(DEVICE) (a CPU reference: compare after .cpu())."
        )

    @staticmethod
    def _result_tag(func, args, kwargs, inputs):
        """The tag of what ``func`` returns."""
        if func in _MOVES:
            where = [x for x in (*args, *kwargs.values()) if isinstance(x, (torch.device, str))]
            if func in _CUDA or any(x is DEVICE for x in where):  # .to(DEVICE)
                return "device"
            if func in _CPU:
                return "host" if _in_tests() else None
            if len(inputs) > 1:  # .to(other), copy_: the first's (where other is, or itself)
                return getattr(inputs[1 if func in _TO else 0], _TAG, None)
            if where:  # "cpu" in a test: a CPU reference; another device (not DEVICE): the
                # device of an untagged tensor, unknown
                return "host" if any(isinstance(x, str) for x in where) and _in_tests() else None
            return getattr(inputs[0], _TAG, None)  # .to(dtype)
        device = kwargs.get("device")
        if device is DEVICE:  # torch.zeros(..., device=DEVICE), x.new_zeros(..., device=DEVICE)
            return "device"
        if inputs:  # what is made from tensors is where they are
            tags = {getattr(t, _TAG, None) for t in inputs}
            return "device" if "device" in tags else "host" if "host" in tags else None
        # a factory (torch.eye, torch.randn(..., generator=g)), in a test: "host" unless given a
        # device object (not DEVICE: an untagged tensor's, unknown)
        return "host" if not isinstance(device, torch.device) and _in_tests() else None
