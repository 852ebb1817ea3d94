"""The report kit every experiment uses: figures, markdown tables, report.md.

* `figure` — a matplotlib figure (Agg backend) saved atomically to a PNG when the block ends,
  and closed whatever happens.
* `method_styles` — a distinct look (colour, line style, marker) per method, the same in every
  figure.
* `markdown_table` — one function for every markdown table; `write_table` also writes
  the same rows as CSV.
* `write_report` — ``report.md`` from a title and sections, written atomically;
  `require` refuses, before anything is written, a report of no results (a folder's
  earlier report is never replaced by an empty one).

Statistics come from `stats` (scipy), nowhere else.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

from .runs import CODE_VERSIONS, read_json, write_atomic


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    if "matplotlib" not in sys.modules:
        matplotlib_config()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def matplotlib_config() -> None:
    """Where the home folder does not exist (``HOME`` pointing nowhere), matplotlib's config and
    cache folder (``MPLCONFIGDIR``, unless set) is a private temporary folder, removed when the
    process ends: matplotlib would otherwise create the missing home folder to hold
    ``~/.config/matplotlib``."""
    if "MPLCONFIGDIR" in os.environ or os.path.isdir(os.path.expanduser("~")):
        return
    folder = tempfile.mkdtemp(prefix="sharpattn-matplotlib-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["MPLCONFIGDIR"] = folder


@contextlib.contextmanager
def figure(
    path: str | Path, nrows: int = 1, ncols: int = 1, *, dpi: int = 120, **kwargs
) -> Iterator:
    """``with figure(path, figsize=(7, 4)) as (fig, ax): ...`` draws and saves ``path``.

    ``nrows``/``ncols``/``kwargs`` go to ``plt.subplots``; the PNG is written atomically with a
    tight layout (or the ``layout`` the figure asked for, e.g. ``layout="constrained"`` for a
    colour bar beside several panels) when the block ends without an error.
    """
    plt = pyplot()
    fig, ax = plt.subplots(nrows, ncols, **kwargs)
    try:
        yield fig, ax
        if fig.get_layout_engine() is None:  # a figure asking for layout="constrained" keeps it
            fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        write_atomic(Path(path), buf.getvalue())
    finally:
        plt.close(fig)


#: the colours of `method_styles` (matplotlib's tab10, colour-blind friendlier than tab20's pale
#: halves), its line styles and its markers: a slot j has colour j mod 10, line style
#: (j div 10) mod 4 and marker j mod 8, so no two of the first 40 slots look alike
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def method_styles(methods: Sequence[str], catalogue: Sequence[str] = ()) -> dict[str, dict]:
    """A distinct look per method: ``{method: {"color", "linestyle", "marker"}}`` for
    ``ax.plot(..., **style)``. A method of ``catalogue`` (a fixed order of every known method,
    e.g. the leaderboard's) takes the slot of its place there, so it looks the same in every
    figure whatever else is drawn; the others take the free slots in their order. Slots are
    distinct up to ``len(PALETTE) × 4`` methods (40), then repeat."""
    slots = {m: j for j, m in enumerate(dict.fromkeys(catalogue))}
    taken = {slots[m] for m in methods if m in slots}
    free = (j for j in range(len(slots) + len(methods)) if j not in taken)
    out = {}
    for m in dict.fromkeys(methods):
        j = slots[m] if m in slots else next(free)
        out[m] = {
            "color": PALETTE[j % len(PALETTE)],
            "linestyle": LINE_STYLES[(j // len(PALETTE)) % len(LINE_STYLES)],
            "marker": MARKERS[j % len(MARKERS)],
        }
    return out


def cell(value: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant digits ("n/a" for NaN/None), ints with
    thousands separators, everything else as ``str``."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.{digits}g}"
    return str(value)


def interval(effect: Any) -> str:
    """An effect's 95 % interval (`stats.PairedEffect`'s low and high) as a cell, signed to 3
    decimals; "–" where it is undefined (one seed, or no spread)."""
    return bounds(effect.low, effect.high)


def bounds(low: float, high: float, spec: str = "+.3f") -> str:
    """An interval ``[low, high]`` as a cell in the format ``spec``; "–" where it is undefined."""
    return f"[{low:{spec}}, {high:{spec}}]" if math.isfinite(low) else "–"


def mean_sd(mean: float, sd: float) -> str:
    """A mean ± standard deviation as a cell, to 3 decimals: the mean alone where the deviation
    is undefined (one seed), "n/a" where the mean is."""
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.3f}" if not math.isfinite(sd) else f"{mean:.3f} ± {sd:.3f}"


def p_cell(p: float) -> str:
    """A p-value as a cell, to 2 significant digits; "–" where it is undefined."""
    return "–" if not math.isfinite(p) else f"{p:.2g}"


def decimals(value: float) -> str:
    """A number to 3 decimals as a cell; "–" where it is NaN."""
    return "–" if not math.isfinite(value) else f"{value:.3f}"


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None
) -> str:
    """A markdown table; ``align`` is one character per column, "l" or "r" (default: the first
    column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header):
        raise ValueError(f"align has {len(align)} characters for {len(header)} columns.")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else ":---" for a in align) + "|",
    ]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells for {len(header)} columns.")
        lines.append("| " + " | ".join(c if isinstance(c, str) else cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def csv_text(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same rows as CSV (full precision, empty for None/NaN)."""

    def fmt(v):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return ""
        s = f"{v:.6g}" if isinstance(v, float) else str(v)
        return f'"{s}"' if ("," in s or '"' in s) else s

    return ",".join(header) + "\n" + "".join(",".join(fmt(v) for v in r) + "\n" for r in rows)


def write_table(
    folder: str | Path,
    name: str,
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    raw: Sequence[Sequence[Any]] | None = None,
    align: str | None = None,
) -> str:
    """Write ``name``.md (``rows`` as shown) and ``name``.csv (``raw`` values, default ``rows``)
    into ``folder``; return the markdown."""
    md = markdown_table(header, rows, align)
    write_atomic(Path(folder) / f"{name}.md", md)
    write_atomic(Path(folder) / f"{name}.csv", csv_text(header, raw if raw is not None else rows))
    return md


def image(png: str, caption: str) -> str:
    """A report section showing ``png`` (relative to report.md) with its caption."""
    return f"![{caption}]({png})\n\n*{caption}*\n"


def require(results: Sized, what: str) -> None:
    """Refuse (``ValueError``) to write a report, its tables, figures or results from no
    ``results`` (an empty selection): the folder's earlier report stays as it was. Call it
    before the first file a report writes."""
    if len(results) == 0:
        raise ValueError(
            f"no {what} to report; choose at least one (the folder's report is left as it was)."
        )


def code_line(versions: list[dict[str, Any]]) -> str:
    """One line naming the code versions that ran a run folder: sharpattn's version, the git
    commit (short) and whether its tracked files had uncommitted changes (then the commit does
    not name the code that ran), first to last."""

    def one(v: dict[str, Any]) -> str:
        commit = v.get("commit")
        where = f" at commit {commit[:12]}" if commit else ""
        dirty = " with uncommitted changes (not the commit's code)" if v.get("modified") else ""
        return f"sharpattn {v.get('version')}{where}{dirty}"

    if not versions:
        return ""
    what = "; then ".join(one(v) for v in versions)
    many = len({(v.get("version"), v.get("commit")) for v in versions}) > 1
    return f"Code: {what}{' (resumed by other code)' if many else ''}.\n"


def write_report(folder: str | Path, title: str, sections: Sequence[str | None]) -> Path:
    """``report.md`` in ``folder``: ``# title``, the non-empty sections, then the code versions
    that ran it (its ``code_versions.json``, where it has one), atomically."""
    parts = [f"# {title}\n"] + [s.rstrip() + "\n" for s in sections if s]
    versions = Path(folder) / CODE_VERSIONS
    line = code_line(read_json(versions, list)) if versions.is_file() else ""
    if line:
        parts.append(line)
    path = Path(folder) / "report.md"
    write_atomic(path, "\n".join(parts))
    return path
