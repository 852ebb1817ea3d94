"""The pages' maths, rendered at build time with no script and no CDN.

The pages and docstrings write formulas in plain text with a few LaTeX habits: superscripts
``e^{−δ/θ}``, ``2^22``, ``λ^i``; subscripts ``s_i``, ``w_ij``, ``Π_{j<k<i}``, ``[x]_+``. This
mkdocs hook adds a Markdown extension (to the pages and to mkdocstrings' docstrings alike) that
renders them as ``<sup>``/``<sub>`` outside code, nested as written. A subscript needs a base of
one character (``s_i``, ``]_+``) or an operator (``max_j``, ``argmax_j``), so names such as
``top_k`` or ``beta_pre`` stay as they are. ``tests/experiments/test_docs.py`` fails on a ``^``,
``_{`` or ``}_`` left in the text of a built page.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as etree

from markdown import Extension
from markdown.inlinepatterns import InlineProcessor

#: words that take a subscript as a one-character base does (max_j, argmax_j, softmax_θ)
OPERATORS = {"max", "min", "mean", "argmax", "argmin", "softmax", "exp", "log", "Σ", "Π", "E"}
#: a bare script: a run of word characters (and a leading minus), e.g. 2^22, 10^22.4, x_ij
BARE_SUP = re.compile(r"[−-]?[\w∞*′]+(?:\.\d+)?")
BARE_SUB = re.compile(r"\+|[\w∞*′]+")


def _balanced(data: str, start: int, open_: str, close: str) -> int | None:
    """The index just past the bracket that closes ``data[start]`` (an ``open_``)."""
    depth = 0
    for i in range(start, len(data)):
        if data[i] == open_:
            depth += 1
        elif data[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _script(data: str, at: int, tag: str) -> tuple[str, int] | None:
    """The script that starts at ``data[at]`` (just past its ``^`` or ``_``): its text and end."""
    if at < len(data) and data[at] == "{":
        end = _balanced(data, at, "{", "}")
        return None if end is None else (data[at + 1 : end - 1], end)
    if tag == "sup" and at < len(data) and data[at] == "(":
        end = _balanced(data, at, "(", ")")
        return None if end is None else (data[at:end], end)
    bare = (BARE_SUP if tag == "sup" else BARE_SUB).match(data, at)
    # a word subscript followed by more of a word is a name (top_k); ``]_+²`` is a script and a
    # power ('²' counts as alphanumeric)
    joined = bare is not None and bare.end() < len(data) and data[bare.end()].isalnum()
    if bare is None or (tag == "sub" and joined and bare.group(0) != "+"):
        return None
    return data[at : bare.end()], bare.end()


def _has_base(data: str, underscore: int) -> bool:
    """Whether the ``_`` at ``data[underscore]`` follows a base: a closing bracket, a norm bar,
    one letter (accents and primes allowed: P̂, P*) or an operator."""
    before = data[:underscore]
    if before[-1:] in (")", "]", "‖", "|"):
        return True
    word = re.search(r"[\w\u0300-\u036f*′]*$", before).group(0)
    if len(re.sub(r"[\u0300-\u036f*′]", "", word)) == 1 and not word[0].isdigit():
        return True
    return word in OPERATORS


def _element(tag: str, text: str) -> etree.Element:
    """``<tag>`` holding ``text``, its own scripts (e^{−e^{2.5}}) rendered as well."""
    el = etree.Element(tag)
    last: etree.Element | None = None
    done = 0
    i = 0
    while i < len(text):
        ch = text[i]
        found = None
        if ch in "^_" and i > 0 and not text[i - 1].isspace():
            kind = "sup" if ch == "^" else "sub"
            if kind == "sup" or _has_base(text, i):
                found = _script(text, i + 1, kind)
        if found is None:
            i += 1
            continue
        inner, end = found
        if last is None:
            el.text = (el.text or "") + text[done:i]
        else:
            last.tail = (last.tail or "") + text[done:i]
        last = _element(kind, inner)
        el.append(last)
        done = i = end
    if last is None:
        el.text = (el.text or "") + text[done:]
    else:
        last.tail = (last.tail or "") + text[done:]
    return el


class _Script(InlineProcessor):
    def __init__(self, pattern: str, tag: str, md):
        super().__init__(pattern, md)
        self.tag = tag

    def handleMatch(self, m, data):  # noqa: N802 (Python-Markdown's name)
        if self.tag == "sub" and not _has_base(data, m.start()):
            return None, None, None
        found = _script(data, m.end(), self.tag)
        if found is None:
            return None, None, None
        inner, end = found
        return _element(self.tag, inner), m.start(), end


class ScriptsExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Python-Markdown's name)
        # above emphasis (50) and the escapes' neighbours, below code spans (190)
        md.inlinePatterns.register(_Script(r"(?<=[^\s\\`])\^", "sup", md), "sharpattn_sup", 65)
        md.inlinePatterns.register(
            _Script(r"(?<=[^\s\\`])_(?=[{\w∞+*′])", "sub", md), "sharpattn_sub", 64
        )


def on_config(config):
    config.markdown_extensions.append(ScriptsExtension())
    return config
