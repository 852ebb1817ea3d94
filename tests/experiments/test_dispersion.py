"""`sharpattn dispersion` (issue 3) and `sharpattn demo`, one module: the measured numbers, the run
folder, the CLI, the documentation's normalizer table."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from precision import assert_close
from sharpattn import normalizers as nz
from sharpattn.cli import main
from sharpattn.experiments import dispersion as disp
from sharpattn.lab import runner

DOCS = Path(__file__).resolve().parents[2] / "docs"
SIZES = (16, 64, 256, 1024)

pytestmark = pytest.mark.numerical


@pytest.fixture(scope="module")
def rows():
    return disp.measure(sizes=SIZES, margin=2.0, rows=16, seed=3)


def _by(rows, method):
    return {r.n: r for r in rows if r.method == method}


def test_softmax_numbers_match_numpy_and_lemma_2_1(rows):
    g = runner.generator(3, disp.STREAM_WINNER)
    for n in SIZES:
        s, where = disp.logits_with_winner(n, 16, 2.0, g)
        x = s[:, 0].numpy()
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        winner = p[np.arange(16), where.numpy()]
        r = _by(rows, "softmax")[n]
        # float64 weights of logits in [−1, 3] (relative error ≈ 3ε), means over 16 rows
        assert_close(r.winner_weight, winner.mean(), dtype=torch.float64, n=n, magnitude=3 / n)
        assert_close(r.max_weight, p.max(-1).mean(), dtype=torch.float64, n=n, magnitude=3 / n)
        h = (-(p * np.log(p)).sum(-1)).mean()
        assert_close(r.entropy, h, dtype=torch.float64, n=n, magnitude=3 * math.log(n))
        assert_close(r.total_mass, 1.0, dtype=torch.float64, n=n)
        # Lemma 2.1 with δ = (1 + margin) − min logit <= 4: e^{−δ}/n <= weight <= e^{δ}/n
        assert (winner * n <= math.exp(4.0)).all() and (winner * n >= math.exp(-4.0)).all()


def test_the_table_separates_dispersing_from_sharp_methods(rows):
    fit = disp.slopes(rows)
    assert -1.1 < fit["softmax"] < -0.8  # disperses as 1/n
    assert -1.05 < fit["relu"] < -0.95  # ReLU(s)/n: exactly the 1/n of its division
    for method in ("hardmax", "sparsemax", "entmax15"):  # margin 2 >= 1/(α−1): one-hot
        for r in _by(rows, method).values():  # one-hot rows in float64
            assert_close(r.winner_weight, 1.0, dtype=torch.float64, n=r.n)
        # a least-squares slope of log weights that are 0 up to rounding
        assert_close(fit[method], 0.0, dtype=torch.float64, n=len(SIZES), magnitude=1.0)
    assert abs(fit["ssmax"]) < 0.1 and abs(fit["topk"]) < 0.1
    sink = _by(rows, "sink")
    assert all(r.total_mass < 1 for r in sink.values())  # the rest is null attention
    relu = _by(rows, "relu")
    assert all(r.total_mass < 1 for r in relu.values())


def test_slopes_leave_out_underflowed_weights_and_say_so():
    row = disp.Row
    rows = [row("x", 16, 0.5, 0.5, 1.0, 1.0), row("x", 64, 0.0, 0.5, 1.0, 1.0)]
    assert math.isnan(disp.slopes(rows)["x"])  # one usable size: no slope
    assert disp.slope_text(rows)["x"] == "– (0 from n=64)"
    rows.insert(1, row("x", 32, 0.25, 0.5, 1.0, 1.0))
    assert_close(disp.slopes(rows)["x"], -1.0, dtype=torch.float64, n=2)  # 0.5 → 0.25: 1/n
    assert disp.vanishes_at(rows) == {"x": 64}
    assert disp.slope_text(rows)["x"] == "-1.00 (0 from n=64)"
    nan_rows = [row("y", 16, math.nan, 0.5, 1.0, 1.0), row("y", 64, math.nan, 0.5, 1.0, 1.0)]
    assert disp.slope_text(nan_rows)["y"] == "–"  # a method without a winner weight


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="unknown attention method 'nope'"):
        disp.measure(methods=["nope"], sizes=(16,))
    with pytest.raises(ValueError, match="sizes must all be >= 2"):
        disp.measure(sizes=(1,))
    with pytest.raises(ValueError, match="margin must be a finite number > 0"):
        disp.measure(sizes=(16,), margin=0)


def test_demo_numbers_match_numpy_and_lemma_2_1():
    rows = disp.measure_demo(sizes=(16, 256), rows=8, margin=2.0, seed=5)
    assert [(r.setting, r.method, r.n) for r in rows[:4]] == [
        ("bounded", "softmax", 16),
        ("bounded", "adaptive", 16),
        ("bounded", "softmax", 256),
        ("bounded", "adaptive", 256),
    ]
    g = runner.generator(5, disp.STREAM_DEMO)
    for n in (16, 256):  # the bounded setting draws its rows from a fresh generator
        x = disp.demo_logits(n, 8, None, g)[:, 0].numpy()
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        r = next(r for r in rows if (r.setting, r.method, r.n) == ("bounded", "softmax", n))
        assert_close(r.max_weight, p.max(-1).mean(), dtype=torch.float64, n=n, magnitude=3 / n)
        h = (-(p * np.log(p)).sum(-1)).mean()
        assert_close(r.entropy, h, dtype=torch.float64, n=n, magnitude=3 * math.log(n))
        spread = x.max(-1) - x.min(-1)
        assert_close(r.lemma_bound, np.exp(spread).max(), dtype=torch.float64, n=n, magnitude=8.0)
        assert math.isnan(r.winner_weight)
    for r in rows:
        assert r.n_max_weight <= r.lemma_bound  # Lemma 2.1 (θ = 1/β for adaptive)
    margin = [r for r in rows if r.setting == "margin" and r.method == "softmax"]
    assert margin[0].winner_weight > margin[1].winner_weight  # disperses as n grows
    with pytest.raises(ValueError, match="rows must be >= 1"):
        disp.measure_demo(sizes=(16,), rows=0)
    with pytest.raises(ValueError, match="margin must be a finite number > 0"):
        disp.measure_demo(sizes=(16,), margin=math.inf)


def test_cli_writes_a_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "dispersion",
            "--methods",
            "softmax,sink",
            "--sizes",
            "16,64",
            "--rows",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    for name in ("config.json", "metrics.json", "winner_weight.png", "report.md"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert [(m["method"], m["n"]) for m in metrics] == [
        ("softmax", 16),
        ("sink", 16),
        ("softmax", 64),
        ("sink", 64),
    ]
    assert "winner weight vs n" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "softmax,nope"], "unknown attention method 'nope'"),
        (["--sizes", "16,x"], "expected comma-separated integers"),
        (["--margin", "-1"], "--margin"),
    ],
)
def test_cli_user_errors_are_one_line_exit_2(tmp_path, capsys, args, message):
    assert main(["dispersion", *args, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_list_markdown_prints_the_registry_table(capsys):
    assert main(["list", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == nz.markdown_table()


def test_markdown_table_covers_every_normalizer_and_escapes_pipes():
    table = nz.markdown_table().splitlines()
    assert len(table) == 2 + len(nz.available())
    for line, name in zip(table[2:], nz.available(), strict=True):
        assert line.startswith(f"| `{name}` |")
        assert len(re.findall(r"(?<!\\)\|", line)) == 7  # 6 columns, pipes in formulas escaped


def test_docs_normalizer_table_is_the_generated_one():
    text = (DOCS / "normalizers.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- normalizers:start -->(.*?)<!-- normalizers:end -->", text, re.S)
    assert section, "docs/normalizers.md lacks the normalizers section markers"
    assert nz.markdown_table() in section.group(1), (
        "docs/normalizers.md's table is stale: regenerate it with "
        "`python docs/update_normalizers.py --table`."
    )
    assert "(dispersion.png)" in section.group(1)
    assert (DOCS / "dispersion.png").is_file()


# ---------------------------------------------------------------- Smith's toys (issue 15, item 10)


def _np_softmax(x: np.ndarray) -> np.ndarray:
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_smith_scores_reproduce_the_blogs_quoted_shares():
    s = disp.smith_scores()
    shifted = s - s.min()
    share = shifted / shifted.sum()
    for token, quoted in disp.SMITH_QUOTED["sum"].items():
        # shares of 10 float64 terms of size ≤ 11 (a few ε)
        assert_close(share[token], quoted, dtype=torch.float64, n=10)
    # brentq stops at xtol = 1e-12 on the scale c ≈ 36; d(share)/dc ≤ 0.3·0.01: error ≪ 1e-12
    assert abs(_np_softmax(s)[disp.SMITH_WINNER] - 0.99) < 1e-12
    others = [i for i in range(1, 10) if i not in disp.SMITH_QUOTED["sum"]]
    assert np.all(share[others] == share[others[0]])  # the rest shared equally ("and so on")
    assert s.min() == 0.0 and np.argmin(s) == 0
    with pytest.raises(ValueError, match="rest"):
        disp.smith_scores({6: 0.7, 7: 0.3})


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_smith_toy_rows_match_numpy(seed):
    """The sum, softmax and x³ rows against NumPy float64, on the rebuilt scores and on random
    ones (both signs)."""
    s = disp.smith_scores() if seed is None else np.random.default_rng(seed).normal(0, 3, 10)
    toy = disp.smith_toy(s)
    u = s - s.min()
    expect = {"sum": u / u.sum(), "softmax": _np_softmax(s), "x^3": u**3 / (u**3).sum()}
    mag = 1 + float(np.abs(s).max())  # the rounding of exp(s − max s) is relative ε·|s|
    for name, row in expect.items():
        assert_close(toy[name], row, dtype=torch.float64, n=10, magnitude=mag)


def test_gaussian_dispersion_matches_numpy():
    sizes, rows, seed = (2, 5, 25, 1000), 400, 5
    got = disp.gaussian_dispersion(sizes, rows=rows, seed=seed)
    g = runner.generator(seed, disp.STREAM_GAUSSIAN)
    for r, n in zip(got, sizes, strict=True):
        p = _np_softmax(disp.gaussian_logits(n, rows, g).numpy())
        top, h = p.max(-1), -(p * np.log(p)).sum(-1)
        # float64 means of `rows` values, each a reduction over n terms of logits |s| ≲ 5
        kw = dict(dtype=torch.float64, n=n * rows)
        assert_close(r.max_weight, top.mean(), **kw)
        assert_close(r.max_weight_se, top.std(ddof=1) / math.sqrt(rows), **kw)
        assert_close(r.entropy, h.mean(), magnitude=6 * math.log(n), **kw)
        assert_close(r.entropy_se, h.std(ddof=1) / math.sqrt(rows), magnitude=6 * math.log(n), **kw)
        assert_close(r.effective_support, (1 / (p**2).sum(-1)).mean(), magnitude=n, **kw)
        assert r.log_n == math.log(n)
    assert [r.max_weight for r in got] == sorted((r.max_weight for r in got), reverse=True)
    assert all(r.entropy < r.log_n for r in got)


def test_gaussian_dispersion_at_two_items_matches_the_integral():
    """At n = 2 the max weight is σ(|x₁ − x₂|), x₁ − x₂ ~ N(0, 2): its mean by quadrature, and
    the Monte-Carlo mean within 5 standard errors of it (fails by chance with p ≈ 6e-7)."""
    from scipy import integrate, stats

    (r,) = disp.gaussian_dispersion((2,), rows=4000, seed=11)
    d = stats.norm(scale=math.sqrt(2))
    mean_top = 2 * integrate.quad(lambda t: d.pdf(t) / (1 + math.exp(-t)), 0, np.inf)[0]
    assert abs(r.max_weight - mean_top) < 5 * r.max_weight_se

    def h2(t):
        p = 1 / (1 + math.exp(-t))
        return -(p * math.log(p) + (1 - p) * math.log1p(-p)) if 0 < p < 1 else 0.0

    mean_h = 2 * integrate.quad(lambda t: d.pdf(t) * h2(t), 0, 40)[0]
    assert abs(r.entropy - mean_h) < 5 * r.entropy_se


def test_gaussian_dispersion_bad_arguments():
    with pytest.raises(ValueError, match="sizes"):
        disp.gaussian_dispersion((0,))
    with pytest.raises(ValueError, match="rows"):
        disp.gaussian_dispersion((2,), rows=1)
