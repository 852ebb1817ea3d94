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

import torch
from entmax.activations import _entmax_threshold_and_support, _sparsemax_threshold_and_support

Tensor = torch.Tensor


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


def entmax_bisect(x: Tensor, alpha=1.5, dim: int = -1, n_iter: int = 50) -> Tensor:
    """``entmax.entmax_bisect(x, alpha, dim, n_iter)`` (rows renormalised to sum to one)."""
    return _EntmaxBisect.apply(x, alpha, dim, n_iter)
