"""The ``entmax`` package's sparsemax, 1.5-entmax and α-entmax bisection, traceable by
``torch.compile``.

The package (Peters, Niculae & Martins; MIT) writes its ``torch.autograd.Function``s with
``@classmethod`` ``forward``/``backward``, which ``torch._dynamo`` cannot bind (a graph break, so
``torch.compile(..., fullgraph=True)`` of any entmax-family attention fails). These are the same
computations, operation for operation (so the same numbers), as ``@staticmethod`` Functions, with
the package's own threshold-and-support functions; only the full-sort form is used (no ``k``,
whose partial sort re-solves unsolved rows by a data-dependent ``torch.any`` branch). Nothing
here reads a tensor value on the host.
"""

from __future__ import annotations

import math

import torch
from entmax.activations import _entmax_threshold_and_support, _sparsemax_threshold_and_support

Tensor = torch.Tensor

#: α's numerically safe range [low, high] (the registry's ``alpha`` of entmax and asentmax).
#: Measured against a converged float64 reference (tests/contract/test_regressions.py, item 11):
#: near 1 the weights [(α−1)·s − τ]_+^{1/(α−1)} are 1/(α−1)-th powers of numbers near 1 whose
#: rounding u (the dtype's) becomes a relative error ~u/(α−1): float32 1e-8/(α−1) measured
#: (0.76 at α = 1 + 1e-9, 1e-4 at 1 + 1e-4, 1e-6 at 1.01), float64 2e-17/(α−1); entmax(α) −
#: softmax is ~1.8·(α−1) (measured, weights), so softmax stands in for it only below α − 1 ~
#: 1e-6 (float32) and 1e-14 (float64), and between those and ~1e-3 neither is within the dtype's
#: precision: below 1.01 α is refused (use softmax). Above 2 a key at the threshold gets weight
#: δ^{1/(α−1)} from a rounding δ of its score, a slope without bound: float32 within its
#: precision up to 2.5 (2e-5 at gain 10, n = 200), not at 3 (4e-5, at the tolerance) nor 3.5
#: (1.5e-3), 4 (1.5e-2), 10 (0.5); above 2.5 α is refused.
SAFE_ALPHA = (1.01, 2.5)


def bisect_steps(dtype: torch.dtype, keys: int, alpha_max: float) -> int:
    """Bisection steps that bring τ to the precision of ``dtype``: the bracket starts at most 1
    wide and |τ| >= n^{1−α} (n = ``keys``, the uniform row's), so the mantissa's bits plus
    (α−1)·log₂ n halvings, and two more (``alpha_max``: the largest α of the call)."""
    bits = -math.log2(torch.finfo(dtype).eps)
    return int(math.ceil(bits + (alpha_max - 1.0) * math.log2(max(keys, 2)))) + 2


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        max_val, _ = x.max(dim=dim, keepdim=True)
        x = x - max_val
        tau, supp_size = _sparsemax_threshold_and_support(x, dim=dim)
        output = torch.clamp(x - tau, min=0)
        ctx.save_for_backward(supp_size, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        supp_size, output = ctx.saved_tensors
        dim = ctx.dim
        grad_input = grad_output.masked_fill(output == 0, 0)  # the package: clone, [== 0] = 0
        v_hat = grad_input.sum(dim=dim) / supp_size.to(output.dtype).squeeze(dim)
        v_hat = v_hat.unsqueeze(dim)
        grad_input = torch.where(output != 0, grad_input - v_hat, grad_input)
        return grad_input, None


class _Entmax15(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        max_val, _ = x.max(dim=dim, keepdim=True)
        x = x - max_val
        x = x / 2
        tau_star, _ = _entmax_threshold_and_support(x, dim=dim)
        y = torch.clamp(x - tau_star, min=0) ** 2
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        gppr = y.sqrt()
        dx = dy * gppr
        q = dx.sum(ctx.dim) / gppr.sum(ctx.dim)
        q = q.unsqueeze(ctx.dim)
        dx = dx - q * gppr
        return dx, None


class _EntmaxBisect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, dim, n_iter):
        if not torch.is_tensor(alpha):
            alpha = torch.full((), alpha, dtype=x.dtype, device=x.device)  # no copy from the host
        alpha_shape = list(x.shape)
        alpha_shape[dim] = 1
        alpha = alpha.expand(*alpha_shape)
        ctx.dim = dim
        d = x.shape[dim]

        max_val, _ = x.max(dim=dim, keepdim=True)
        x = x * (alpha - 1)
        max_val = max_val * (alpha - 1)
        tau_lo = max_val - 1 ** (alpha - 1)
        tau_hi = max_val - (1 / d) ** (alpha - 1)
        dm = tau_hi - tau_lo
        for _ in range(n_iter):
            dm = dm / 2
            tau_m = tau_lo + dm
            p_m = torch.clamp(x - tau_m, min=0) ** (1 / (alpha - 1))
            f_m = p_m.sum(dim) - 1
            mask = (f_m >= 0).unsqueeze(dim)
            tau_lo = torch.where(mask, tau_m, tau_lo)
        p_m = p_m / p_m.sum(dim=dim).unsqueeze(dim=dim)  # ensure_sum_one
        ctx.save_for_backward(p_m, alpha)
        return p_m

    @staticmethod
    def backward(ctx, dy):
        y, alpha = ctx.saved_tensors
        dim = ctx.dim
        gppr = torch.where(y > 0, y ** (2 - alpha), y.new_zeros(1))
        dx = dy * gppr
        q = dx.sum(dim) / gppr.sum(dim)
        q = q.unsqueeze(dim)
        dx = dx - q * gppr
        d_alpha = None
        if ctx.needs_input_grad[1]:
            s = torch.where(y > 0, y * torch.log(y), y.new_zeros(1))
            ent = s.sum(dim).unsqueeze(dim)
            y_skewed = gppr / gppr.sum(dim).unsqueeze(dim)
            d_alpha = dy * (y - y_skewed) / ((alpha - 1) ** 2)
            d_alpha = d_alpha - dy * (s - y_skewed * ent) / (alpha - 1)
            d_alpha = d_alpha.sum(dim).unsqueeze(dim)
        return dx, d_alpha, None, None


def sparsemax(x: Tensor, dim: int = -1) -> Tensor:
    """``entmax.sparsemax(x, dim)`` (full sort)."""
    return _Sparsemax.apply(x, dim)


def entmax15(x: Tensor, dim: int = -1) -> Tensor:
    """``entmax.entmax15(x, dim)`` (full sort)."""
    return _Entmax15.apply(x, dim)


def entmax_bisect(x: Tensor, alpha=1.5, dim: int = -1, n_iter: int | None = None) -> Tensor:
    """``entmax.entmax_bisect(x, alpha, dim, n_iter)`` (rows renormalised to sum to one);
    ``n_iter`` None: `bisect_steps` of x's dtype (a tensor α: at the top of `SAFE_ALPHA`)."""
    if n_iter is None:
        top = SAFE_ALPHA[1] if torch.is_tensor(alpha) else max(float(alpha), 1.0)
        n_iter = bisect_steps(x.dtype, x.shape[dim], top)
    return _EntmaxBisect.apply(x, alpha, dim, n_iter)
