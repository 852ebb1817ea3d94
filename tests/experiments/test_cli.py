"""The `sharpattn` command: list, demo, and one-sentence errors with exit code 2."""

import json
import shutil
import subprocess
import sys

import pytest

from sharpattn.cli import main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "softmax" in out and "adaptive" in out


def test_demo_writes_a_run_folder(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    assert main(["demo", "--sizes", "16,256,4096", "--rows", "32", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert "Lemma 2.1" in printed
    for name in ("config.json", "metrics.json", "report.md", "dispersion.png"):
        assert (out_dir / name).stat().st_size > 0
    for name in ("config.json", "metrics.json", "report.md", "winner_weight.png"):
        assert (out_dir / "dispersion" / name).stat().st_size > 0  # then every method
    rows = json.loads((out_dir / "metrics.json").read_text())
    soft = [r for r in rows if r["method"] == "softmax"]
    assert len(rows) == 2 * 2 * 3
    for r in soft:  # Lemma 2.1 holds for every measured row
        assert r["n_max_weight"] <= r["lemma_bound"]
    margin = {r["n"]: r for r in soft if r["setting"] == "margin"}
    assert (
        margin[16]["winner_weight"] > margin[256]["winner_weight"] > margin[4096]["winner_weight"]
    )
    adaptive = {r["n"]: r for r in rows if r["setting"] == "margin" and r["method"] == "adaptive"}
    assert adaptive[16]["winner_weight"] > margin[16]["winner_weight"]  # sharper at small n


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["demo", "--sizes", "16,x"], "--sizes"),
        (["demo", "--sizes", "1"], "integers from 2 to"),
        (["demo", "--margin", "-1"], "--margin"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_console_script_runs_without_traceback():
    exe = shutil.which("sharpattn") or str(
        __import__("pathlib").Path(sys.executable).with_name("sharpattn")
    )
    done = subprocess.run([exe, "demo", "--rows", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--rows" in done.stderr
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "demo" in done.stdout


def test_readme_quick_start_runs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 11
    exec(compile(code, "README quick start", "exec"), {})


# ------------------------------------------------------------------ profiles: defaults and costs
def _commands(group=None, prefix=()):
    """(path, click command) for every command of the ``sharpattn`` tree."""
    import click

    from sharpattn.cli import cli

    group = group or cli
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_every_profile_default_is_quick_and_long_profiles_are_named():
    """No command's default is a long profile: every command with profiles runs --quick without
    a flag, says so in its help, and its long profiles name their measured cost (from the one
    table, cli_options.COSTS)."""
    from sharpattn.cli_options import COSTS

    with_profiles = 0
    for path, cmd in _commands():
        helps = {o.name: o.help or "" for o in cmd.params}
        if "quick" not in helps:
            assert "(the default" not in " ".join(helps.values()), path
            continue
        with_profiles += 1
        command = " ".join(path)
        assert "(the default; " + COSTS[command]["quick"] in helps["quick"], path
        for long in ("medium", "standard", "power", "paper"):
            if long in helps:
                assert "the default" not in helps[long] and COSTS[command][long] in helps[long]
    assert with_profiles == 8


def test_no_flag_runs_the_quick_profile(tmp_path, monkeypatch, capsys):
    from sharpattn.experiments import leaderboard as lb
    from sharpattn.lab.protocol import Result

    seen = []

    def run(out, cfg, *a):
        seen.append((out, cfg))
        return Result(tmp_path, (), ("report.md",))

    monkeypatch.setattr(lb, "run_experiment", run)
    assert main(["leaderboard", "--out", str(tmp_path / "q")]) == 0
    assert seen[0][1] == lb.make_config("quick")
    assert capsys.readouterr().err == ""  # the quick profile starts without a word


@pytest.mark.parametrize(
    "argv, command, profile",
    [
        (["leaderboard", "--paper"], "leaderboard", "paper"),
        (["reproduce", "clrs", "--paper"], "reproduce clrs", "paper"),
        (["reproduce", "backcopy", "--medium"], "reproduce backcopy", "medium"),
        (["reproduce", "max-retrieval", "--paper"], "reproduce max-retrieval", "paper"),
        (["reproduce", "selective", "--paper"], "reproduce selective", "paper"),
        (["reproduce", "selective-llm", "--paper"], "reproduce selective-llm", "paper"),
        (
            ["reproduce", "selective-llm", "--paper", "--lora", "8"],
            "reproduce selective-llm --lora",
            "paper",
        ),
        (["reproduce", "clrs-llm", "--paper"], "reproduce clrs-llm", "paper"),
        (["llm", "--full"], "llm", "full"),
    ],
)
def test_a_long_profile_says_its_cost_before_it_starts(
    argv, command, profile, tmp_path, monkeypatch, capsys
):
    """Before any work, one line on stderr: the profile, the job count, the measured cost."""
    from sharpattn import cli_options
    from sharpattn.cli_options import COSTS

    class Started(Exception):
        pass

    def start(*a, **k):
        raise Started

    monkeypatch.setattr(cli_options.ProgressRenderer, "__enter__", start)
    with pytest.raises(Started):
        main([*argv, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"sharpattn {command} --{profile}:" in err and COSTS[command][profile] in err
    assert any(ch.isdigit() for ch in err.split(":")[1].split(";")[0])  # a count


def test_a_changed_long_profile_says_its_cost_is_the_unchanged_profile_s(
    tmp_path, monkeypatch, capsys
):
    """Options that change what a long profile runs: the cost line says whose cost it quotes."""
    from sharpattn import cli_options

    class Started(Exception):
        pass

    def start(*a, **k):
        raise Started

    monkeypatch.setattr(cli_options.ProgressRenderer, "__enter__", start)
    cases = (
        (["reproduce", "clrs-llm", "--paper"], False),
        (["reproduce", "clrs-llm", "--paper", "--steps", "5"], True),
        # where it runs leaves the work alone; another task, width or size does not
        (["leaderboard", "--standard", "--workers", "2", "--threads", "1"], False),
        (["leaderboard", "--standard", "--tasks", "flip_flop"], True),
        (["leaderboard", "--standard", "--d-model", "256"], True),
        (["leaderboard", "--standard", "--eval-factor", "128"], True),
    )
    for i, (command, changed) in enumerate(cases):
        with pytest.raises(Started):
            main([*command, "--out", str(tmp_path / f"run{i}")])
        err = capsys.readouterr().err
        assert "measured cost" in err, err
        assert ("the unchanged profile's measured cost" in err) is changed, (command, err)


def test_the_cost_table_of_docs_is_the_code_s():
    """docs/cli.md's table of profiles shows every measured cost of cli_options.COSTS."""
    from pathlib import Path

    from sharpattn.cli_options import COSTS

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    rows = {
        line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `")
    }
    for command, costs in COSTS.items():
        for profile, cost in costs.items():
            assert cost in rows[command], (command, profile)


# ---------------------------------------------------------------------- progress without a terminal
def test_progress_without_a_terminal_prints_plain_lines(monkeypatch):
    """Output redirected: a plain line per phase change and at most one per task every
    ``every`` seconds, each with step/total, the time elapsed and an estimate of the time left."""
    import io

    from rich.console import Console

    from sharpattn import cli_options
    from sharpattn.lab.runner import event

    buf = io.StringIO()
    monkeypatch.setattr(cli_options, "console", Console(file=buf, width=200))
    now = [0.0]
    with cli_options.ProgressRenderer(every=10, clock=lambda: now[0]) as progress:
        assert progress.plain  # not a terminal
        for step in range(0, 101, 5):  # 1 s per 5 steps: 20 s of training
            progress(event("seed 0", "train", step, 100, loss=1.0 / (step + 1)))
            now[0] += 1
        progress(event("seed 0", "eval n=16", 0, 4))
        now[0] += 2
        progress(event("seed 0", "eval n=16", 1, 4))  # too soon: not printed
        progress(event("seed 0", "eval n=32", 2, 4))  # a new phase, the same pace
    lines = buf.getvalue().splitlines()
    assert lines[0] == "seed 0 train 0/100, loss 1.0000, 0 s elapsed, time left not yet known"
    assert lines[1].startswith("seed 0 train 50/100, loss") and "10 s elapsed" in lines[1]
    assert lines[1].endswith("about 10 s left")
    assert lines[2].startswith("seed 0 train 100/100") and lines[2].endswith("done")
    assert lines[3] == "seed 0 eval n=16 0/4, 0 s elapsed, time left not yet known"
    assert lines[4] == "seed 0 eval n=32 2/4, 2 s elapsed, about 2 s left"
    assert len(lines) == 5


def test_a_redirected_command_prints_its_progress(tmp_path):
    """A real command with its output in a file (no terminal) writes progress lines there."""
    log = tmp_path / "log.txt"
    code = "from sharpattn.cli import main; raise SystemExit(main())"
    argv = ["dispersion", "--sizes", "16,64", "--rows", "4", "--out", str(tmp_path / "d")]
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-c", code, *argv], stdout=f, stderr=f, timeout=120)
    text = log.read_text()
    assert done.returncode == 0, text
    assert any(" elapsed, " in line and "/" in line for line in text.splitlines()), text


def test_every_command_has_the_same_threads_option():
    """The same --threads for every command: no fixed default (the command picks it with its
    workers, `pick_threads`), $SHARPATTN_THREADS sets it."""
    with_threads = [
        (path, o.default, o.envvar)
        for path, cmd in _commands()
        for o in cmd.params
        if o.name == "threads"
    ]
    assert len(with_threads) >= 9
    assert all(d is None and env == "SHARPATTN_THREADS" for _, d, env in with_threads)


def test_threads_default_to_the_free_cores_and_say_so(monkeypatch, capsys):
    from sharpattn import cli_options
    from sharpattn.attention.dispatch import machine
    from sharpattn.lab import runner

    monkeypatch.setattr(runner, "cores", lambda: 4)
    monkeypatch.setattr(machine, "cores", lambda: 4)  # as free_cores reads it
    for load, free in [(0.0, 4), (1.4, 3), (2.6, 1), (3.7, 1), (9.0, 1)]:
        monkeypatch.setattr(machine.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert runner.free_cores() == (free, load)
        assert cli_options.pick_threads(None) == free
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{free} torch thread" in err and f"load {load:.1f}" in err
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (-3.0, 0.0, 0.0))  # never above cores
    assert runner.free_cores()[0] == 4
    # worker processes keep one thread each; a choice is kept silently
    assert cli_options.pick_threads(None, workers=2) == 1
    assert "one per worker process" in capsys.readouterr().err
    assert cli_options.pick_threads(None, workers=1, ray="auto") == 1
    capsys.readouterr()
    assert cli_options.pick_threads(3, workers=2) == 3 and capsys.readouterr().err == ""


def test_a_command_picks_its_threads_from_the_free_cores(tmp_path, monkeypatch, capsys):
    """End to end: without --threads (nor $SHARPATTN_THREADS) the run's config records the cores
    free now, and stderr says so; with worker processes each keeps one thread."""
    from sharpattn.lab import runner

    monkeypatch.delenv("SHARPATTN_THREADS")
    monkeypatch.setattr(runner, "free_cores", lambda: (2, 0.1))
    argv = ["reproduce", "max-retrieval", "--steps", "4", "--sizes", "16", "--test-sets", "4"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert "sharpattn: 2 torch threads (the free cores:" in capsys.readouterr().err
    assert json.loads((tmp_path / "a" / "config.json").read_text())["threads"] == 2
    monkeypatch.setenv("SHARPATTN_THREADS", "1")  # a choice: no line
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "torch thread" not in capsys.readouterr().err


def test_package_data_patterns_cover_every_data_file():
    """Every file of a package's data/ folder is listed by pyproject's package-data, so an
    installed package ships what its defaults read."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[2]
    listed = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    for folder in (root / "src").glob("sharpattn/**/data"):
        package = ".".join(folder.parent.relative_to(root / "src").parts)
        for f in folder.iterdir():
            name = f"data/{f.name}"
            assert any(fnmatch.fnmatch(name, p) for p in listed.get(package, [])), name


def test_every_command_has_a_whole_line_in_the_command_list():
    """`sharpattn --help` shows each command's summary whole: never cut mid-sentence ("Max of n
    numbers (Fig.") or with "..." at 80 columns; no help text sends the reader to the README."""
    import click

    from sharpattn.cli import cli

    def every(group, prefix=()):
        for name, cmd in group.commands.items():
            yield (*prefix, name), cmd
            if isinstance(cmd, click.Group):
                yield from every(cmd, (*prefix, name))

    for path, cmd in every(cli):
        short = cmd.get_short_help_str(limit=55)
        assert short.endswith(".") and not short.endswith("..."), path
        assert short.count("(") == short.count(")"), path
        helps = [cmd.help or "", *(getattr(o, "help", None) or "" for o in cmd.params)]
        assert not any("README" in h for h in helps), path


def test_info_says_which_paths_run_and_how_to_turn_the_loops_off(capsys):
    import json

    import sharpattn

    state = sharpattn.info()
    assert set(state) >= {"version", "torch", "threads", "native", "cpu_flash", "cuda", "triton"}
    assert set(state["native"]) >= {"active", "compiler", "cache", "library", "turn_off"}
    assert state["native"]["turn_off"] == "SHARPATTN_COMPILE=0"
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "C++ tile loops" in out and state["native"]["cache"] in out
    assert "SHARPATTN_COMPILE=0" in out and "CPU flash kernel" in out and "CUDA" in out
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["native"]["cache"] == state["native"]["cache"]


def test_info_says_how_the_cpu_paths_use_threads_here(monkeypatch):
    """Torch's thread setting against the usable cores and the load; on a machine busier than
    the setting allows for, the advice names the free cores."""
    from sharpattn.attention.dispatch import machine

    state = {"threads": 2, "cores": 2, "load": 0.1, "free_cores": 2}
    [line] = machine._thread_lines(state)
    assert (
        "torch's setting (2;" in line and "2 core(s) usable, load 0.1 (1 min), 2 free now" in line
    )
    busy = machine._thread_lines({**state, "load": 2.6, "free_cores": 1})
    assert len(busy) == 2 and "torch.set_num_threads(1)" in busy[1]
    quiet = machine._thread_lines({**state, "load": None})
    assert "no load average here" in quiet[0]
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    assert machine.free_cores() == (1, 5.0)  # at least one core
    got = machine.info()
    assert got["load"] == 5.0 and got["free_cores"] == 1 and got["cores"] == machine.cores()


def test_a_run_from_a_checkout_with_uncommitted_changes_is_refused_unless_allowed(
    tmp_path, monkeypatch, capsys
):
    """The command refuses, in one sentence and before any work, to run from a modified checkout
    (its report could not name the code that wrote it); --allow-dirty (or
    $SHARPATTN_ALLOW_DIRTY, which the suite sets) lets it run, and the report says so. A quick
    run (a demo) is not refused."""
    from sharpattn.experiments import selective_llm
    from sharpattn.lab import report, runner

    dirty = {"version": "9.9", "commit": "a" * 40, "modified": True}
    monkeypatch.setattr(runner.folder, "code_version", lambda: dirty)
    monkeypatch.delenv("SHARPATTN_ALLOW_DIRTY")
    out = tmp_path / "r"
    argv = ["reproduce", "selective-llm", "--paper", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has uncommitted changes" in err and "--allow-dirty" in err
    assert err.count("\n") == 1 and not out.exists()

    def stop(cfg, pool=None):  # past the refusal: stop before the model is loaded
        raise ValueError("stopped here.")

    monkeypatch.setattr(selective_llm, "check_memory", stop)
    quick = ["reproduce", "selective-llm", "--quick", "--out", str(out)]
    assert main(quick) == 2
    assert "stopped here." in capsys.readouterr().err
    assert main([*argv, "--allow-dirty"]) == 2
    assert "stopped here." in capsys.readouterr().err
    monkeypatch.setenv("SHARPATTN_ALLOW_DIRTY", "1")
    assert main(argv) == 2
    assert "stopped here." in capsys.readouterr().err
    line = report.code_line([dirty])
    assert (
        line
        == f"Code: sharpattn 9.9 at commit {'a' * 12} with uncommitted changes (not the commit's code).\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["diagnose", "minilm"],
        ["llm", "--full"],
        ["dispersion"],
        ["fit-temperature", "{run}"],
        ["corollary-b1", "{run}"],
    ],
)
def test_every_report_writing_command_refuses_uncommitted_changes(
    argv, tmp_path, monkeypatch, capsys
):
    """diagnose, llm --full, dispersion, fit-temperature and corollary-b1 write reports the
    pages quote: from a modified checkout they refuse in one sentence before any work, unless
    --allow-dirty; `demo` and llm's quick profile run."""
    from sharpattn.lab import runner

    dirty = {"version": "9.9", "commit": "a" * 40, "modified": True}
    monkeypatch.setattr(runner.folder, "code_version", lambda: dirty)
    monkeypatch.delenv("SHARPATTN_ALLOW_DIRTY")
    monkeypatch.chdir(tmp_path)
    argv = [a.format(run=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has uncommitted changes" in err and "--allow-dirty" in err
    assert err.count("\n") == 1 and not (tmp_path / "runs").exists()
