"""Softmax attention with its log-sum-exp on CUDA (the sink's and adaptive temperature's
passes): the `template` kernels with ``MAP = "softmax"``."""

from __future__ import annotations

import torch

from ..masking import Masking
from .template import Launch, backward, forward, unit_last

Tensor = torch.Tensor


class TritonSoftmax(torch.autograd.Function):
    """(out, lse) of softmax(scale·q·kᵀ)·v with out in float32 and lse = m + log Z ``[B, H, Lq,
    1]`` (−inf on rows that see no key), both differentiable (the sink's σ(lse − b), adaptive's
    entropy lse − Σ p·s take gradients through lse)."""

    @staticmethod
    def forward(ctx, q, k, v, masking, scale, blocks):
        q, k, v = unit_last(q), unit_last(k), unit_last(v)
        row = q.new_ones(1, 1, 1, 1, dtype=torch.float32)  # read by no softmax kernel
        launch = Launch("softmax", True, q, k, v, row, masking, scale, 1.0, blocks)
        out, m, z = forward(launch, q, k, v)
        ctx.save_for_backward(q, k, v, out, m, z)
        ctx.launch = launch
        return out, (m + torch.log(z)).unsqueeze(-1)

    @staticmethod
    def backward(ctx, g, glse):
        q, k, v, out, m, z = ctx.saved_tensors
        g = unit_last(g.to(v.dtype))  # dO in the inputs' dtype, as the flash backward takes it
        dq, dk, dv, _ = backward(ctx.launch, q, k, v, g, False, out, m, z, glse)
        return dq, dk, dv, None, None, None


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masking: Masking,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax attention ``[B, H, Lq, Dv]`` (float32) and its log-sum-exp ``[B, H, Lq, 1]``
    (float32, −inf on rows that see no key), both with gradients, through the kernels above."""
    return TritonSoftmax.apply(q, k, v, masking, scale, blocks)
