"""The experiment protocol (`lab.protocol`) and the commands generated from it
(`cli_experiments`)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sharpattn.cli import cli
from sharpattn.cli_experiments import closing
from sharpattn.experiments.registry import REGISTRY
from sharpattn.lab.protocol import Result, describe_default, option, options_of

NAMES = sorted(REGISTRY)


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_module_provides_the_protocol(name):
    module = REGISTRY[name].load()
    for attr in ("run_experiment", "plan", "default_folder"):
        assert hasattr(module, attr), f"{name}: {attr} missing"
    assert hasattr(module, "Options") or hasattr(module, "Config"), name
    assert hasattr(module, "configure") or hasattr(module, "make_config"), name
    assert dataclasses.is_dataclass(getattr(module, "Options", None) or module.Config)
    for profile, _ in REGISTRY[name].profiles:
        assert profile in module.PROFILES
        config = (getattr(module, "configure", None) or module.make_config)(profile)
        cost, jobs, changed = module.plan(config, profile)
        assert cost.startswith(REGISTRY[name].command) and jobs and not changed
        assert module.default_folder(config, profile).startswith("runs/")
    for field, meta in options_of(module):
        assert meta["help"] or meta["kind"] in ("threads", "checkpoint", "argument"), field.name


@pytest.mark.parametrize("name", NAMES)
def test_the_generated_help_has_every_option_with_its_default(name):
    module = REGISTRY[name].load()
    out = (
        CliRunner()
        .invoke(cli, [*REGISTRY[name].command.split(), "--help"], terminal_width=200)
        .output
    )
    assert "--out" in out
    assert all(f"--{profile}" in out for profile, _ in REGISTRY[name].profiles)
    profiled = {k for settings in getattr(module, "PROFILES", {}).values() for k in settings}
    for field, meta in options_of(module):
        if meta["kind"] == "argument":
            assert (meta["metavar"] or field.name.upper()) in out
            continue
        flag = meta["name"] or "--" + field.name.replace("_", "-")
        assert flag in out, flag
        line = next(x for x in out.splitlines() if x.strip().startswith(flag))
        shown = f"[default: {describe_default(field.default)}]"
        if meta["kind"] in ("text", "count", "positive", "choice") and field.name not in profiled:
            if meta["show_default"] is not False:
                assert shown in out.split(flag, 1)[1][:400], (flag, line)


def test_listing_the_commands_imports_no_experiment():
    code = (
        "import sys; from click.testing import CliRunner; from sharpattn.cli import cli; "
        "CliRunner().invoke(cli, ['reproduce', '--help']); "
        f"print([m for m in {NAMES!r} if 'sharpattn.experiments.' + m.replace('-', '_') "
        "in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_combination_a_study_refuses_is_one_sentence():
    result = CliRunner().invoke(cli, ["reproduce", "selective-llm", "--lora-lr", "1e-2"])
    assert result.exit_code == 2
    assert "--lora-lr applies to the matched study: add --lora RANK." in result.output


def test_defaults_are_written_as_people_write_them():
    assert [describe_default(v) for v in (1e-3, 3e-2, 0.25, 2.5, 256, "qv")] == [
        "1e-3",
        "3e-2",
        "0.25",
        "2.5",
        "256",
        "qv",
    ]


def test_an_unknown_option_kind_is_refused():
    with pytest.raises(ValueError, match="unknown option kind"):
        option(1, "x", kind="integer")


def test_the_last_line_names_what_was_written(tmp_path):
    assert (
        closing(Result(tmp_path, (), ("a.md", "b.png", "c.csv")))
        == f"wrote {tmp_path}/a.md, b.png and c.csv"
    )
    assert closing(Result(tmp_path, (), ("a.md",))) == f"wrote {tmp_path}/a.md"
    assert closing(Result(tmp_path, (), ())) == f"wrote {tmp_path}/report.md"
    assert closing(Result(tmp_path, (), (), closing="done")) == "done"
