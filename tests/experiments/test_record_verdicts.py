"""The results pages quote what `benchmarks/record_verdicts.py` recomputes from the records in
docs/records: Table 1's verdict table row for row, and the CLRS-LLM, regulariser and
selective-LLM numbers the pages cite."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "softmax-is-not-enough.md"


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> str:
    spec = importlib.util.spec_from_file_location(
        "record_verdicts", ROOT / "benchmarks" / "record_verdicts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(["all"])
    return out.getvalue()


def section(text: str, study: str) -> str:
    """The part of the script's output for ``study``."""
    return text.split(f"## {study} (")[1].split("\n## ")[0]


def page_minus(s: str) -> str:
    """The pages write negative numbers with U+2212."""
    return re.sub(r"(?<![\w])-(?=\d)", "−", s)


def test_table_1s_verdicts_on_the_page_are_the_records(printed):
    page = PAGE.read_text()
    rows = [
        line
        for line in section(printed, "max-retrieval").splitlines()
        if re.match(r"\| [\d,]+ \| [+-]", line)
    ]
    assert len(rows) == 11
    for row in rows:
        assert row in page, row


def test_the_clrs_llm_numbers_on_the_pages_are_the_records(printed):
    out = section(printed, "clrs-llm-offfloor")
    page = PAGE.read_text()
    assert "Holm over 7 exact-match cells and 12 answer-token cells" in out
    # the one answer-token cell that survives Holm over 12
    [row] = [r for r in out.splitlines() if r.startswith("| insertion_sort | 12 |")]
    assert row.endswith("| -0.078 | [-0.109, -0.046] | 0.0024 | 0.029 | contradicted |")
    assert sum(r.endswith("| contradicted |") for r in out.splitlines()) == 1
    assert page_minus("−0.078 [-0.109, -0.046] (p = 0.0024, 0.029 after Holm)") in page
    # insertion_sort pooled beyond training, before and after Holm over the algorithms
    assert "| insertion_sort | 0.027 | 0.005 | -0.022 | [-0.041, -0.002] | 0.036 | 0.11 |" in out
    assert page_minus("(-0.022 [-0.041, -0.002], p = 0.036)") in page and "(0.11)" in page
    # the detectable range by cell, exact match, at α/m = 0.05/7
    cells = [r.split(" | ") for r in out.splitlines() if re.match(r"\| \w+ \| \d+ \|", r)]
    detect = [float(c[6]) for c in cells if "detectable at α/m = 0.05/7" in c[7]]
    assert f"{min(detect):.2f}-{max(detect):.2f}" == "0.07-0.74"
    assert "0.07-0.74 in exact match at α/m = 0.05/7" in page


def test_the_selective_llm_sharing_numbers_on_the_page_are_the_records(printed):
    out = section(printed, "selective-llm-sharing")
    page = (ROOT / "docs" / "selective-attention.md").read_text()
    rows = [r.split(" | ") for r in out.splitlines() if re.match(r"\| [\d,]+ \| [+-]", r)]
    assert len(rows) == 3
    for cells in rows:
        change, interval = cells[1], cells[2]
        quoted = (page_minus(f"{change} nats {interval}"), page_minus(f"{change} {interval}"))
        assert any(q in page for q in quoted), cells


def test_the_leaderboard_records_numbers_on_the_page_are_the_records(printed):
    """The NAPE table's effects and the test-sampling ratios the page quotes; the shifted
    stick-breaking's effect on copy."""
    page = (ROOT / "docs" / "leaderboard.md").read_text()
    nape = section(printed, "leaderboard-nape")
    assert "| overall | asentmax | 3 | -0.008 | [-0.063, +0.047] | 0.59 | 0.59 |" in nape
    assert page_minus("| -0.008 [-0.063, +0.047] | 0.59 | 0.144 |") in page
    ratio = {
        c[1]: float(c[-1].strip(" |"))
        for c in (r.split(" | ") for r in nape.splitlines() if r.startswith("| flip_flop |"))
        if len(c) == 6
    }
    assert f"{ratio['asentmax']:.1f}× the seeds' sd for ASEntmax" in page
    assert f"and {ratio['softmax']:.1f}× for softmax" in page
    shift = section(printed, "leaderboard-sb-shift")
    assert "| copy | stick_breaking_shifted | 3 | -0.022 | [-0.030, -0.015] |" in shift
    assert page_minus("-0.022 [-0.030, -0.015] (0.006) on `copy`") in page


def test_the_power_boards_numbers_on_the_page_are_the_records(printed):
    """Every overall comparison of the power board's table (effect, interval, Holm p and the
    80 %-power difference) and its median detectable difference, as the record gives them."""
    page = (ROOT / "docs" / "leaderboard.md").read_text()
    power = section(printed, "leaderboard-power")
    rows = [r for r in power.splitlines() if r.startswith("| overall |")]
    assert len(rows) == 23
    for row in rows:
        _, method, _, effect, interval, _, holm, _, detect, _ = (
            c.strip() for c in row.strip("|").split("|")
        )
        assert page_minus(f"| {effect} {interval} | {holm} | {detect} |") in page, method
    median = re.search(r"a median (\d\.\d+) \(range", power).group(1)
    assert f"Its median detectable difference against softmax is {median}." in page
    assert f"comparisons is **{median}**" in page


def test_the_backcopy_seed_verdicts_on_the_page_are_the_records(printed):
    """The page's sentences on which quick-profile verdicts change with the seed: each
    finding's verdicts over seeds 0-4, as the record's runs state them."""
    page = " ".join((ROOT / "docs" / "active-dormant-heads.md").read_text().split())
    verdicts = {}
    for row in section(printed, "backcopy-seeds").splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0][:1].isdigit():
            verdicts[int(cells[0].split(".")[0])] = cells[1:]
    yes, partly, no = "reproduced", "partly reproduced", "not reproduced"
    assert [n for n, v in verdicts.items() if len(set(v)) == 1] == [1, 5, 6, 7]
    assert "Findings 1, 5, 6 and 7 keep their verdict on all five seeds" in page
    assert verdicts[2] == [yes] + [partly] * 4
    assert 'Finding 2 is "yes" only on seed 0 and "partly" on seeds 1-4' in page
    assert verdicts[3] == [yes] + [partly] * 3 + [yes]
    assert 'Finding 3 is "yes" on seeds 0 and 4 and "partly" on 1-3' in page
    assert verdicts[4] == [no] * 3 + [partly] * 2
    assert 'Finding 4 is "not reproduced" on seeds 0-2 and "partly" on 3-4' in page
