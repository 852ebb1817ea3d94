"""softmax with temperature, and adaptive-temperature softmax (Veličković et al., Fig. 4)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ._contract import masked_softmax, normalizer, prepare
from .families import Adaptive, Kernel, RowScaled
from .registry import Normalizer, Param, register
from .stats import entropy

__all__ = [
    "ADAPTIVE",
    "COEFFICIENTS",
    "SOFTMAX",
    "adaptive",
    "adaptive_beta",
    "beta_from_entropy",
    "entropy_crossings",
    "polyval",
    "resolve_coefficients",
    "softmax",
]

Tensor = torch.Tensor

#: Adaptive-temperature polynomials β = polyval(c, H), highest power first (as numpy.polyval).
#: "icml": the ICML version's Figure 4 code; "arxiv": the earlier version's code (its Figure 5
#: caption lists them reversed; the code is right). They differ for high entropy: β(4) = 2.39 vs
#: 1.57, β(5) = 2.29 vs clipped to 1. `entropy_crossings` gives where each falls below 1
#: (ICML: H ≈ 5.94; earlier: H ≈ 4.59), from where the floor makes β = 1.
COEFFICIENTS: dict[str, tuple[float, ...]] = {
    "icml": (-0.037, 0.481, -2.3, 4.917, -1.791),
    "arxiv": (-0.04, 0.48, -2.3, 4.92, -1.79),
}


@normalizer
def softmax(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    check_finite: bool = True,
) -> Tensor:
    """softmax_θ(e)_k = exp(e_k/θ) / Σ_l exp(e_l/θ) over the allowed keys of each row.

    Lemma 2.1 (Veličković et al.): with logits in [m, M] and δ = M − m, every weight lies in
    [(1/n)·e^{−δ/θ}, (1/n)·e^{δ/θ}], so it disperses as n grows.

    Computed as softmax((s − max s)/θ), so no θ > 0 overflows: a tiny θ (1e-9 on 1e30 scores,
    or 1e-39, whose 1/θ is beyond float32) gives the arg-max limit, one-hot with ties shared,
    and θ = inf the uniform row; never NaN.
    """
    return SOFTMAX.weights(scores, mask, check_finite=check_finite, temperature=temperature)


def _inverse_temperature(n: None, temperature: float | Tensor = 1.0, **_) -> float | Tensor:
    """softmax_θ's β = 1/θ, the same for every row."""
    return 1.0 / temperature


SOFTMAX = RowScaled(_inverse_temperature, counts=False)


def resolve_coefficients(coefficients: str | Sequence[float] | Path) -> tuple[float, ...]:
    """A coefficient set by name ("icml", "arxiv"), by JSON file path, or as numbers.

    A JSON file holds a list of numbers, or an object with a "coefficients" list (as
    ``sharpattn fit-temperature`` writes), highest power first.
    """
    if isinstance(coefficients, str) and coefficients in COEFFICIENTS:
        return COEFFICIENTS[coefficients]
    if isinstance(coefficients, (str, Path)):
        path = Path(coefficients)
        if not path.is_file():
            raise ValueError(
                f"coefficients {str(coefficients)!r} are neither a known set "
                f"({', '.join(COEFFICIENTS)}) nor an existing JSON file."
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a valid JSON file of coefficients ({e}).") from None
        if isinstance(data, dict) and "coefficients" not in data:
            raise ValueError(
                f'{path} has no "coefficients" entry: expected {{"coefficients": [...]}} or a list.'
            )
        coefficients = data["coefficients"] if isinstance(data, dict) else data
    try:
        values = tuple(float(c) for c in coefficients)
    except (TypeError, ValueError):
        raise ValueError(
            f"coefficients must be a name ({', '.join(COEFFICIENTS)}), a JSON path or a sequence "
            f"of numbers, got {coefficients!r}."
        ) from None
    if not values or not all(math.isfinite(c) for c in values):
        raise ValueError(f"coefficients must be a non-empty sequence of finite numbers: {values}.")
    return values


def polyval(coefficients: Sequence[float], x: Tensor) -> Tensor:
    """Σ_i c_i·x^(deg−i), highest power first (numpy.polyval), by Horner's rule; differentiable."""
    out = torch.zeros_like(x)
    for c in coefficients:
        out = out * x + c
    return out


def entropy_crossings(
    coefficients: str | Sequence[float] = "icml", level: float = 1.0, above: float = 0.5
) -> list[float]:
    """The entropies H > ``above`` where the polynomial β(H) equals ``level`` (ascending).

    With ``level=1`` the last one is where β falls to the floor (softmax from there on); with
    ``level=0`` where App. F's θ = 1/poly(H) would turn negative.
    """
    import numpy as np

    c = np.array(resolve_coefficients(coefficients), dtype=np.float64)
    c[-1] -= level
    roots = np.roots(c)
    real = roots[np.abs(roots.imag) < 1e-9].real
    return sorted(float(r) for r in real if r > above)


def adaptive_beta(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    coefficients: str | Sequence[float] = "icml",
    threshold: float = 0.5,
    floor: float = 1.0,
    check_finite: bool = True,
) -> Tensor:
    """β = 1/θ of adaptive temperature for each row, ``[..., Lq, 1]`` (Veličković et al., Fig. 4).

    p = softmax(scores); H = −Σ p·log(p + 1e-9) over the allowed keys;
    β = max(polyval(c, H), floor) where H > threshold, else 1.
    """
    s, allowed = prepare(scores, mask, check_finite)
    return _beta(masked_softmax(s, allowed), resolve_coefficients(coefficients), threshold, floor)


def _beta(p: Tensor, coefficients: Sequence[float], threshold: float, floor: float) -> Tensor:
    h = entropy(p, eps=1e-9).unsqueeze(-1)  # the reference code's entropy
    return beta_from_entropy(h, coefficients, threshold, floor)


def beta_from_entropy(
    h: Tensor, coefficients: Sequence[float], threshold: float, floor: float
) -> Tensor:
    """β(H) = max(polyval(c, H), floor) where H > threshold, else 1 (Veličković et al., Fig. 4).

    Shared by [`adaptive`][sharpattn.normalizers.softmax.adaptive] and the streamed (fused) adaptive attention path.
    """
    return torch.where(
        h > threshold,  # don't overcorrect low-entropy heads
        torch.clamp_min(polyval(coefficients, h), floor),  # never increase entropy
        torch.ones_like(h),
    )


@normalizer
def adaptive(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    coefficients: str | Sequence[float] = "icml",
    threshold: float = 0.5,
    floor: float = 1.0,
    detach_beta: bool = False,
    check_finite: bool = True,
) -> Tensor:
    """Adaptive-temperature softmax: softmax(β·e) with β = max(poly(H(softmax(e))), 1).

    Exactly the reference code (Veličković et al., Figure 4): p = softmax(e);
    H = −Σ p·log(p + 1e-9); β = max(polyval(c, H), floor) where H > threshold, else 1;
    weights = softmax(β·e). Gradients flow through β (plain differentiable operations) unless
    ``detach_beta=True``.
    """
    return ADAPTIVE.weights(
        scores,
        mask,
        check_finite=check_finite,
        coefficients=coefficients,
        threshold=threshold,
        floor=floor,
        detach_beta=detach_beta,
    )


def _adaptive_rows(
    h: Tensor, coefficients="icml", threshold=0.5, floor=1.0, detach_beta=False, **_
) -> Tensor:
    """adaptive's β of rows whose softmax has entropy h (`beta_from_entropy`)."""
    beta = beta_from_entropy(h, resolve_coefficients(coefficients), threshold, floor)
    return beta.detach() if detach_beta else beta


#: the reference code's entropy −Σ p·log(p + 1e-9) on the naive path; C++ slabs on the CPU
ADAPTIVE = Adaptive(
    _adaptive_rows, entropy_eps=1e-9, kernel=Kernel("adaptive", cpp=True, triton=True)
)


softmax = register(
    Normalizer(
        name="softmax",
        fn=softmax,
        formula="exp(s_i/θ) / Σ_j exp(s_j/θ)",
        citation="Bridle 1990; Vaswani et al. 2017",
        sums_to_one=True,
        params=(
            Param(
                "temperature",
                1.0,
                "θ > 0; scores are divided by it (inf: the uniform row)",
                low=0.0,
                low_open=True,
                finite=False,
                tensor=True,
            ),
        ),
        family=SOFTMAX,
    )
).fn
adaptive = register(
    Normalizer(
        name="adaptive",
        fn=adaptive,
        formula="softmax(β·s), β = max(poly(H(softmax(s))), 1) if H > 0.5 else 1",
        citation="Veličković et al. 2025, Softmax is not Enough (Fig. 4)",
        sums_to_one=True,
        params=(
            Param(
                "coefficients",
                "icml",
                "polynomial β(H): 'icml', 'arxiv', a JSON path or numbers",
                kind="any",
                validate=resolve_coefficients,
            ),
            Param("threshold", 0.5, "entropy at or below which β = 1"),
            Param("floor", 1.0, "lower bound of β where the correction applies"),
            Param("detach_beta", False, "stop gradients through β"),
        ),
        family=ADAPTIVE,
    )
).fn
