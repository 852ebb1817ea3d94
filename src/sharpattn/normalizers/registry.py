"""The registry of normalizers: one entry per method, with what a user needs to pick one."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from dataclasses import replace as replace_field
from typing import Any

import torch

from . import families
from ._contract import normalizer as contract_guard

KINDS = ("real", "int", "bool", "choice", "any")


@dataclass(frozen=True)
class Param:
    """A parameter of a normalizer, and the values it accepts.

    ``learnable`` parameters become per-head ``nn.Parameter``s of shape ``[num_heads]`` in
    [`sharpattn.attention.MultiheadAttention`][sharpattn.attention.MultiheadAttention] (initialised to ``default``), and reach the
    normalizer as tensors broadcastable to the scores (``[1, H, 1, 1]``).

    What a value must be ([`check`][sharpattn.normalizers.registry.Param.check], the one validation every path applies: the registered
    function, [`attend`][sharpattn.attention.attend] before it picks a path, ``MultiheadAttention``
    and ``sharpattn.hf.apply`` when they are built):

    * ``kind``: ``"real"`` (a number, never a bool), ``"int"``, ``"bool"`` (True or False),
      ``"choice"`` (one of ``choices``) or ``"any"`` (only ``validate``); None: ``"bool"`` for a bool
      default, ``"real"`` for a number, else ``"any"``.
    * ``low``/``high`` bound a number (``low_open``/``high_open`` exclude the bound itself);
      ``finite``: ±inf is refused (NaN always is).
    * ``tensor``: a tensor of such numbers is accepted too (always for ``learnable`` ones), one
      value per row of the scores: a shape ``[B|1, H|1, Lq|1, 1]`` (``[1, H, 1, 1]`` per head,
      ``[B, H, Lq, 1]`` per query; leading 1s may be left out), checked from the shapes alone
      wherever the call's sizes are known; its values are read (a host synchronisation) only
      when the caller checks values (``check_finite=True``). ``clamped``: the normalizer clamps
      a tensor into the range (a straight-through learnable parameter), so only a tensor's
      finiteness is checked.
    * ``optional``: None is accepted. ``validate``: a further validation of a value that is not a
      tensor (raises ``ValueError`` in one sentence), e.g. parsing a coefficient set.
    """

    name: str
    default: Any
    doc: str
    learnable: bool = False
    kind: str | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = True
    tensor: bool = False
    clamped: bool = False
    optional: bool = False
    choices: tuple = ()
    validate: Callable[[Any], Any] | None = None

    def __post_init__(self):
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(
                f"Param {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}."
            )

    @property
    def value_kind(self) -> str:
        """``kind``, or the one the default implies."""
        if self.kind is not None:
            return self.kind
        if isinstance(self.default, bool):
            return "bool"
        if _is_number(self.default):
            return "real"
        return "any"

    @property
    def accepts_tensor(self) -> bool:
        return (self.learnable or self.tensor) and self.value_kind == "real"

    def describe(self) -> str:
        """The accepted values in words (the end of the sentence "... must be <this>")."""
        kind = self.value_kind
        if kind == "bool":
            text = "True or False"
        elif kind == "choice":
            text = "one of " + ", ".join(map(repr, self.choices))
        elif kind == "any":
            text = self.doc
        else:
            noun = (
                "an integer" if kind == "int" else "a finite number" if self.finite else "a number"
            )
            text = noun + self._range()
            if self.accepts_tensor:
                text += (
                    " (or a tensor of finite numbers, clamped to that range)"
                    if self.clamped and self._range()
                    else " (or a tensor of them)"
                )
        return text + (" or None" if self.optional else "")

    def _range(self) -> str:
        lo, hi = self.low, self.high
        if lo is not None and hi is not None:
            return (
                f" in {'(' if self.low_open else '['}{lo:g}, {hi:g}{')' if self.high_open else ']'}"
            )
        if lo is not None:
            return f" {'>' if self.low_open else '>='} {lo:g}"
        if hi is not None:
            return f" {'<' if self.high_open else '<='} {hi:g}"
        return ""

    def check(
        self, value: Any, owner: str, *, check_values: bool = True, rows: tuple | None = None
    ) -> None:
        """Raise ``ValueError`` naming ``owner`` (e.g. the method) and this parameter unless
        ``value`` is accepted. A tensor's values are read only with ``check_values``; its type
        and dtype always are (no host synchronisation), and with ``rows`` (the call's
        ``(B, H, Lq)``, None for a size not known yet) its shape: one value per row of the
        scores, a shape that broadcasts to ``[B, H, Lq, 1]`` without growing it
        (``[B|1, H|1, Lq|1, 1]``, leading 1s optional: ``[1, H, 1, 1]`` per head)."""
        if value is None and self.optional:
            return
        kind = self.value_kind
        if kind == "any":
            if self.validate is not None:
                self.validate(value)
            return
        if torch.is_tensor(value):
            if not self.accepts_tensor or not value.is_floating_point():
                self._refuse(owner, value)
            if rows is not None:
                self._check_rows(value, owner, rows)
            if check_values:
                self._check_tensor_values(value, owner)
            return
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "choice":
            ok = isinstance(value, (str, int, float, type(None))) and value in self.choices
        elif kind == "int":
            ok = _is_integer(value) and self._in_range(value)
        else:
            # comparisons only (no math.isnan): a float torch.compile traces as a SymFloat
            ok = _is_number(value) and value == value and self._in_range(value)  # NaN != NaN
            ok = ok and (-math.inf < value < math.inf or not self.finite)
        if not ok:
            self._refuse(owner, value)
        if self.validate is not None:
            self.validate(value)

    def _check_rows(self, t: torch.Tensor, owner: str, rows: tuple) -> None:
        """Refuse a tensor that is not one value per row of ``rows`` = (B, H, Lq) (shapes only)."""
        want = (*rows, 1)
        shape = tuple(t.shape)
        ok = len(shape) <= len(want) and all(
            s == 1 or w is None or s == w
            for s, w in zip(reversed(shape), reversed(want), strict=False)
        )
        if ok:
            return
        sizes = ", ".join(
            f"{name}|1" if w is None else "1" if w == 1 else f"{w}|1"
            for name, w in zip(("B", "H", "Lq"), rows, strict=True)
        )
        raise ValueError(
            f"the {owner} parameter {self.name} takes one value per row of the scores, a tensor "
            f"of shape [B|1, H|1, Lq|1, 1] (here [{sizes}, 1]; [1, H, 1, 1] per head), got "
            f"shape {list(shape)}."
        )

    def _in_range(self, x) -> bool:
        if self.low is not None and not (x > self.low if self.low_open else x >= self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def _check_tensor_values(self, t: torch.Tensor, owner: str) -> None:
        t = t.detach()
        bad = torch.isnan(t)
        if self.finite:
            bad = bad | torch.isinf(t)
        if not self.clamped:
            if self.low is not None:
                bad = bad | ((t <= self.low) if self.low_open else (t < self.low))
            if self.high is not None:
                bad = bad | ((t >= self.high) if self.high_open else (t > self.high))
        if bool(bad.any()):  # a host synchronisation: only with check_values
            self._refuse(owner, t, float(t[bad][0]))

    def _refuse(self, owner: str, value: Any, bad_entry: float | None = None) -> None:
        if torch.is_tensor(value):
            got = (
                f"a tensor holding {bad_entry!r}"
                if bad_entry is not None
                else f"a {value.dtype} tensor"
            )
        else:
            got = repr(value)
            if len(got) > 60:
                got = f"{type(value).__name__} {got[:57]}..."
        raise ValueError(f"the {owner} parameter {self.name} must be {self.describe()}, got {got}.")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not torch.is_tensor(x)


def _is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and not torch.is_tensor(x)


#: ``check_finite``, which every normalizer (and `attend`) takes
CHECK_FINITE = Param(
    "check_finite", True, "reject NaN/+inf scores and bad tensor parameters", kind="bool"
)


#: the key position of the first query row, which a stick-breaking method takes
QUERY_OFFSET = Param(
    "query_offset",
    None,
    "key position of the first query row (default Lk − Lq)",
    kind="int",
    optional=True,
)


@dataclass(frozen=True)
class Normalizer:
    """A registry entry: the function and the facts about it."""

    name: str
    fn: Callable[..., Any]
    formula: str
    citation: str
    sums_to_one: bool
    params: tuple[Param, ...] = field(default_factory=tuple)
    #: the fast path (O(n) memory) that exists for it, by name: when it declares a family, the
    #: name of the kernel record the family holds (``family.kernel.name``) or else its path
    #: (``family.path``); else a built-in path of ``sharpattn.attention.dispatch.fast.FAST``
    fused: str | None = None
    #: learnable parameters that MultiheadAttention also makes a linear function of the query's
    #: input: p_{h,i} = p_h + w_h·x_i, per head h and query i (w initialised to 0)
    query_dependent: tuple[str, ...] = ()
    #: its maths in the form the fast paths need (`families`): a method that declares one
    #: gets that family's fast path, whoever registers it
    family: Any = None

    def __post_init__(self):
        if (
            isinstance(self.family, families.StickBreaking)
            and isinstance(self.params, tuple)
            and not any(getattr(p, "name", None) == "query_offset" for p in self.params)
        ):
            # the family's rows depend on the query's key position: every path that cuts the
            # queries into blocks passes it, so the entry takes it (as the built-in does)
            object.__setattr__(self, "params", (*self.params, QUERY_OFFSET))
        if self.family is not None and self.fused is None:
            # the built-in kernel the family names, else its family's path (validate() refuses
            # anything that is not a family)
            kernel = getattr(self.family, "kernel", None)
            path = getattr(kernel, "name", kernel) if kernel is not None else None
            path = path or getattr(self.family, "path", None)
            object.__setattr__(self, "fused", path if isinstance(path, str) else None)

    @property
    def learnable(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.learnable)

    def check_initial_values(self, params: Mapping[str, Any], owner: str, per: str) -> None:
        """Refuse (one sentence naming ``owner``) a tensor given for a learnable parameter where
        a module is built: there it is a number, the initial value ``per`` (e.g. "every head")."""
        for p in self.learnable:
            if torch.is_tensor(params.get(p.name)):
                raise ValueError(
                    f"the {self.name} parameter {p.name} of {owner} must be a number (its "
                    f"initial value for {per}), got a tensor."
                )

    @property
    def positional(self) -> bool:
        """Whether its rows depend on the query's key position (``query_offset``, as
        stick-breaking's): a path that cuts the queries into blocks tells each block where it
        starts."""
        return isinstance(self.family, families.StickBreaking) or any(
            p.name == "query_offset" for p in self.params
        )

    def check_params(
        self, params: Mapping[str, Any], *, check_values: bool = True, rows: tuple | None = None
    ) -> None:
        """Refuse (``ValueError``, one sentence naming the parameter and what it accepts) a name
        this method does not take or a value its [`Param`][sharpattn.normalizers.registry.Param] does not accept. Tensor values
        are read only with ``check_values`` (no host synchronisation otherwise). ``rows``: the
        ``(B, H, Lq)`` of the call (None where a size is not known yet, e.g. at construction):
        a tensor parameter must then be one value per row, ``[B|1, H|1, Lq|1, 1]``
        (`Param.check`); its shape is read, never its values."""
        specs = {p.name: p for p in self.params}
        specs.setdefault(CHECK_FINITE.name, CHECK_FINITE)
        unknown = sorted(set(params) - set(specs))
        if unknown:
            raise ValueError(
                f"method {self.name!r} has no parameter(s) {', '.join(unknown)}; its parameters: "
                f"{', '.join(sorted(specs))}."
            )
        for name, value in params.items():
            specs[name].check(value, self.name, check_values=check_values, rows=rows)

    def validate(self) -> None:
        """Refuse (``ValueError``, one sentence naming the method and the parameter at fault) an
        entry that could not work: a name that is not a string, a function that is not callable,
        parameters that are not [`Param`][sharpattn.normalizers.registry.Param] entries or share a name, a default its own ``Param``
        does not accept (type, finiteness, range, choices), a learnable parameter that is not a
        real number with a number as its default (its per-head starting value), a
        ``query_dependent`` name that is not a learnable parameter, or a ``fused`` that is not a
        name. [`register`][sharpattn.normalizers.registry.register] runs it, so every registered entry has passed it. Whether
        ``fused`` names an existing fast path is checked by ``attend``, which holds them."""
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a normalizer's name must be a non-empty string, got {self.name!r}.")
        what = f"method {self.name!r}"
        if not callable(self.fn):
            raise ValueError(f"{what}: fn must be a function, got {_short(self.fn)}.")
        if not isinstance(self.params, (tuple, list)) or not all(
            isinstance(p, Param) for p in self.params
        ):
            raise ValueError(f"{what}: params must be a tuple of Param, got {_short(self.params)}.")
        seen: set[str] = set()
        for p in self.params:
            if not isinstance(p.name, str) or not p.name.isidentifier():
                raise ValueError(
                    f"{what}: a parameter's name must be an identifier, got {p.name!r}."
                )
            if p.name in seen:
                raise ValueError(f"{what} has two parameters named {p.name!r}; names must differ.")
            seen.add(p.name)
            self._validate_default(p)
        dependent = self.query_dependent
        if isinstance(dependent, str) or not isinstance(dependent, (tuple, list)):
            raise ValueError(
                f"{what}: query_dependent must be a tuple of parameter names, got {dependent!r}."
            )
        learnable = [p.name for p in self.learnable]
        for name in dependent:
            if name not in learnable:
                raise ValueError(
                    f"{what}: query_dependent names {name!r}, which is not one of its learnable "
                    f"parameters ({', '.join(learnable) or 'it has none'})."
                )
        if self.fused is not None and (not isinstance(self.fused, str) or not self.fused):
            raise ValueError(
                f"{what}: fused must be None or a fast path's name, got {self.fused!r}."
            )
        if self.family is not None:
            families.check(self.family, self.name, tuple(seen), tuple(learnable))

    def _validate_default(self, p: Param) -> None:
        what = f"method {self.name!r}"
        if torch.is_tensor(p.default):
            raise ValueError(
                f"{what}: parameter {p.name} has a tensor as its default; give a plain value."
            )
        if p.learnable and (p.value_kind != "real" or not _is_number(p.default)):
            got = (
                f"kind {p.kind!r}"
                if p.kind not in (None, "real")
                else f"default {_short(p.default)}"
            )
            raise ValueError(
                f"{what}: learnable parameter {p.name} must be a real number with a number as its "
                f"default (its per-head starting value; gradients train only real numbers), got "
                f"{got}."
            )
        try:
            p.check(p.default, self.name)
        except Exception as err:  # a user's `validate` may raise anything
            if p.value_kind == "any":
                raise ValueError(
                    f"{what}: parameter {p.name} has default {_short(p.default)}, which its "
                    f"validate refuses ({type(err).__name__}: {_first_line(err)})."
                ) from None
            raise ValueError(
                f"{what}: parameter {p.name} has default {_short(p.default)}, which it does not "
                f"accept: it must be {replace_field(p, learnable=False, tensor=False).describe()}."
            ) from None

    def __call__(self, scores, mask=None, **params):
        return self.fn(scores, mask, **params)


def _short(value: Any) -> str:
    """``repr(value)``, shortened to about 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} {text[:57]}..."


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0].rstrip(".") if lines else ""


_REGISTRY: dict[str, Normalizer] = {}


def register(entry: Normalizer, *, replace: bool = False) -> Normalizer:
    """Add ``entry`` to the registry (``replace=True`` to overwrite an existing name).

    The entry is checked first ([`Normalizer.validate`][sharpattn.normalizers.registry.Normalizer.validate]: a bad one is refused in one
    sentence). The registered ``fn`` is ``entry.fn`` behind the contract's guards (empty input) and the
    validation of its parameters ([`Normalizer.check_params`][sharpattn.normalizers.registry.Normalizer.check_params], tensor values only with
    ``check_finite``): every call through the registry refuses a bad parameter by name.
    """
    entry.validate()
    if entry.name in _REGISTRY and not replace:
        raise ValueError(f"a normalizer named {entry.name!r} is already registered.")
    guarded = contract_guard(entry.fn)  # the contract's guards (empty input), for every method
    # a family's hooks take every parameter: the defaults of those a call leaves out
    defaults = {p.name: p.default for p in entry.params} if entry.family is not None else {}

    @functools.wraps(guarded)
    def checked(scores, mask=None, *args, **params):
        entry.check_params(params, check_values=params.get("check_finite", True) is not False)
        return guarded(scores, mask, *args, **{**defaults, **params})

    entry = replace_field(entry, fn=checked)
    _REGISTRY[entry.name] = entry
    return entry


#: sharpattn's own methods, as its modules registered them (`freeze_built_ins`)
_BUILT_IN: dict[str, Normalizer] = {}


def freeze_built_ins() -> None:
    """Record the methods registered so far as sharpattn's own: ``sharpattn.normalizers`` calls
    it once its modules have registered theirs, before any user's."""
    _BUILT_IN.update(_REGISTRY)


def is_built_in(entry: Normalizer) -> bool:
    """Whether ``entry`` is one of sharpattn's own methods, not a user's (a plug-in, a
    registered or passed `Normalizer`, a built-in name registered again with ``replace=True``):
    what a message may say about where a NaN came from."""
    return _BUILT_IN.get(entry.name) is entry


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (for user-registered methods, e.g. in tests)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Normalizer:
    """The registry entry called ``name``; unknown names raise ``ValueError`` listing the known."""
    if isinstance(name, Normalizer):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention method {name!r}; known methods: {', '.join(available())}."
        ) from None


def available() -> list[str]:
    """Names of every registered normalizer, in registration order."""
    return list(_REGISTRY)


def fast_path(entry: Normalizer) -> str:
    """An entry's fast path in words: its family (and the built-in kernel it names), else the
    name of its path, else "—"."""
    family = entry.family
    if family is None:
        return entry.fused or "—"
    kernel = getattr(family, "kernel", None)
    return f"{type(family).__name__} family" + (f", {kernel.name} kernel" if kernel else "")


def markdown_table(names: list[str] | None = None) -> str:
    """The registry as a Markdown table (docs/normalizers.md's, printed by ``sharpattn list
    --markdown``): name, formula, rows sum to one, learnable parameters (per head), fast path
    (`fast_path`), source."""

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|")

    lines = [
        "| name | formula | rows sum to 1 | learnable (per head) | fast path | source |",
        "|---|---|---|---|---|---|",
    ]
    for name in available() if names is None else names:
        e = get(name)
        learnable = ", ".join(f"`{p.name}` = {p.default}" for p in e.learnable) or "—"
        lines.append(
            f"| `{e.name}` | {cell(e.formula)} | {'yes' if e.sums_to_one else 'no'} | "
            f"{learnable} | {cell(fast_path(e))} | {cell(e.citation)} |"
        )
    return "\n".join(lines)
