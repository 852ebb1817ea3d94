"""Element-wise attention without a softmax: each weight depends on its own score and on n only.

Rows do not sum to one. Both divide out the length in the simplest way that keeps the output's
scale independent of n for uniform scores: sigmoid through a bias −log n, ReLU through 1/n.
"""

from __future__ import annotations

import torch

from ._contract import normalizer
from .families import Elementwise, Kernel, TileMaths, log_n, masked_
from .registry import Normalizer, Param, register

Tensor = torch.Tensor


@normalizer
def sigmoid(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    bias: float | Tensor = 0.0,
    subtract_log_n: bool = True,
    check_finite: bool = True,
) -> Tensor:
    """w_i = σ(s_i + b) with b = bias − log n (``subtract_log_n=True``, the default) or b = bias.

    Sigmoid attention (Ramapuram et al. 2024) recommends b = −log n; ``bias`` is an offset on
    top of it, learnable per head in [`MultiheadAttention`][sharpattn.MultiheadAttention]. Unnormalised.
    """
    return SIGMOID.weights(
        scores, mask, check_finite=check_finite, bias=bias, subtract_log_n=subtract_log_n
    )


def _sigmoid_f(s: Tensor, r) -> Tensor:
    return torch.sigmoid(s + r)


def _sigmoid_row(n: Tensor, bias: float | Tensor = 0.0, subtract_log_n: bool = True, **_):
    """sigmoid's shift of a row: b = bias − log n (or bias)."""
    return bias - log_n(n) if subtract_log_n else bias


class _SigmoidTiles(TileMaths):
    """w = σ(s + b), b = bias − log n per row (the row tensor)."""

    def weights(self, s, row, mask):
        return masked_(s.add_(row).sigmoid_(), mask)

    def grad(self, s, dp, row, mask):
        w = self.weights(s, row, mask)
        return w.neg().add_(1.0).mul_(w).mul_(dp), w  # σ' = w·(1 − w)


SIGMOID = Elementwise(
    _sigmoid_f,
    _sigmoid_row,
    kernel=Kernel("sigmoid", _SigmoidTiles, cpp=True, triton=True, row_grad=True),
)


@normalizer
def relu(
    scores: Tensor,
    mask: Tensor | None = None,
    *,
    p: float = 1.0,
    check_finite: bool = True,
) -> Tensor:
    """w_i = ReLU(s_i)^p / n: ReLU attention divided by the number of visible keys.

    As in the Active-Dormant heads code (Guo et al.): p = 1 by default. p must be >= 1 (for
    p < 1 the gradient at s = 0⁺ is infinite). Unnormalised, so the weights grow with the scores:
    with p > 1 a weight beyond the largest number of the scores' dtype (ReLU(1e30)² in float32,
    ReLU(1000)² in float16) can not be represented, and raises ``ValueError`` (unless
    ``check_finite=False``, which returns inf there).
    """
    w = RELU.weights(scores, mask, check_finite=check_finite, p=p)
    if check_finite and p != 1:
        bad = ~torch.isfinite(w)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"relu weights overflow {w.dtype} at position {where}: ReLU(s)^{p:g} of the score "
                f"{float(scores[where]):.3g} is too large; scale the scores down or use a smaller "
                "p."
            )
    return w


def _relu_f(s: Tensor, r, p: float = 1.0) -> Tensor:
    return torch.relu(s) ** p / r


def _relu_row(n: Tensor, **_) -> Tensor:
    """relu's divisor of a row: its visible keys n (at least 1)."""
    return n.clamp_min(1.0)


class _ReluTiles(TileMaths):
    """w = ReLU(s)^p / n, n per row (the row tensor, >= 1)."""

    P = 1.0

    def weights(self, s, row, mask):
        p = self.p
        r = s.relu_()
        return (r if p == 1 else r.pow_(p)).div_(row)  # disallowed scores are 0: weight 0

    def grad(self, s, dp, row, mask):
        p = self.p
        if p == 1:  # 1[s > 0] as sign(ReLU(s)): boolean masks are slow here (see masked_)
            ds = torch.relu(s).sign_().mul_(dp).div_(row)
        else:
            ds = torch.relu(s).pow_(p - 1).mul_(dp).mul_(p / row)
        return ds, self.weights(s, row, mask)


RELU = Elementwise(
    _relu_f, _relu_row, constants=("p",), kernel=Kernel("relu", _ReluTiles, cpp=True, triton=True)
)


sigmoid = register(
    Normalizer(
        name="sigmoid",
        fn=sigmoid,
        formula="σ(s_i + b − log n), b learnable per head (default 0)",
        citation="Ramapuram et al. 2024, Theory, Analysis, and Best Practices for Sigmoid Self-Attention",
        sums_to_one=False,
        family=SIGMOID,
        params=(
            Param("bias", 0.0, "offset b added to −log n", learnable=True),
            Param("subtract_log_n", True, "include −log n in the bias"),
        ),
    )
).fn
relu = register(
    Normalizer(
        name="relu",
        fn=relu,
        formula="ReLU(s_i)^p / n",
        citation="Guo et al. 2024, Active-Dormant Attention Heads",
        sums_to_one=False,
        family=RELU,
        params=(Param("p", 1.0, "power p >= 1", low=1.0),),
    )
).fn
