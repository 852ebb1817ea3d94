"""The documentation a user reads (README.md and docs/*.md): every `sharpattn …` command it shows
parses with the real command-line parser, every command of the CLI is shown somewhere, and the
README's links and images point at files and headings that exist. (The site itself is built with
`mkdocs build --strict` by `make test`, which fails on a broken link, image, anchor or API
reference inside docs/.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sharpattn.cli import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: shell syntax that ends a command on a shown line (redirections, pipes, background)
SHELL = {">", ">>", "2>", "2>&1", "&", "|", "||", "&&", ";"}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _commands_in(text: str) -> list[str]:
    """The `sharpattn …` commands of one page: lines of code blocks, and inline code spans
    (which may wrap over lines), each cut at shell syntax and comments."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text)
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    found = []
    for line in lines:
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        if "sharpattn" not in tokens:
            continue
        start = tokens.index("sharpattn")
        if any(t not in ("nohup", "$") for t in tokens[:start]):
            continue  # e.g. `pip install sharpattn`: not a command of ours
        command = []
        for token in tokens[start + 1 :]:
            if token in SHELL or token.startswith((">", "2>")):
                break
            command.append(token)
        found.append(shlex.join(["sharpattn", *command]))
    return found


def shown_commands() -> list[tuple[str, str]]:
    """(page name, command) for every distinct command shown in README.md and docs/*.md (the
    first page that shows it)."""
    first: dict[str, str] = {}
    for page in PAGES:
        for command in _commands_in(page.read_text(encoding="utf-8")):
            first.setdefault(command, page.relative_to(ROOT).as_posix())
    return [(page, command) for command, page in first.items()]


def _resolve(args: list[str]) -> tuple[list[str], click.Command, list[str]]:
    """Walk the groups: (command path, the command, its own arguments)."""
    command: click.Command = cli
    path: list[str] = []
    rest = list(args)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"no command {' '.join(['sharpattn', *path, rest[0]])!r}"
        command, path, rest = sub, [*path, rest[0]], rest[1:]
    return path, command, rest


def _leaf_paths(command: click.Command, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if not isinstance(command, click.Group):
        return {path}
    ctx = click.Context(command)
    return {
        leaf
        for name in command.list_commands(ctx)
        for leaf in _leaf_paths(command.get_command(ctx, name), (*path, name))
    }


SHOWN = shown_commands()


def test_the_pages_show_commands():
    assert len(SHOWN) >= 40, SHOWN
    pages = {page for page, _ in SHOWN}
    assert "README.md" in pages and "docs/cli.md" in pages


def test_every_cli_command_is_shown():
    shown = {tuple(_resolve(shlex.split(c)[1:])[0]) for _, c in SHOWN}
    missing = sorted(" ".join(p) for p in _leaf_paths(cli) - shown)
    assert not missing, f"commands shown in no page: {missing}"


def test_help_of_every_shown_command_path():
    paths = sorted({tuple(_resolve(shlex.split(c)[1:])[0]) for _, c in SHOWN})
    runner = CliRunner()
    for path in [(), *paths]:
        done = runner.invoke(cli, [*path, "--help"], prog_name="sharpattn")
        assert done.exit_code == 0, (path, done.output)
        assert "Usage: sharpattn" in done.output


@pytest.mark.parametrize(("page", "command"), SHOWN, ids=[c for _, c in SHOWN])
def test_shown_command_parses(page, command, tmp_path, monkeypatch):
    """Parse the command's arguments as the CLI would, types and callbacks included, without
    running it. Paths it names are made to exist (an argument such as RUN must be a folder)."""
    path, leaf, rest = _resolve(shlex.split(command)[1:])
    if "--help" in rest or "-h" in rest or isinstance(leaf, click.Group):
        return  # its help is checked above
    monkeypatch.chdir(tmp_path)
    for token in rest:
        if "/" in token and not token.startswith("-"):
            (tmp_path / token).mkdir(parents=True, exist_ok=True)
    parent = click.Context(cli, info_name="sharpattn")
    try:
        leaf.make_context(path[-1], rest, parent=parent)
    except click.ClickException as e:
        pytest.fail(f"{page}: `{command}` does not parse: {e.format_message()}")


# --------------------------------------------------------------- the README's links and images


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    from markdown.extensions.toc import slugify

    return slugify(re.sub(r"[`*]", "", heading), "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def test_readme_links_and_images_exist():
    pytest.importorskip("markdown")
    text = FENCE.sub("", (ROOT / "README.md").read_text(encoding="utf-8"))
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        page = (ROOT / file) if file else ROOT / "README.md"
        assert page.is_file(), f"README.md links to {target!r}, which does not exist"
        if anchor:
            assert anchor in _anchors(page), f"README.md links to {target!r}: no such heading"
