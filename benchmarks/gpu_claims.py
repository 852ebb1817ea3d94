"""The GPU numbers of the documentation, rendered from the result files in
``benchmarks/results/`` and written into the pages between markers::

    <!-- gpu-results:begin NAME -->
    ...generated Markdown...
    <!-- gpu-results:end -->

Each block names its result file and the machine and versions recorded in it (a field the file
does not have reads "not recorded"). A block whose result file is missing says "Not measured
yet" and prints no number. Text outside the markers is hand-written and carries no GPU numbers.

    python benchmarks/gpu_claims.py            # rewrite the blocks in README.md and docs/*.md
    python benchmarks/gpu_claims.py --check    # exit 1 and name the blocks that differ

``tests/experiments/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
COMMAND = "python benchmarks/gpu_claims.py"

BEGIN = "<!-- gpu-results:begin {name} -->"
END = "<!-- gpu-results:end -->"
BLOCK = re.compile(
    r"^<!-- gpu-results:begin (?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- gpu-results:end -->$",
    re.S | re.M,
)

#: the maps as the prose groups them
SOFTMAX = ("softmax", "ssmax", "length_scaled", "llama4_temperature", "logn")
ELEMENTWISE = ("sigmoid", "relu", "relu@p=2", "power", "signed", "softpick")
SPARSE = ("topk", "hardmax", "sparsemax", "entmax15", "entmax", "asentmax")
#: row labels of cases whose name is not what a reader looks for
LABELS = {
    "entmax": "entmax (α = 1.5)",
    "entmax@alpha=1.3": "entmax, α = 1.3",
    "relu@p=2": "relu, p = 2",
    "anchor:adasplash": "AdaSplash (α = 1.5, its own kernel)",
    "anchor:stickbreaking": "stick-breaking (Tan et al.'s kernel)",
}


def load(name: str, results: Path = RESULTS) -> dict | None:
    """A result file's contents, or None where it is not in the repository."""
    path = results / name
    return json.loads(path.read_text()) if path.is_file() else None


def _field(doc: dict, *keys: str) -> str:
    for key in keys:
        if doc.get(key) not in (None, ""):
            return str(doc[key])
    return "not recorded"


def provenance(doc: dict, name: str) -> str:
    """One line: the file, the GPU, the versions, the commit and the date it records."""
    return (
        f"*Measured on {_field(doc, 'device', 'gpu')}: torch {_field(doc, 'torch')}, "
        f"CUDA {_field(doc, 'cuda')}, Triton {_field(doc, 'triton')}; commit "
        f"{_field(doc, 'commit')}, date {_field(doc, 'date')} "
        f"(`benchmarks/results/{name}`).*"
    )


def not_measured(name: str) -> str:
    return f"Not measured yet: `benchmarks/results/{name}` is not in the repository."


def _size(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _num(x: float) -> str:
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _range(values: list[float]) -> str:
    if not values:
        return "–"
    lo, hi = _num(min(values)), _num(max(values))
    return f"{lo}×" if lo == hi else f"{lo}-{hi}×"


def _ratios(doc: dict, methods, sizes=None, mode=None) -> list[float]:
    return [
        r["time_ratio"]
        for r in doc["rows"]
        if r["method"] in methods
        and "time_ratio" in r
        and (sizes is None or r["n"] in sizes)
        and (mode is None or r["mode"] == mode)
    ]


def _methods(doc: dict) -> list[str]:
    seen: list[str] = []
    for r in doc["rows"]:
        if r["method"] not in seen and "time_ratio" in r:
            seen.append(r["method"])
    return seen


def ratio_table(doc: dict) -> str:
    """Method × (size, causal): forward / forward+backward time as a ratio to SDPA's, and a last
    row of SDPA's own milliseconds."""
    rows = [r for r in doc["rows"] if "time_ratio" in r]  # not a failed cell
    cols = sorted({(r["n"], r["causal"]) for r in rows})
    cell = {(r["method"], r["n"], r["causal"], r["mode"]): r for r in rows}

    def text(method: str, n: int, causal: bool, key: str, fmt) -> str:
        parts = [
            fmt(cell[method, n, causal, mode][key])
            for mode in ("fwd", "fwdbwd")
            if (method, n, causal, mode) in cell
        ]
        return " / ".join(parts) or "–"

    head = [f"{_size(n)}{' causal' if causal else ''}" for n, causal in cols]
    lines = ["| method | " + " | ".join(head) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in _methods(doc):
        cells = [text(m, n, c, "time_ratio", lambda x: f"{x:.1f}") for n, c in cols]
        lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    sdpa = []
    for n, c in cols:
        first = next(
            r["method"] for r in rows if (r["n"], r["causal"]) == (n, c) and "sdpa_ms" in r
        )
        sdpa.append(text(first, n, c, "sdpa_ms", lambda x: f"{x:.2f}"))
    lines.append("| SDPA, ms | " + " | ".join(sdpa) + " |")
    return "\n".join(lines)


# --- the blocks ------------------------------------------------------------------------------


def summary(results: Path) -> str:
    tiles, triton = load("gpu.json", results), load("gpu_bf16_triton.json", results)
    parts = []
    if tiles is None:
        parts.append(not_measured("gpu.json"))
    else:
        big = (4096, 16384)
        parts.append(
            f"On the PyTorch tiles, in {tiles['dtype']}, 4k and 16k keys, time as a ratio to SDPA "
            "on the same GPU (forward and forward+backward, `benchmarks/gpu.py`): the softmax "
            f"family {_range(_ratios(tiles, SOFTMAX, big))}; `sink` "
            f"{_range(_ratios(tiles, ('sink',), big))}; the element-wise and row-normalised maps "
            f"{_range(_ratios(tiles, ELEMENTWISE, big))}; adaptive "
            f"{_range(_ratios(tiles, ('adaptive',), big))}; stick-breaking "
            f"{_range(_ratios(tiles, ('stick_breaking',), big))}; top-k and the sparse maps "
            f"{_range(_ratios(tiles, SPARSE, big))} (α = 1.3: "
            f"{_range(_ratios(tiles, ('entmax@alpha=1.3',), big))}).\n"
            + provenance(tiles, "gpu.json")
        )
    if triton is None:
        parts.append(not_measured("gpu_bf16_triton.json"))
    else:
        fwd = {"sizes": (16384,), "mode": "fwd"}
        parts.append(
            f"On the Triton kernels, in {triton['dtype']} (a partial run), forward at 16k keys, "
            "as a ratio to SDPA as torch picked it: the element-wise and row-normalised maps "
            f"{_range(_ratios(triton, ELEMENTWISE, **fwd))}, `sink` "
            f"{_range(_ratios(triton, ('sink',), **fwd))}, adaptive "
            f"{_range(_ratios(triton, ('adaptive',), **fwd))}.\n"
            + provenance(triton, "gpu_bf16_triton.json")
        )
    return "\n\n".join(parts)


def float32(results: Path) -> str:
    doc = load("gpu.json", results)
    if doc is None:
        return not_measured("gpu.json")
    top = max(r["n"] for r in doc["rows"])
    big = [r for r in doc["rows"] if r["n"] == top and r["mode"] == "fwdbwd"]
    sdpa = max(r["sdpa_extra_mib"] for r in big)
    sink = max((r["extra_mib"] for r in big if r["method"] == "sink"), default=None)
    most = max(big, key=lambda r: r["extra_mib"] if r["method"] != "sink" else 0)
    memory = (
        f"Peak GPU memory above the inputs at {_size(top)}, forward+backward: SDPA "
        f"{sdpa:.0f} MiB"
        + (f", `sink` {sink:.0f} MiB" if sink is not None else "")
        + f", every other method at most {most['extra_mib']:.0f} MiB ({most['method']})."
    )
    return "\n\n".join(
        [
            provenance(doc, "gpu.json") + f" {doc['dtype']}, B = {doc['shape']['B']}, "
            f"H = {doc['shape']['H']}, D = {doc['shape']['D']}; forward / forward+backward.",
            ratio_table(doc),
            memory,
        ]
    )


def tiles(results: Path) -> str:
    runs = [("CPU's (1×)", "gpu_tiles1.json"), ("64×", "gpu_tiles64.json")]
    docs = [(label, name, load(name, results)) for label, name in runs]
    missing = [name for _, name, doc in docs if doc is None]
    if missing:
        return "\n\n".join(not_measured(name) for name in missing)
    methods = _methods(docs[0][2])
    head = ["tiles", *(LABELS.get(m, m) for m in methods), "most memory at 16k"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, _, doc in docs:
        cells = [
            f"{_range(_ratios(doc, (m,), mode='fwd'))} / {_range(_ratios(doc, (m,), mode='fwdbwd'))}"
            for m in methods
        ]
        top = max(r["n"] for r in doc["rows"])
        peak = max(r["extra_mib"] for r in doc["rows"] if r["n"] == top)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {peak:,.0f} MiB |")
    sizes = [_size(n) for n in sorted({r["n"] for _, _, doc in docs for r in doc["rows"]})]
    return "\n".join(
        [
            *(provenance(doc, name) for _, name, doc in docs),
            "",
            f"{docs[0][2]['dtype']}, {' and '.join(sizes)}, causal and not; the range over those "
            "cells, forward / forward+backward:",
            "",
            *lines,
        ]
    )


def bfloat16(results: Path) -> str:
    doc = load("gpu_bf16.json", results)
    if doc is None:
        return not_measured("gpu_bf16.json")
    big = (4096, 16384)
    text = (
        "On the tiles in bfloat16 at 4k and 16k, the ratios to SDPA are "
        f"{_range(_ratios(doc, ELEMENTWISE, big))} for the element-wise maps, "
        f"{_range(_ratios(doc, ('adaptive',), big))} adaptive, "
        f"{_range(_ratios(doc, SPARSE, big))} top-k and the sparse maps (α = 1.3: up to "
        f"{_num(max(_ratios(doc, ('entmax@alpha=1.3',), big)))}×), "
        f"{_range(_ratios(doc, ('stick_breaking',), big))} stick-breaking; the softmax family "
        f"{_range(_ratios(doc, SOFTMAX, big))}, `sink` {_range(_ratios(doc, ('sink',), big))}."
    )
    f32 = load("gpu.json", results)
    if f32 is not None:
        sdpa32 = {(r["n"], r["causal"], r["mode"]): r["sdpa_ms"] for r in f32["rows"]}
        faster = [
            sdpa32[key] / r["sdpa_ms"]
            for r in doc["rows"]
            if (key := (r["n"], r["causal"], r["mode"])) in sdpa32 and r["n"] in big
        ]
        text += f" SDPA itself is {_range(faster)} faster than in float32 (`gpu.json`) there."
    return text + "\n" + provenance(doc, "gpu_bf16.json")


def triton(results: Path) -> str:
    doc = load("gpu_bf16_triton.json", results)
    if doc is None:
        return not_measured("gpu_bf16_triton.json")
    fwd = {"sizes": (16384,), "mode": "fwd"}
    small = [r for r in doc["rows"] if r["n"] <= 4096]
    sdpa = {}
    for mode in ("fwd", "fwdbwd"):
        ms = [r["sdpa_ms"] for r in small if r["mode"] == mode and "sdpa_ms" in r]
        sdpa[mode] = f"{min(ms):.2f}-{max(ms):.2f}"
    return "\n\n".join(
        [
            provenance(doc, "gpu_bf16_triton.json") + f" {doc['dtype']}, B = "
            f"{doc['shape']['B']}, H = {doc['shape']['H']}, D = {doc['shape']['D']}; forward / "
            "forward+backward (one number: forward only).",
            ratio_table(doc),
            "At 16k keys, forward, where the GPU's arithmetic dominates: the element-wise and "
            f"row-normalised maps {_range(_ratios(doc, ELEMENTWISE, **fwd))} SDPA, `sink` "
            f"{_range(_ratios(doc, ('sink',), **fwd))}, adaptive temperature "
            f"{_range(_ratios(doc, ('adaptive',), **fwd))}. At 1k-4k one SDPA call takes "
            f"{sdpa['fwd']} ms forward and {sdpa['fwdbwd']} ms forward+backward, mostly launches "
            "and Python, so those columns measure each path's per-call overhead more than its "
            "kernels.",
        ]
    )


def compiled(results: Path) -> str:
    doc = load("gpu_compile_bf16.json", results)
    if doc is None:
        return not_measured("gpu_compile_bf16.json")
    sys.path.insert(0, str(HERE))
    import gpu_compile

    return (
        gpu_compile.header(doc)
        + " (`benchmarks/results/gpu_compile_bf16.json`).\n\n"
        + gpu_compile.table(doc["rows"], doc.get("sdpa"), doc.get("failed"))
    )


#: block name → (page, renderer)
BLOCKS: dict[str, tuple[str, Callable[[Path], str]]] = {
    "summary": ("docs/performance.md", summary),
    "float32": ("docs/performance.md", float32),
    "tiles": ("docs/performance.md", tiles),
    "bfloat16": ("docs/performance.md", bfloat16),
    "triton-bf16": ("docs/performance.md", triton),
    "compiled": ("docs/performance.md", compiled),
}


def render(results: Path = RESULTS) -> dict[str, str]:
    """Every block's Markdown, by name."""
    return {name: fn(results).strip() for name, (_, fn) in BLOCKS.items()}


def fill(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each marked block's body replaced by its rendering (unknown names stay)."""

    def sub(m: re.Match) -> str:
        name = m["name"]
        if name not in blocks:
            return m[0]
        return f"{BEGIN.format(name=name)}\n{blocks[name]}\n{END}"

    return BLOCK.sub(sub, text)


def stale(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """The blocks whose page text differs from their rendering, or that no page has."""
    blocks = render(results)
    bad = []
    for name, (page, _) in BLOCKS.items():
        text = (root / page).read_text()
        found = {m["name"]: m["body"] for m in BLOCK.finditer(text)}
        if name not in found:
            bad.append(f"{page}: no block {name!r}")
        elif found[name].strip() != blocks[name]:
            bad.append(f"{page}: block {name!r} differs from the result files")
    return bad


def write(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    blocks = render(results)
    changed = []
    for page in sorted({page for page, _ in BLOCKS.values()}):
        path = root / page
        text = path.read_text()
        new = fill(text, blocks)
        if new != text:
            path.write_text(new)
            changed.append(page)
    return changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="report stale blocks, change nothing")
    args = p.parse_args(argv)
    if args.check:
        bad = stale()
        for line in bad:
            print(line)
        if bad:
            print(f"regenerate with: {COMMAND}")
        return 1 if bad else 0
    for page in write():
        print(f"wrote {page}")
    missing = stale()
    for line in missing:
        print(line)
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
