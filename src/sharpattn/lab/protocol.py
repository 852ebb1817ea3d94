"""The experiment protocol: what a reproduction is to the runner and to the command line.

An experiment is a registered `Experiment`: a name (its command, ``sharpattn reproduce NAME``), a
``Config`` dataclass, its profiles as data, and ``run(folder, config, progress, pool)`` returning
a `Result`. The command line is generated from it (``cli_experiments``): every ``Config`` field
declared with `option` is an option of the command, named after the field (``lora_lr`` →
``--lora-lr``), its help text written beside the field, its default the field's unless a profile
sets it. Adding a reproduction is one module (its Config, profiles and ``run``) plus one
line in `sharpattn.experiments.registry`.

The protocol holds data only (no click): the command-line layer reads it.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Experiment",
    "Result",
    "REGISTRY",
    "describe_default",
    "experiment",
    "option",
    "options_of",
]

#: the kinds of option values the command line knows (`option`'s ``kind``)
KINDS = (
    "text",
    "count",
    "positive",
    "seed",
    "flag",
    "choice",
    "threads",
    "checkpoint",
    "names",
    "sizes",
    "size_range",
    "floats",
    "file",
    "set_sizes",
    "folder",
    "argument",
    "plugins",
)


def option(
    default: Any,
    help: str,
    *,
    kind: str | None = None,
    maximum: int | float | str | None = None,
    minimum: int = 1,
    choices: tuple[str, ...] = (),
    metavar: str | None = None,
    name: str | None = None,
    show_default: bool | None = None,
) -> Any:
    """A ``Config`` (or ``Options``) field that is an option of the experiment's command.

    ``help``: what the option does, as ``--help`` prints it; ``[default: X]`` is added where no
    profile sets the field, unless ``show_default`` says otherwise. ``kind``: how the command
    line reads the value (one of `KINDS`; from the default's type where not given: ``bool`` a
    flag, ``int`` a count, ``float`` a positive number, ``str`` text):

    - ``count`` (an integer from ``minimum`` to ``maximum``, a number or the name of one of the
      command line's bounds: "steps", "sets", "seeds", "factor", "length", "rank"), ``positive``
      (a finite number > 0, at most ``maximum``: a number or "rate", the bound of learning
      rates, or "noise", that of noise levels), ``text``, ``flag``, ``choice`` (one of
      ``choices``), ``seed``;
    - comma-separated ``names``, ``sizes`` (``N,N,...``), ``size_range`` (``LO,HI``),
      ``floats`` (finite numbers > 0, each at most ``maximum`` as for ``positive``),
      ``set_sizes`` (sizes from 2 to 2**31 - 1);
    - ``file`` (a file's path), ``folder`` (an existing folder), ``plugins`` (repeatable);
    - ``argument``: the command's positional argument, one of ``choices``;
    - ``threads`` and ``checkpoint``: the shared ``--threads`` and ``--checkpoint-every``.

    ``name``: the option's name where it is not the field's (``--models-from``)."""
    if kind is None:
        kind = {bool: "flag", int: "count", float: "positive", str: "text"}[type(default)]
    if kind not in KINDS:
        raise ValueError(f"unknown option kind {kind!r}; known: {', '.join(KINDS)}.")
    meta = {
        "help": help,
        "kind": kind,
        "maximum": maximum,
        "minimum": minimum,
        "choices": tuple(choices),
        "metavar": metavar,
        "name": name,
        "show_default": show_default,
    }
    return field(default=default, metadata={"option": meta})


def options_of(module: Any) -> list[tuple[dataclasses.Field, dict[str, Any]]]:
    """The fields of an experiment module's ``Options`` (else ``Config``) declared with
    `option`, in their order, each with its option's settings."""
    config = getattr(module, "Options", None) or module.Config
    return [(f, f.metadata["option"]) for f in dataclasses.fields(config) if "option" in f.metadata]


def describe_default(value: Any) -> str:
    """A default as ``--help`` shows it: ``1e-3`` rather than ``0.001``, ``qv``, ``256``."""
    if isinstance(value, float) and 0 < abs(value) < 0.1:
        exponent = math.floor(math.log10(abs(value)))
        mantissa = value / 10**exponent
        if abs(mantissa - round(mantissa)) < 1e-9:
            return f"{round(mantissa)}e{exponent}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Result:
    """What a run produced: its folder, the tables the command prints (markdown files of the
    folder, each with a title or None), the files the command names as written, and its
    metrics. ``closing``: the command's last line, where it says more than the files written."""

    folder: Path
    tables: tuple[tuple[str, str | None], ...]
    files: tuple[str, ...] = ()
    summary: dict[str, Any] = field(default_factory=dict)
    closing: str | None = None
    #: markdown printed after the tables, each with a title or None (findings no file holds)
    printed: tuple[tuple[str, str | None], ...] = ()
    #: where part of the run failed: one sentence, raised after the rest is printed
    error: str | None = None


@dataclass(frozen=True)
class Experiment:
    """A reproduction as the runner and the command line see it.

    ``module`` is imported only when the experiment is configured or run, so listing the
    commands stays fast. It provides:

    - ``Config`` (a dataclass), or ``Options`` where the run's configuration is nested: the
      dataclass whose `option` fields are the command's options;
    - ``PROFILES`` (profile name → settings) and ``make_config(profile, **options)`` (the
      options the user gave), or ``configure(profile, **options)`` where the run takes another
      object than a Config (then ``with_threads(config, n)`` sets its processes' threads);
    - ``plan(config, profile) -> (cost, jobs, changed)``: the key of ``cli_options.COSTS``, the
      work a long profile announces, and whether the options changed the profile's work;
    - ``default_folder(config, profile)`` and ``run_experiment(folder, config, progress, pool)
      -> Result`` (``pool``: a Ray address, or None);
    - optionally ``check(given)`` (refuses a combination of options in one sentence before any
      work), ``check_memory(config, pool)`` (refuses in one sentence, before any model is built,
      a run whose estimated memory is more than is available: `lab.memory`),
      ``prepare(config, folder, given) -> (config, note)`` (settings that depend on the run
      folder, and a line saying what was chosen), ``catalogue(config)`` (``--list``) and
      ``early(config, given) -> str | None`` (markdown the command prints instead of running,
      where the options ask for a printout: ``leaderboard --plan-from``)."""

    name: str
    module: str
    short_help: str
    help: str
    #: profile name → what it runs (its measured cost is added from ``COSTS``), in the order
    #: of the flags; the first is the default (none: the command has no profile flags)
    profiles: tuple[tuple[str, str], ...]
    #: ``--out``'s help: the default folder and that re-running resumes it
    out_help: str = "Run folder; re-running resumes it."
    #: ``--out``'s default where it does not depend on the profile (shown in ``--help``)
    out_default: str | None = None
    #: the jobs may run on worker processes or Ray (``--workers``, ``--ray``: the ``pool``)
    pool: bool = False
    #: progress bars removed when the run ends (the long sweeps keep theirs)
    transient: bool = True
    #: ``--list`` prints the module's ``catalogue(config)`` (tasks and methods) and runs nothing
    lists: bool = False
    #: a command of its own (``sharpattn NAME``), not of ``reproduce``
    top_level: bool = False
    #: ``configure`` is given the run folder (``out``): a run may join an existing one
    joins: bool = False

    def load(self) -> Any:
        return importlib.import_module(self.module)

    @property
    def command(self) -> str:
        return self.name if self.top_level else f"reproduce {self.name}"


#: every experiment that the protocol runs, by command name
REGISTRY: dict[str, Experiment] = {}


def experiment(exp: Experiment) -> Experiment:
    """Register ``exp`` (one line per reproduction)."""
    if exp.name in REGISTRY:
        raise ValueError(f"experiment {exp.name!r} is registered twice.")
    REGISTRY[exp.name] = exp
    return exp
