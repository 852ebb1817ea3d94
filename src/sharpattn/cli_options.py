"""What every `sharpattn` command shares: option decorators and the one progress renderer.

Each command is a few lines: its own options, the shared ones below, a configuration built from
them, a call into ``experiments``, its result printed as the report kit wrote it
(`print_markdown`). Progress reaches the user through
`ProgressRenderer`, which draws the runner's events (``lab.runner.event``): on a
terminal one bar per task, advancing with ``step``/``total``, showing ``phase``, the latest
``loss`` and the time left; elsewhere (a log file, a pipe) plain lines every ten seconds.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

# Wide enough for the tables when output is not a terminal (pipes, CI logs).
console = Console(width=shutil.get_terminal_size((140, 24)).columns)


def print_markdown(markdown: str, title: str | None = None) -> None:
    """A result as the report kit wrote it (``report.markdown_table``, or a run's ``.md`` file):
    ``title`` in bold, then the markdown as it is (never read as markup, never wrapped: a
    wrapped table row is no longer a row), then a blank line."""
    literal = dict(markup=False, highlight=False, emoji=False, soft_wrap=True)
    if title:
        console.print(title, style="bold", **literal)
    console.print(markdown.rstrip("\n") + "\n", **literal)


class _SeedRange(click.IntRange):
    """0 ≤ seed < 2^63, shown in ``--help`` as that rather than as nineteen digits."""

    def _describe_range(self) -> str:
        return "0<=x<2**63"


#: seeds reach torch and NumPy as unsigned 64-bit integers; 2**63 - 1 keeps every offset valid
SEED = _SeedRange(0, 2**63 - 1)

#: The upper bounds of the commands' counts, each far above every profile's value and low enough
#: that a slip of the keyboard (``--steps 10**30``) is refused at once rather than started as
#: work that never ends; click prints each range in ``--help``. Memory, which also depends on
#: sizes, is checked by the experiments themselves before any work (``runs.check_memory``, with
#: ``lab.memory``'s estimates of models and batches).
MAX_STEPS = 10_000_000  # training steps (the longest profile: 100,000)
MAX_SETS = 1_000_000  # test sets, fitting sets, pairs, prompts, held-out windows
MAX_SEEDS = 10_000
MAX_FACTOR = 1_024  # evaluation sizes as a multiple of the training sizes (profiles: 8-64)
MAX_LENGTH = 1_048_576  # tokens in one window
MAX_ITEMS = 4_096  # items in one probe sequence
MAX_RANK = 1_024  # rank of low-rank adapters (the profiles: 8)
#: learning rates: the profiles' are 1e-4 to 3e-2 (Adam, AdamW), the Bigram-Backcopy SGD
#: study's up to 0.3; 10 leaves room for any experiment and refuses a slip of the keyboard
#: (``1e30``, whose first step overflows the weights)
MAX_RATE = 10.0
#: noise levels σ of the denoising task, whose signal is a unit vector (the profiles: 0.05-0.5);
#: at 100 the signal is lost in the noise, and larger values only overflow
MAX_NOISE = 100.0


def count(maximum: int, minimum: int = 1) -> click.IntRange:
    """The type of a count option: an integer from ``minimum`` to ``maximum`` (one of the bounds
    above); anything else is refused with one sentence before any work."""
    return click.IntRange(min=minimum, max=maximum)


class Positive(click.FloatRange):
    """The type of a number option: a finite number x with 0 < x <= ``maximum`` (None: any finite
    number); NaN and the infinities (``inf``, and ``1e400``, which Python reads as inf) are
    refused with one sentence before any work, as is anything above ``maximum``."""

    def __init__(self, maximum: float | None = None):
        super().__init__(min=0, max=maximum, min_open=True)

    def convert(self, value, param, ctx):  # noqa: D102
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number.", param, ctx)
        return number

    def _describe_range(self) -> str:
        return "x>0, finite" if self.max is None else f"0<x<={self.max:g}"


def compose(*decorators):
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


def out_option(default: str | None, what: str = "Run folder to write; re-running resumes it."):
    """``--out``: the run folder (``default`` None: the command picks one from its profile)."""
    return click.option(
        "--out",
        type=click.Path(file_okay=False),
        default=default,
        show_default=default is not None,
        help=what,
    )


def checkpoint_option(default: int):
    """``--checkpoint-every``: training steps between checkpoints (``default`` per command)."""
    return click.option(
        "--checkpoint-every",
        type=count(MAX_STEPS),
        default=default,
        show_default=True,
        help="Steps between checkpoints; re-running the command resumes from the last one.",
    )


def seed_option(help: str = "Seed (the first seed where there are several)."):
    return click.option("--seed", type=SEED, default=0, show_default=True, help=help)


def seeds_option(help: str = "Number of seeds (overrides the profile)."):
    return click.option("--seeds", type=count(MAX_SEEDS), default=None, help=help)


#: the environment variable that sets ``--threads``'s default (the test suite sets it to 1)
THREADS_ENV = "SHARPATTN_THREADS"


def threads_option(what: str = "torch CPU threads per process"):
    """``--threads``: the same default for every command, the cores free now
    (`runner.free_cores`: the cores minus the 1-minute load average), one per process where the
    jobs run on worker processes (``--workers``, ``--ray``); ``$SHARPATTN_THREADS`` sets it. The
    option's value is None when nobody chose: the command calls `pick_threads` with its workers,
    which picks and says what it picked. On 2 cores shared with other work, processes of one
    thread ran fastest (70 steps/s against 6 with a thread per core); on an idle machine a thread
    per core roughly doubles the speed."""
    return click.option(
        "--threads",
        type=click.IntRange(min=1, max=1024),
        default=None,
        envvar=THREADS_ENV,
        show_envvar=True,
        help=f"{what[0].upper()}{what[1:]} [default: the cores free now, 1 per worker process "
        "with --workers or --ray].",
    )


#: the environment variable that sets ``--allow-dirty`` (the test suite sets it: its checkout is
#: the one being edited)
ALLOW_DIRTY_ENV = "SHARPATTN_ALLOW_DIRTY"


def allow_dirty_option():
    """``--allow-dirty``: run a report-writing command (but for its quick profile) from a git
    checkout with uncommitted changes (refused otherwise, `runner.require_committed`); the report's code line
    then says so."""
    return click.option(
        "--allow-dirty",
        is_flag=True,
        default=False,
        envvar=ALLOW_DIRTY_ENV,
        show_envvar=True,
        help="Run from a git checkout with uncommitted changes (refused otherwise, but for "
        "quick profiles); the report says so.",
    )


def pick_threads(
    threads: int | None,
    workers: int | None = None,
    ray: str | None = None,
    say: Callable[[str], None] | None = None,
) -> int:
    """The torch threads of a command's processes: ``threads`` where the user chose (``--threads``
    or ``$SHARPATTN_THREADS``), else 1 per worker process when the jobs run on several
    (``workers`` > 1 or Ray), else the cores free now; a picked value is said in one line on
    stderr, now or, given ``say`` (a `ProgressRenderer`'s ``before_work``), once the work
    starts, so that a command refused before any work prints its one sentence alone."""
    if threads is not None:
        return threads
    if ray is not None or (workers or 1) > 1:
        n, why = 1, "one per worker process"
    else:
        from .lab.runner import cores, free_cores

        n, load = free_cores()
        why = "every core" if load is None else f"{cores()} cores, load {load:.1f}"
        why = f"the free cores: {why}"
    line = f"sharpattn: {n} torch thread{'s' * (n > 1)} ({why}; --threads N to choose)."
    (say or _stderr)(line)
    return n


def _stderr(line: str) -> None:
    click.echo(line, err=True)


#: The measured cost of every command's profiles, the one place it is written: ``--help`` and
#: the line a long profile prints before it starts read it, and docs/cli.md's table shows it
#: (tests/experiments/test_cli.py checks that the two agree). Measured on 2-core AMD EPYC and
#: Intel Xeon CPUs (the leaderboard and CLRS paper profiles: the Intel one).
COSTS: dict[str, dict[str, str]] = {
    "reproduce max-retrieval": {"quick": "about a minute", "paper": "42 min 20 s wall"},
    "reproduce max-retrieval-regularisers": {
        "quick": "about 3 minutes",
        "paper": "1 h 45 min wall with --reuse (3 readings trained)",
    },
    "reproduce clrs": {
        "quick": "4 min 16 s wall",
        "paper": "≈ 2.9 CPU-hours, ≈ 1.5 h on 2 cores",
    },
    "reproduce selective": {
        "quick": "164 s of CPU",
        "paper": "not run as a whole (its LM alone ≈ 7 CPU-hours)",
    },
    "reproduce selective-llm": {"quick": "about 3 minutes", "paper": "19:35 wall, one thread"},
    "reproduce selective-llm --lora": {
        "quick": "2 min 49 s wall on a 2-core Intel Xeon",
        "paper": "8 min 22 s wall on a 2-core Intel Xeon",
    },
    "reproduce clrs-llm": {
        "quick": "4 min 12 s wall",
        "paper": "31 min 1 s wall on a 2-core Intel Xeon",
    },
    "reproduce backcopy": {
        "quick": "122 s of CPU",
        "medium": "3.2 CPU-hours",
        "paper": "≈ 430 CPU-hours, not run",
    },
    "leaderboard": {
        "quick": "8 min 58 s wall",
        "standard": "≈ 8 CPU-hours, ≈ 4 h on 2 cores",
        "power": "≈ 23 CPU-hours by its plan, not yet measured (≈ 12 h on 2 cores, in sittings)",
        "paper": "≈ 60 CPU-hours (30 h on 2 cores) at 32 test sequences a size, ≈ 380 at 256",
    },
    "llm": {"quick": "12.7 min wall", "full": "several hours, not run"},
}

#: the profiles that run for longer than about 30 minutes on 2 cores: named options only, and
#: announced (`announce`) before they start
LONG = ("medium", "standard", "power", "paper", "full")


def profile_help(command: str, profile: str, what: str) -> str:
    """The ``--help`` line of ``command``'s ``profile``: ``what`` it runs and its measured cost
    (from `COSTS`); the quick profile says it is the default."""
    default = "the default; " if profile == "quick" else ""
    return f"{what} ({default}{COSTS[command][profile]})."


def announce(command: str, profile: str, jobs: str, changed: bool = False) -> None:
    """Before a long profile starts: one line on stderr with the profile, its job count and its
    measured cost, so a long run is never started unawares. Nothing for the quick profile.
    ``changed``: options override the profile's settings, so its measured cost is the unchanged
    profile's, and the line says so."""
    if profile in LONG:
        whose = "the unchanged profile's measured cost" if changed else "measured cost"
        click.echo(
            f"sharpattn {command} --{profile}: {jobs}; {whose} {COSTS[command][profile]} "
            "(re-running the command resumes it).",
            err=True,
        )


def profile_options(
    command: str,
    quick: str,
    paper: str,
    medium: str | None = None,
    middle: str = "medium",
    more: dict[str, str] | None = None,
):
    """``--quick`` / ``--paper``: the command's two profiles, ``--quick`` the default (no
    command's default runs for hours); together they are refused. Each help is what the profile
    runs; its measured cost is added from `COSTS`. Adds ``profile`` ("quick" or "paper")
    to the command's keyword arguments instead of the flags. A command with an intermediate
    profile passes its help as ``medium`` and its name as ``middle`` ("medium", "standard"):
    ``--<middle>`` then gives ``profile=middle`` and excludes the other two as they exclude
    each other. ``more`` ({name: help}) adds further profiles the same way."""
    between = {**({middle: medium} if medium is not None else {}), **(more or {})}

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, quick: bool, paper: bool, **kwargs):
            on = {name: kwargs.pop(name, False) for name in between}
            flags = (("quick", quick), *on.items(), ("paper", paper))
            chosen = [n for n, flag in flags if flag]
            if len(chosen) > 1:
                flags = " and ".join(f"--{n}" for n in chosen)
                raise click.UsageError(f"{flags} exclude each other: choose one.")
            return f(*args, profile=chosen[0] if chosen else "quick", **kwargs)

        flags = [click.option("--quick", is_flag=True, help=profile_help(command, "quick", quick))]
        for name, what in between.items():
            flags.append(
                click.option(f"--{name}", is_flag=True, help=profile_help(command, name, what))
            )
        flags.append(
            click.option("--paper", is_flag=True, help=profile_help(command, "paper", paper))
        )
        return compose(*flags)(wrapper)

    return decorate


def cluster_options(f):
    """``--workers`` (local processes) and ``--ray`` (a Ray cluster) for sweeps. With ``--ray``
    the command connects to the cluster before it does anything else (a wrong address is
    refused before a run folder is written) and disconnects when it ends; ``--list`` runs
    nothing, so it does not connect. The two together are refused: Ray places the jobs on its
    own workers, so ``--workers`` would be ignored."""

    @functools.wraps(f)
    def connected(*args, ray_address: str | None = None, **kwargs):
        if ray_address is not None and kwargs.get("workers") is not None:
            raise click.UsageError(
                "--workers and --ray exclude each other: Ray runs the jobs on the cluster's "
                "workers; choose one."
            )
        if ray_address is None or kwargs.get("list_"):
            return f(*args, ray_address=ray_address, **kwargs)
        from .lab.ray_jobs import cluster

        with cluster(ray_address):
            return f(*args, ray_address=ray_address, **kwargs)

    return compose(
        click.option(
            "--workers",
            type=click.IntRange(min=1, max=1024),
            default=None,
            help="Jobs run in parallel local processes (default: the command's profile, else 1).",
        ),
        click.option(
            "--ray",
            "ray_address",
            default=None,
            metavar="auto|local|ADDRESS",
            help="Run the jobs as Ray tasks: 'auto' (a running cluster), 'local' or an address.",
        ),
    )(connected)


# --- comma-separated values -----------------------------------------------------------------


def items(value: str) -> list[str]:
    """The items of a comma-separated option, each stripped of surrounding spaces (a name may
    hold spaces inside: "adaptive (inference)"); empty items dropped."""
    return [x.strip() for x in value.split(",") if x.strip()]


def csv(convert, ok, what: str, empty=None):
    """A click callback: a comma-separated list, each item ``convert``ed and passing ``ok``."""

    def parse(ctx, param, value):
        if value is None:
            return empty
        try:
            parsed = [convert(x) for x in items(value)]
        except ValueError:
            parsed = []
        if not parsed or not all(ok(x) for x in parsed):
            raise click.BadParameter(f"expected comma-separated {what}, got {value!r}.")
        return parsed

    return parse


#: the largest size a command accepts before any work: one attention row of 2**31 keys
MAX_SIZE = 2**31 - 1
#: ``--sizes`` of the set and max-retrieval commands: sizes from 2 to `MAX_SIZE`
set_sizes = csv(int, lambda n: 2 <= n <= MAX_SIZE, f"integers from 2 to {MAX_SIZE:,}")


def names(ctx, param, value):
    """``A,B,...`` as a tuple of names, or None."""
    return None if value is None else tuple(items(value))


def size_list(ctx, param, value):
    """``N,N,...`` (whole numbers >= 1) as a tuple, or None."""
    if value is None:
        return None
    parts = items(value)
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise click.BadParameter(f"expected sizes >= 1 such as 10,12, got {value!r}.")
    return tuple(int(p) for p in parts)


def size_range(ctx, param, value):
    """``LO,HI`` (two whole numbers, 1 <= LO <= HI) as a tuple, or None."""
    if value is None:
        return None
    parts = items(value)
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise click.BadParameter(f"expected two sizes LO,HI such as 4,16, got {value!r}.")
    lo, hi = (int(p) for p in parts)
    if not 1 <= lo <= hi:
        raise click.BadParameter(f"expected 1 <= LO <= HI, got {lo},{hi}.")
    return lo, hi


def duration(seconds: float) -> str:
    """A duration as a person reads it: "45 s", "12 min 5 s", "3 h 20 min"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class _Pace:
    """One task's timing: when it started, at which step, and when it was last printed."""

    def __init__(self, now: float, step: int, total: int):
        self.t0, self.step0, self.last, self.total, self.phase = now, step, step, total, None
        self.printed, self.printed_step = now, None

    def left(self, now: float, step: int, total: int) -> str:
        """The time left at the pace so far (steps since this task was first seen)."""
        done, spent = step - self.step0, now - self.t0
        if step >= total:
            return "done"
        if done <= 0 or spent <= 0:
            return "time left not yet known"
        return f"about {duration((total - step) * spent / done)} left"


class ProgressRenderer:
    """Draws the runner's progress events: on a terminal as rich bars, one per ``task`` and
    kind (training or the rest), showing its ``phase``, ``step``/``total``, the latest ``loss``,
    the time elapsed and an estimate of the time left; otherwise (output redirected to a file or
    a pipe) as plain lines, ``task phase step/total, elapsed, time left``, at most one per task
    every ``every`` seconds, plus one whenever a task's phase changes and one when it finishes.
    Use as a context manager; the instance is the ``progress`` callable handed to experiments."""

    def __init__(
        self,
        transient: bool = False,
        every: float = 10.0,
        plain: bool | None = None,
        clock=time.monotonic,
    ):
        self.plain = not console.is_terminal if plain is None else plain
        self.every, self.clock = every, clock
        self.pending: list[str] = []  # lines for stderr when the work starts (`before_work`)
        self.paces: dict[tuple[str, str], _Pace] = {}
        self.tasks: dict[tuple[str, str], Any] = {}
        if self.plain:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[phase]}"),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=console,
            transient=transient,
        )

    def __enter__(self) -> ProgressRenderer:
        if not self.plain:
            self.bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.plain:
            self.bars.__exit__(*exc)

    def before_work(self, line: str) -> None:
        """Say ``line`` on stderr when the first event arrives: a run refused before any work
        (a bad option, too little memory) prints its one sentence alone."""
        self.pending.append(line)

    def __call__(self, ev: dict[str, Any]) -> None:
        while self.pending:
            click.echo(self.pending.pop(0), err=True)
        task, phase = str(ev.get("task", "")), str(ev.get("phase", ""))
        kind = "train" if phase == "train" else "work"  # a training bar and one for the rest
        key = (task, kind)
        if self.plain:
            self._line(key, ev, phase)
            return
        if key not in self.tasks:
            self.tasks[key] = self.bars.add_task(task, total=ev["total"], phase="", loss="-")
        fields: dict[str, Any] = {"phase": ev.get("note") or phase}
        if ev.get("loss") is not None:
            fields["loss"] = f"{ev['loss']:.4f}"
        self.bars.update(self.tasks[key], completed=ev["step"], total=ev["total"], **fields)

    def _line(self, key: tuple[str, str], ev: dict[str, Any], phase: str) -> None:
        now, step, total = self.clock(), int(ev["step"]), int(ev["total"])
        pace = self.paces.get(key)
        if pace is None or step < pace.last or total != pace.total:  # a task (re)starts
            pace = self.paces[key] = _Pace(now, step, total)
        elif pace.phase == phase and (
            pace.printed_step == step or (step < total and now - pace.printed < self.every)
        ):
            pace.last = step
            return
        pace.phase, pace.printed, pace.printed_step, pace.last = phase, now, step, step
        parts = [f"{key[0]} {phase} {step}/{total}"]
        if ev.get("loss") is not None:
            parts.append(f"loss {ev['loss']:.4f}")
        parts += [f"{duration(now - pace.t0)} elapsed", pace.left(now, step, total)]
        line = ", ".join(parts) + (f" ({ev['note']})" if ev.get("note") else "")
        console.print(line, markup=False, highlight=False, soft_wrap=True)
