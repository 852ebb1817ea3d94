"""Dispersion as n grows: `sharpattn demo` (softmax vs adaptive temperature, Lemma 2.1) and
`sharpattn dispersion` (which normalizers keep a winner's weight).

For each size n: rows of n logits uniform in [−1, 1].

`sharpattn demo` (`run_demo`, the main job): those rows ("bounded"), and the same with one
"winner" item whose logit is 1 + margin ("margin"). For softmax and adaptive temperature: mean max
weight, entropy, the winner's weight and n·max weight, which Lemma 2.1 bounds by e^δ (δ = max − min
logit, θ = 1); the CLI then runs the dispersion table below over every method.

`sharpattn dispersion` (`run`): one logit per row (at a random position) replaced by a
winner at 1 + margin. For each normalizer: the winner's weight, the largest |weight|, the entropy
of the row (of |w| / Σ|w|, so unnormalised rows are comparable) and the total mass Σ|w|.
Lemma 2.1 (Veličković et al.): softmax's winner weight is at most e^{δ}/n (δ = 2 + margin, the
row's logit spread), so it falls as 1/n; the fitted log-log slope of winner weight vs n shows
which alternatives keep it (slope ~0) and which disperse (slope ~−1).

The modules: `winner` (`sharpattn dispersion`), `smith` (the blog's toys, part of that
command's report) and `demo` (`sharpattn demo`); this one re-exports their public names.
"""

from __future__ import annotations

from .demo import (
    DEMO_METHODS,
    DEMO_SIZES,
    STREAM_DEMO,
    DemoRow,
    adaptive_note,
    demo_logits,
    demo_markdown_table,
    measure_demo,
    plot_demo,
    run_demo,
)
from .smith import (
    SMITH_QUOTED,
    SMITH_SIZES,
    SMITH_TOKENS,
    SMITH_WINNER,
    STREAM_GAUSSIAN,
    GaussianRow,
    gaussian_dispersion,
    gaussian_logits,
    read_smith,
    smith_gauss_markdown,
    smith_markdown,
    smith_scores,
    smith_toy,
    smith_toy_markdown,
)
from .winner import (
    DEFAULT_SIZES,
    METHOD_PARAMS,
    PLOT_FLOOR,
    STREAM_WINNER,
    Row,
    check_sizes,
    logits_with_winner,
    markdown_table,
    measure,
    plot,
    run,
    slope_text,
    slopes,
    uniform_logits,
    vanishes_at,
    winner_markdown,
    write_run,
)

__all__ = [
    "DEFAULT_SIZES",
    "DEMO_METHODS",
    "DEMO_SIZES",
    "DemoRow",
    "GaussianRow",
    "METHOD_PARAMS",
    "PLOT_FLOOR",
    "Row",
    "SMITH_QUOTED",
    "SMITH_SIZES",
    "SMITH_TOKENS",
    "SMITH_WINNER",
    "STREAM_DEMO",
    "STREAM_GAUSSIAN",
    "STREAM_WINNER",
    "adaptive_note",
    "check_sizes",
    "demo_logits",
    "demo_markdown_table",
    "gaussian_dispersion",
    "gaussian_logits",
    "logits_with_winner",
    "markdown_table",
    "measure",
    "measure_demo",
    "plot",
    "plot_demo",
    "read_smith",
    "run",
    "run_demo",
    "slope_text",
    "slopes",
    "smith_gauss_markdown",
    "smith_markdown",
    "smith_scores",
    "smith_toy",
    "smith_toy_markdown",
    "uniform_logits",
    "vanishes_at",
    "winner_markdown",
    "write_run",
]
