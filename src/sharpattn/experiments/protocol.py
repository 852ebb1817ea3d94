"""The experiment protocol: what a reproduction is to the runner and to the command line.

An experiment is a registered `Experiment`: a name (its command, ``sharpattn reproduce NAME``), a
``Config`` dataclass, its profiles as data, and ``run(folder, config, progress, pool)`` returning
a `Result`. The command line is generated from it (``cli_experiments``): every ``Config`` field
declared with `option` is an option of the command, named after the field (``lora_lr`` →
``--lora-lr``), its help text written beside the field, its default the field's unless a profile
sets it. Adding a reproduction is one module (its Config, profiles and ``run``) plus one
`REGISTRY` line.

The protocol holds data only (no click): the command-line layer reads it.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Experiment", "Result", "REGISTRY", "describe_default", "experiment", "option",
           "options_of"]  # fmt: skip

#: the kinds of option values the command line knows (`option`'s ``kind``)
KINDS = ("text", "count", "positive", "seed", "flag", "choice", "threads", "checkpoint", "names",
         "sizes", "size_range", "floats", "file", "set_sizes", "folder", "argument", "plugins")  # fmt: skip


def option(default: Any, help: str, *, kind: str | None = None, maximum: int | None = None,
           minimum: int = 1, choices: tuple[str, ...] = (), metavar: str | None = None,
           name: str | None = None, show_default: bool | None = None) -> Any:  # fmt: skip
    """A ``Config`` (or ``Options``) field that is an option of the experiment's command.

    ``help``: what the option does, as ``--help`` prints it; ``[default: X]`` is added where no
    profile sets the field, unless ``show_default`` says otherwise. ``kind``: how the command
    line reads the value (one of `KINDS`; from the default's type where not given: ``bool`` a
    flag, ``int`` a count, ``float`` a positive number, ``str`` text):

    - ``count`` (an integer from ``minimum`` to ``maximum``, a number or the name of one of the
      command line's bounds: "steps", "sets", "seeds", "factor", "length", "rank"), ``positive``,
      ``text``, ``flag``, ``choice`` (one of ``choices``), ``seed``;
    - comma-separated ``names``, ``sizes`` (``N,N,...``), ``size_range`` (``LO,HI``),
      ``floats`` (positive numbers), ``set_sizes`` (sizes from 2 to 2**31 - 1);
    - ``file`` (a file's path), ``folder`` (an existing folder), ``plugins`` (repeatable);
    - ``argument``: the command's positional argument, one of ``choices``;
    - ``threads`` and ``checkpoint``: the shared ``--threads`` and ``--checkpoint-every``.

    ``name``: the option's name where it is not the field's (``--models-from``)."""
    if kind is None:
        kind = {bool: "flag", int: "count", float: "positive", str: "text"}[type(default)]
    if kind not in KINDS:
        raise ValueError(f"unknown option kind {kind!r}; known: {', '.join(KINDS)}.")
    meta = {"help": help, "kind": kind, "maximum": maximum, "minimum": minimum,
            "choices": tuple(choices), "metavar": metavar, "name": name,
            "show_default": show_default}  # fmt: skip
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
      work), ``prepare(config, folder, given) -> (config, note)`` (settings that depend on the
      run folder, and a line saying what was chosen) and ``catalogue(config)`` (``--list``)."""

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


experiment(Experiment(
    name="selective-llm",
    module="sharpattn.experiments.selective_llm",
    short_help="Selective temperatures on SmolLM2, frozen or with LoRA.",
    help="Selective temperatures trained on a frozen SmolLM2 (base weights fixed): held-out "
    "perplexity at 1x, 2x and 4x the fine-tuning context against the unpatched model (Zhang et "
    "al.'s Table 3 in small). With --lora, the matched study: the same fine-tuning of low-rank "
    "adapters with and without selective temperatures.",
    profiles=(("quick", "20 steps, 4 held-out windows at 1x and 2x the context"),
              ("paper", "100 steps, 8 windows at 1x, 2x and 4x the context")),
    out_help="Run folder (default runs/selective-llm-<profile>, with --lora "
    "runs/selective-llm-lora-<profile>); re-running resumes it.",
))  # fmt: skip

experiment(Experiment(
    name="max-retrieval",
    module="sharpattn.experiments.max_retrieval",
    short_help="Softmax is not Enough, Table 1.",
    help="Softmax is not Enough, Table 1: train, evaluate over sizes, t-tests, figures, report.",
    profiles=(("quick", "1 seed, 5,000 steps, sizes to 4,096"),
              ("paper", "10 seeds x 100,000 steps, sizes 16..16,384")),
    out_help="Run folder (default runs/max-retrieval-<profile>); re-running resumes it.",
    pool=True,
    transient=False,
))  # fmt: skip

experiment(Experiment(
    name="max-retrieval-regularisers",
    module="sharpattn.experiments.regularisers",
    short_help="Table 1 under each reading of its L2 term.",
    help="Table 1's baseline under each reading of App. A.4's L2 term (λΣw², λ/2·Σw², without "
    "biases, AdamW), each a max-retrieval run in OUT/<name>, compared with the paper's column.",
    profiles=(("quick", "2 seeds x 2,000 steps per reading, sizes to 2,048"),
              ("paper", "5 seeds x 100,000 steps per reading, sizes 16..2,048")),
    out_help="Study folder; re-running resumes it.",
    out_default="runs/max-retrieval-regularisers",
    pool=True,
))  # fmt: skip

experiment(Experiment(
    name="selective",
    module="sharpattn.experiments.selective",
    short_help="Selective attention: graph, denoising, a char LM.",
    help="Selective attention (Zhang et al., NeurIPS 2024): graph next-token task, denoising and "
    "a character language model (ours) at 1x, 2x and 4x its training context.",
    profiles=(("quick", "3 seeds, few steps, 4 LM variants"),
              ("paper", "The paper's steps and seeds, all twelve LM variants")),
    out_help="Run folder (default runs/selective-<profile>); re-running resumes it.",
))  # fmt: skip

experiment(Experiment(
    name="backcopy",
    module="sharpattn.experiments.backcopy",
    short_help="Bigram-Backcopy: sinks, drains, residual peaks.",
    help="Bigram-Backcopy: attention sinks, value drains, residual peaks, and Theorem 2.",
    profiles=(("quick", "d = 64, 64 tokens, batch 16, 600-1,500 steps per run"),
              ("paper", "The paper's settings, App. C.1"),
              ("medium", "d = 128, 128 tokens, batch 32, the paper's lr 3e-4 and 10,000 steps")),
    out_help="Run folder (default runs/backcopy-<profile>); re-running resumes it.",
    pool=True,
    transient=False,
))  # fmt: skip

experiment(Experiment(
    name="backcopy-study",
    module="sharpattn.experiments.backcopy.studies",
    short_help="Bigram-Backcopy one-factor studies.",
    help="Bigram-Backcopy controlled studies (one factor at a time): relu-peak, sgd, fig7b, "
    "no-bos, structures; and simplified, App. C.3's simplified model of Theorem 2 trained by "
    "Adam.",
    profiles=(),
    out_help="Run folder (default runs/backcopy-study-<study>); re-running resumes it.",
    pool=True,
    transient=False,
))  # fmt: skip

experiment(Experiment(
    name="clrs",
    module="sharpattn.experiments.clrs",
    short_help="CLRS-style algorithms, Fig. 8 in small.",
    help="CLRS-Text-style algorithms, softmax vs adaptive temperature in training (Softmax is not "
    "Enough's Figure 8 in small): accuracy in and beyond the training sizes.",
    profiles=(("quick", "4 algorithms, 2 seeds, 1,500 steps per run, sizes to 16x"),
              ("paper", "8 algorithms, 5 seeds, 5,000 steps, sizes to 64x the training sizes")),
    out_help="Run folder (default runs/clrs-<profile>); re-running resumes it.",
    pool=True,
    lists=True,
))  # fmt: skip

experiment(Experiment(
    name="leaderboard",
    module="sharpattn.experiments.leaderboard",
    short_help="Every attention method ranked on sequence tasks.",
    help="Every attention method on the same sequence tasks, seeds and budget, ranked by accuracy "
    "from the training sizes to a multiple of them (8x by default, 16x --standard, 256x --paper; "
    "area under accuracy against log size).",
    profiles=(("quick", "flip_flop, every method, 2 seeds x 500 steps, sizes to 8x"),
              ("paper", "Every synthetic task, every method, 5 seeds, sizes to >= 256x, test "
               "sequences sampled adaptively"),
              ("standard", "Every synthetic task, every method, 3 seeds, sizes to >= 16x, test "
               "sequences sampled adaptively")),
    out_help="Run folder (default runs/leaderboard-<profile>); re-running resumes it.",
    pool=True,
    lists=True,
    top_level=True,
    joins=True,
))  # fmt: skip

experiment(Experiment(
    name="clrs-llm",
    module="sharpattn.experiments.clrs_llm",
    short_help="Fig. 8 by fine-tuning SmolLM2 with LoRA.",
    help="CLRS-Text algorithms on a fine-tuned SmolLM2: low-rank adapters trained with softmax "
    "and with adaptive temperature on the same budget (Softmax is not Enough's Figure 8), "
    "accuracy in and up to 4x beyond the training sizes.",
    profiles=(("quick", "2 algorithms, 2 seeds, 40 steps of batch 4 per run, sizes to 4x"),
              ("paper", "3 algorithms trained at 4-8 items, 2 seeds, 400 steps of batch 8 per "
               "run, sizes to 4x")),
    out_help="Run folder (default runs/clrs-llm-<profile>); re-running resumes it.",
))  # fmt: skip
