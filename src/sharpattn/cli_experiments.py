"""``sharpattn reproduce NAME`` for every registered experiment, generated from the protocol
(`lab.protocol`): the profile flags from its profiles, one option per ``Config`` field
declared with ``option``, the shared ``--seed``, ``--threads``, ``--checkpoint-every``,
``--allow-dirty`` and ``--out``; then one body for all: configure, announce a long profile, run with progress, print
the headline table and name the files written.

A command is built when it is first used (its ``--help`` or a run), so listing the commands
imports no experiment."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from .cli_options import (
    MAX_FACTOR,
    MAX_LENGTH,
    MAX_NOISE,
    MAX_RANK,
    MAX_RATE,
    MAX_SEEDS,
    MAX_SETS,
    MAX_STEPS,
    SEED,
    Positive,
    ProgressRenderer,
    allow_dirty_option,
    announce,
    checkpoint_option,
    cluster_options,
    console,
    count,
    csv,
    names,
    out_option,
    pick_threads,
    print_markdown,
    profile_options,
    set_sizes,
    size_list,
    size_range,
    threads_option,
)
from .experiments.registry import REGISTRY
from .lab.protocol import Experiment, Result, describe_default, options_of

#: the bounds an option names (``option(..., maximum="steps")``): counts', then numbers'
BOUNDS = {
    "steps": MAX_STEPS,
    "sets": MAX_SETS,
    "seeds": MAX_SEEDS,
    "factor": MAX_FACTOR,
    "length": MAX_LENGTH,
    "rank": MAX_RANK,
    "rate": MAX_RATE,
    "noise": MAX_NOISE,
}


#: the comma-separated kinds and their parsers (``floats``: `numbers`, for its bound)
PARSERS = {"names": names, "sizes": size_list, "size_range": size_range, "set_sizes": set_sizes}


def numbers(maximum: float | None):
    """The parser of a ``floats`` option: comma-separated numbers x with 0 < x <= ``maximum``
    (None: any finite number)."""
    if maximum is None:
        return csv(float, lambda v: 0 < v < float("inf"), "finite numbers > 0")
    return csv(float, lambda v: 0 < v <= maximum, f"numbers x with 0 < x <= {maximum:g}")


def _with_default(help: str, value: Any) -> str:
    """``help`` with ``[default: X]`` before its final full stop."""
    text = f"[default: {describe_default(value)}]"
    return f"{help[:-1]} {text}." if help.endswith(".") else f"{help} {text}"


def _option(field, meta: dict[str, Any], profiled: set[str]):
    """The click option of one ``Config`` field."""
    name = meta["name"] or "--" + field.name.replace("_", "-")
    kind, help = meta["kind"], meta["help"]
    if kind == "argument":
        return click.argument(
            field.name,
            metavar=meta["metavar"] or field.name.upper(),
            type=click.Choice(list(meta["choices"])),
        )
    if kind == "plugins":
        return click.option(name, field.name, multiple=True, metavar=meta["metavar"], help=help)
    if kind == "seed":
        return click.option(
            name, field.name, type=SEED, default=field.default, show_default=True, help=help
        )
    if kind == "threads":
        return threads_option()
    if kind == "checkpoint":
        return checkpoint_option(field.default)
    # a profile may set it: None unless given, so the profile's value stands
    shown = meta["show_default"]
    if shown is None:
        shown = field.name not in profiled and kind != "flag"
    if shown:
        help = _with_default(help, field.default)
    settings: dict[str, Any] = {"default": None, "help": help, "metavar": meta["metavar"]}
    if kind == "flag":
        settings.update(is_flag=True)
    elif kind == "count":
        bound = meta["maximum"]
        settings.update(type=count(BOUNDS.get(bound, bound), minimum=meta["minimum"]))
    elif kind == "positive":
        settings.update(type=Positive(BOUNDS.get(meta["maximum"], meta["maximum"])))
    elif kind == "floats":
        settings.update(callback=numbers(BOUNDS.get(meta["maximum"], meta["maximum"])))
    elif kind == "choice":
        settings.update(type=click.Choice(list(meta["choices"])))
    elif kind == "file":
        settings.update(type=click.Path(dir_okay=False))
    elif kind == "folder":
        settings.update(type=click.Path(exists=True, file_okay=False))
    elif kind in PARSERS:
        settings.update(callback=PARSERS[kind])
    return click.option(name, field.name, **settings)


def closing(result: Result) -> str:
    """A run's last line: its own, or the files it wrote ("wrote RUN/a, b and c")."""
    if result.closing:
        return result.closing
    files = list(result.files) or ["report.md"]
    named = ", ".join(files[:-1]) + (" and " if len(files) > 1 else "") + files[-1]
    return f"wrote {result.folder}/{named}"


def _profiles(exp: Experiment):
    """``--quick``, ``--paper`` and any profile between them, as `profile_options` makes them
    (none where the experiment has no profiles)."""
    if not exp.profiles:
        return lambda f: f
    named = dict(exp.profiles)
    middle = {n: what for n, what in named.items() if n not in ("quick", "paper")}
    return profile_options(exp.command, named["quick"], named["paper"], more=middle)


def build(exp: Experiment) -> click.Command:
    """The command of ``exp``, built from its module's Config and profiles."""
    module = exp.load()
    profiled = {k for settings in getattr(module, "PROFILES", {}).values() for k in settings}

    def body(out: str | None, profile: str = "quick", list_: bool = False, **given: Any) -> None:
        # the options the user gave (on the line or in the environment): the others leave the
        # profile's settings, or those of the run a plug-in joins, as they are
        ctx = click.get_current_context()
        default = click.core.ParameterSource.DEFAULT
        given = {k: v for k, v in given.items() if ctx.get_parameter_source(k) != default}
        allow_dirty = given.pop("allow_dirty", False)
        check = getattr(module, "check", None)
        if check is not None:
            try:
                check(given)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
        pool = given.pop("ray_address", None)
        threads = given.pop("threads", None) if has_threads else False  # False: no --threads
        configure = getattr(module, "configure", None) or module.make_config
        if exp.joins:
            given["out"] = out or module.default_folder(None, profile)
        config = configure(profile, **given)
        if list_:
            _print_catalogue(module.catalogue(config))
            return
        early = getattr(module, "early", None)
        answer = early(config, given) if early is not None else None
        if answer is not None:  # what the options asked for is a printout, not a run
            print_markdown(answer, None)
            return
        from .lab.runner import require_committed

        # a report names the code that wrote it; a quick run (a demo, a smoke test) is not
        # refused, and its report says so all the same
        require_committed(allow_dirty or profile == "quick")
        check_memory = getattr(module, "check_memory", None)
        if check_memory is not None:  # before anything is built or said
            check_memory(config, pool)
        progress = ProgressRenderer(transient=exp.transient)
        if threads is not False:  # the cores free now, or one per worker process
            workers = getattr(config, "workers", None)
            picked = pick_threads(threads, workers, pool, say=progress.before_work)
            with_threads = getattr(module, "with_threads", None)
            config = (
                with_threads(config, picked)
                if with_threads
                else dataclasses.replace(config, threads=picked)
            )
        folder = out or module.default_folder(config, profile)
        if hasattr(module, "prepare"):
            config, note = module.prepare(config, folder, given)
            if note:  # what was chosen, said as the work starts: a refusal comes alone
                progress.before_work(note)
        cost, jobs, changed = module.plan(config, profile)
        announce(cost, profile, jobs, changed)
        with progress:
            result = module.run_experiment(folder, config, progress, pool)
        for name, title in result.tables:
            print_markdown((result.folder / name).read_text(encoding="utf-8"), title)
        for markdown, title in result.printed:
            print_markdown(markdown, title)
        console.print(closing(result), markup=False, highlight=False)
        if result.error:
            raise ValueError(result.error)

    has_threads = any(meta["kind"] == "threads" for _, meta in options_of(module))
    listing = click.option(
        "--list",
        "list_",
        is_flag=True,
        help="Print the command's tasks (sizes as configured) and methods, then exit.",
    )
    decorators = [
        _profiles(exp),
        *([listing] if exp.lists else []),
        *(_option(f, meta, profiled) for f, meta in options_of(module)),
        *([cluster_options] if exp.pool else []),
        allow_dirty_option(),
        out_option(exp.out_default, exp.out_help),
    ]
    for decorate in reversed(decorators):
        body = decorate(body)
    return click.command(exp.name, help=exp.help, short_help=exp.short_help)(body)


def _print_catalogue(catalogue: dict[str, Any]) -> None:
    """``--list``: the tasks (* = run by the command as given) and the methods."""
    table = Table(title="tasks (* = run as given)")
    for col in ("task", "trained at", "evaluated at", "what"):
        table.add_column(col)
    for r in catalogue["tasks"]:
        lo, hi = r["train_sizes"]
        sizes = ", ".join(map(str, r["eval_sizes"]))
        star = "*" if r["chosen"] else " "
        table.add_row(f"{star} {r['task']}", f"{lo}-{hi}", sizes, escape(r["about"]))
    console.print(table)
    names = [("*" if m["chosen"] else "") + m["method"] for m in catalogue["methods"]]
    console.print("methods (* = run as given): " + ", ".join(names), markup=False)


class ExperimentCommand(click.Command):
    """A registered experiment's command, built (`build`) the first time its options or its
    body are needed: listing the commands and their one-line help imports nothing."""

    def __init__(self, exp: Experiment):
        self._exp, self._built = exp, None
        super().__init__(exp.name, help=exp.help, short_help=exp.short_help)

    def _real(self) -> click.Command:
        if self._built is None:
            self._built = build(self._exp)
        return self._built

    @property
    def params(self):  # noqa: D102
        return self._real().params

    @params.setter
    def params(self, value) -> None:  # click.Command.__init__ sets [] before anything is built
        pass

    @property
    def callback(self):  # noqa: D102
        return self._real().callback

    @callback.setter
    def callback(self, value) -> None:
        pass


def add_experiments(group: click.Group, top_level: bool = False) -> None:
    """Every registered experiment as a command of ``group``: ``reproduce``'s, or with
    ``top_level`` those that are commands of their own."""
    for exp in REGISTRY.values():
        if exp.top_level == top_level:
            group.add_command(ExperimentCommand(exp))
