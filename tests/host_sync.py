"""`NoHostSync`: a ``TorchFunctionMode`` that raises where code would make a CUDA host wait for
the device, so that a CPU-only run finds what ``torch.cuda.set_sync_debug_mode("error")`` finds
on a GPU (``tests/paths/test_no_sync.py`` runs both).

What synchronises on CUDA, and so what it refuses:

* reading a value on the host: ``Tensor.item``, ``tolist``, ``__bool__`` (``if t:``,
  ``max(t, u)``), ``__float__``, ``__int__``, ``__index__``, ``numpy``, ``nonzero`` /
  ``argwhere`` / ``masked_select`` / ``unique`` (their output size is a value), ``equal`` /
  ``allclose`` / ``is_nonzero``, a boolean tensor as an index (``x[mask]``: a ``nonzero``),
  ``torch.where(condition)``, ``repeat_interleave`` with tensor repeats;
  a device tensor where a Scalar is expected (``torch.full(.., t)``, ``masked_fill(m, t)``,
  ``arange(t)``, ``alpha=t``), which the argument parser reads with ``item``;
* a copy between host and device that is not ``non_blocking``: ``.cpu()``, ``.to("cpu")``, and
  host data put on a device: ``torch.tensor`` / ``as_tensor`` / ``scalar_tensor`` of Python
  data (numbers, lists, arrays) with an explicit ``device`` (on CUDA that device is the GPU, and
  the factory copies the data from pageable memory with a synchronising ``cudaMemcpy``),
  ``.to(device)`` / ``.cuda()`` / ``copy_`` of a tensor made on the host (below).

The rule is on an explicit device, not on every tensor made from Python data: a factory
without a device makes a CPU tensor on CUDA as here, which is honest CPU-only code (the C++
loops of ``attention/cpu/native.py`` build their coefficient tensors so) and costs nothing while it
stays on the host. Such tensors are tracked ("host-born": made by a factory without a device,
or computed only from host-born tensors). Moving one to a device is a copy (refused, unless
``non_blocking=True``: an asynchronous copy from pageable memory is staged by the driver and
does not wait for the device). With ``cuda_like=True`` (where the CPU-only paths are switched
off, so every tensor would be on the GPU) a host-born tensor of one or more dimensions that
meets a device tensor in an op is refused too: on CUDA that op fails ("expected all tensors to
be on the same device"). A 0-dim host-born tensor meeting a device tensor is allowed: CUDA's
element-wise kernels take a CPU scalar tensor as a kernel argument, without a copy.

A ``TorchFunctionMode`` sees every torch call made from Python, the ``forward`` and
``backward`` of a custom ``autograd.Function`` included when the backward is run through
`backward` below (``Tensor.backward`` and ``torch.autograd.grad`` are themselves torch functions:
the mode is popped while they run, and would see nothing of the backward). It does not see what
ATen does inside one op (an ``.item()`` in C++), nor the ops autograd's engine runs for built-in
functions (those are C++ kernels: no Python, no host read). Triton's interpreter (``pause``)
copies tensors to NumPy and back on every launch: on a GPU a launch copies nothing.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor


class HostSyncError(AssertionError):
    """A call that would synchronise a CUDA host with its device."""


_READS = {
    Tensor.item: "Tensor.item",
    Tensor.tolist: "Tensor.tolist",
    Tensor.__bool__: "bool(tensor) (an `if` or `max` on a tensor)",
    Tensor.__float__: "float(tensor)",
    Tensor.__int__: "int(tensor)",
    Tensor.__index__: "a tensor used as a Python index",
    Tensor.numpy: "Tensor.numpy",
    Tensor.nonzero: "Tensor.nonzero",
    torch.nonzero: "torch.nonzero",
    Tensor.argwhere: "Tensor.argwhere",
    torch.argwhere: "torch.argwhere",
    Tensor.masked_select: "Tensor.masked_select",
    torch.masked_select: "torch.masked_select",
    Tensor.unique: "Tensor.unique",
    torch.unique: "torch.unique",
    torch.unique_consecutive: "torch.unique_consecutive",
    torch.equal: "torch.equal",
    Tensor.equal: "Tensor.equal",
    torch.allclose: "torch.allclose",
    Tensor.allclose: "Tensor.allclose",
    torch.is_nonzero: "torch.is_nonzero",
    Tensor.is_nonzero: "Tensor.is_nonzero",
    torch.bincount: "torch.bincount",
    Tensor.cpu: "Tensor.cpu (a device-to-host copy)",
}
#: Python data to a tensor
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.scalar_tensor}
#: factories without tensor inputs: host-born without a device
_FACTORIES = _FROM_DATA | {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}
#: where a Scalar argument given a tensor is read on the host: {function: argument names}
_SCALAR_ARGS = {
    torch.full: ("fill_value",),
    Tensor.new_full: ("fill_value",),
    torch.full_like: ("fill_value",),
    torch.arange: ("start", "end", "step"),
    torch.linspace: ("start", "end"),
    Tensor.masked_fill: ("value",),
    Tensor.masked_fill_: ("value",),
    torch.masked_fill: ("value",),
    torch.add: ("alpha",),
    Tensor.add: ("alpha",),
    Tensor.add_: ("alpha",),
    torch.sub: ("alpha",),
    Tensor.sub: ("alpha",),
    Tensor.sub_: ("alpha",),
}
#: positional index of those arguments (after self for methods)
_SCALAR_POS = {
    torch.full: (1,),
    Tensor.new_full: (2,),
    torch.full_like: (1,),
    torch.arange: (0, 1, 2),
    torch.linspace: (0, 1),
    Tensor.masked_fill: (2,),
    Tensor.masked_fill_: (2,),
    torch.masked_fill: (2,),
}
_MOVES = {Tensor.to, Tensor.cuda, Tensor.copy_}


def _where() -> str:
    """The innermost library line of the current stack (file:line), else the caller's."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if f"{os.sep}sharpattn{os.sep}" in f.filename:
            return f"{f.filename.split(os.sep + 'sharpattn' + os.sep)[-1]}:{f.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _tensors(x):
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _device_of_to(args, kwargs):
    """The device a ``Tensor.to`` call names (a string, a torch.device, an int, a tensor's), or
    None."""
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return torch.device(a)
        if isinstance(a, Tensor):
            return a.device
    return None


class NoHostSync(TorchFunctionMode):
    """Raise `HostSyncError` on what would synchronise a CUDA host (see the module docstring).
    ``cuda_like``: also refuse host-born tensors of one or more dimensions meeting device
    tensors. `pause` lets a block run unchecked (Triton's interpreter)."""

    def __init__(self, cuda_like: bool = False):
        super().__init__()
        self.cuda_like = cuda_like
        self.paused = 0
        self._host: dict[int, Tensor] = {}  # id -> tensor (kept alive: ids stay unique)

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def _is_host(self, t: Tensor) -> bool:
        return self._host.get(id(t)) is t

    def _refuse(self, what: str):
        raise HostSyncError(f"{what}: a host synchronisation on CUDA, at {_where()}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        self._check(func, args, kwargs)
        out = func(*args, **kwargs)
        self._track(func, args, kwargs, out)
        return out

    def _check(self, func, args, kwargs):
        if func in _READS:
            self._refuse(_READS[func])
        name = getattr(func, "__name__", repr(func))
        if func in _FROM_DATA:
            data = args[0] if args else kwargs.get("data")
            if kwargs.get("device") is not None:
                if not isinstance(data, Tensor):
                    self._refuse(f"torch.{name} of Python data with device=")
                if self._is_host(data):
                    self._refuse(f"torch.{name} of a host tensor with device=")
            elif not isinstance(data, Tensor) and any(_tensors(data)):
                self._refuse(f"torch.{name} of a list of tensors (reads their values)")
        for pos in _SCALAR_POS.get(func, ()):
            if pos < len(args) and isinstance(args[pos], Tensor):
                self._refuse(f"a tensor as {name}'s Scalar argument (read with item)")
        for key in _SCALAR_ARGS.get(func, ()):
            if isinstance(kwargs.get(key), Tensor):
                self._refuse(f"a tensor as {name}'s {key} (read with item)")
        if func is torch.where and len(args) + len(kwargs) == 1:
            self._refuse("torch.where(condition) (a nonzero)")
        if func in (torch.repeat_interleave, Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, Tensor) or (
                len(args) == 1 and isinstance(args[0], Tensor) and func is torch.repeat_interleave
            ):
                self._refuse("repeat_interleave with tensor repeats (its output size is a value)")
        if func in (Tensor.__getitem__, Tensor.__setitem__) and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, Tensor) and i.dtype == torch.bool for i in index):
                self._refuse("a boolean tensor as an index (a nonzero)")
        if func is Tensor.to:
            target = args[1] if len(args) > 1 else kwargs.get("device", kwargs.get("other"))
            src, blocking = args[0], not kwargs.get("non_blocking")
            if isinstance(target, Tensor):
                to_host = self._is_host(target)
            elif isinstance(target, str) and target == "cpu":
                to_host = True
            else:
                to_host = None if _device_of_to(args, kwargs) is None else False
            if to_host and not self._is_host(src):
                self._refuse('Tensor.to("cpu") (a device-to-host copy)')
            if to_host is False and self._is_host(src) and blocking:
                self._refuse("Tensor.to(device) of a host tensor (a blocking copy)")
        if func is Tensor.cuda and self._is_host(args[0]) and not kwargs.get("non_blocking"):
            self._refuse("Tensor.cuda of a host tensor (a blocking copy)")
        if func is Tensor.copy_ and len(args) > 1 and isinstance(args[1], Tensor):
            dst, src = args[0], args[1]
            if self._is_host(src) and not self._is_host(dst) and not kwargs.get("non_blocking"):
                self._refuse("copy_ of a host tensor into a device tensor (a blocking copy)")
        if self.cuda_like and func not in _MOVES:
            ts = list(_tensors(args)) + list(_tensors(kwargs))
            host = [t for t in ts if self._is_host(t) and t.dim() > 0]
            if host and any(not self._is_host(t) for t in ts):
                shapes = ", ".join(str(tuple(t.shape)) for t in host)
                raise HostSyncError(
                    f"{name}: host tensor(s) {shapes} meet a device tensor (on CUDA: a device "
                    f"mismatch, or a copy), at {_where()}"
                )

    def _track(self, func, args, kwargs, out):
        outs = list(_tensors(out))
        if not outs:
            return
        if func in _FACTORIES:
            data = args[0] if args else kwargs.get("data")
            born = kwargs.get("device") is None and not (
                func in _FROM_DATA and isinstance(data, Tensor) and not self._is_host(data)
            )
        elif func is Tensor.cuda:
            born = False
        elif func is Tensor.to:
            target = args[1] if len(args) > 1 else kwargs.get("device", kwargs.get("other"))
            if isinstance(target, Tensor):
                born = self._is_host(target)
            elif isinstance(target, str) and target == "cpu":  # on the host on any device
                born = True
            elif _device_of_to(args, kwargs) is not None:  # q.device and the like: the device
                born = False
            else:  # a dtype only
                born = self._is_host(args[0])
        else:
            ins = list(_tensors(args)) + list(_tensors(kwargs))
            if "device" in kwargs and kwargs["device"] is not None:
                born = False
            else:
                born = bool(ins) and all(self._is_host(t) for t in ins)
        for t in outs:
            if born:
                self._host[id(t)] = t
            elif func is Tensor.to:  # on the CPU `.to(q.device)` may return the tensor itself
                self._host.pop(id(t), None)


def backward(loss: Tensor, inputs) -> tuple[Tensor | None, ...]:
    """d loss / d inputs through autograd's engine directly, so that an active `NoHostSync`
    sees the Python code of custom ``autograd.Function.backward``s (``Tensor.backward`` and
    ``torch.autograd.grad`` are torch functions: a mode is popped while they run)."""
    inputs = tuple(inputs)
    return torch.autograd.graph._engine_run_backward(
        (loss,), (torch.ones_like(loss),), False, False, inputs, True, False
    )
