"""`sharpattn list` prints the registry's text as text (issue 16, item 14)."""

import io

from rich.console import Console

from sharpattn import cli
from sharpattn import normalizers as nz


def _list_output(monkeypatch) -> str:
    buf = io.StringIO()
    # wide enough that no cell wraps, so every registry string can be found verbatim
    monkeypatch.setattr(cli, "console", Console(file=buf, width=2000, color_system=None))
    assert cli.main(["list"]) == 0
    return buf.getvalue()


def test_list_keeps_square_brackets_of_the_formulas(monkeypatch):
    out = _list_output(monkeypatch)
    assert "[s_i − τ]_+, Σ = 1" in out  # sparsemax: "[s_i − τ]" was read as a rich style tag
    assert "[s_i/2 − τ]_+², Σ = 1" in out  # entmax15
    for name in nz.available():
        e = nz.get(name)
        assert e.formula in out, name
        assert e.citation in out, name


def test_list_prints_markup_like_text_of_a_user_method_literally(monkeypatch, register_normalizer):
    register_normalizer(
        nz.Normalizer(
            name="bracketed",
            fn=nz.softmax,
            formula="[bold]s[/bold] [red]",
            citation="[link=x]me[/link]",
            sums_to_one=True,
        )
    )
    out = _list_output(monkeypatch)
    assert "[bold]s[/bold] [red]" in out and "[link=x]me[/link]" in out
