"""Max retrieval (Veličković et al., App. A.2): predict the class of the item of largest priority.

Each of n items has a priority ρ_i ~ U(0, 1) and a class κ_i ~ U{0, …, C−1}; its features are
x_i = [ρ_i, onehot(κ_i)] ∈ R^{C+1}. The query q ~ U(0, 1) carries no information. The target is
κ_{argmax_i ρ_i}. Ties in ρ (probability about n·2⁻²⁴ per set in float32) go to the first item,
so the target is always the class of the item the features rank first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MaxRetrievalBatch", "N_CLASSES", "sample_max_retrieval"]

Tensor = torch.Tensor

N_CLASSES = 10


@dataclass
class MaxRetrievalBatch:
    x: Tensor  # (B, n, C + 1): [ρ_i, onehot(κ_i)]
    q: Tensor  # (B, 1): the query scalar
    target: Tensor  # (B,): κ of the item of largest ρ
    priority: Tensor  # (B, n): ρ_i
    argmax: Tensor  # (B,): index of the item of largest ρ


def sample_max_retrieval(
    batch: int,
    n: int,
    generator: torch.Generator,
    *,
    n_classes: int = N_CLASSES,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> MaxRetrievalBatch:
    """``batch`` sets of ``n`` items, drawn from ``generator`` in three tensor calls."""
    if batch < 1 or n < 1:
        raise ValueError(f"batch and n must be >= 1, got batch={batch}, n={n}.")
    if n_classes < 1:
        raise ValueError(f"n_classes must be >= 1, got {n_classes}.")
    rho = torch.rand(batch, n, generator=generator, dtype=dtype, device=device)  # (B, n)
    kappa = torch.randint(n_classes, (batch, n), generator=generator, device=device)  # (B, n)
    q = torch.rand(batch, 1, generator=generator, dtype=dtype, device=device)  # (B, 1)
    x = torch.cat(
        (rho.unsqueeze(-1), torch.nn.functional.one_hot(kappa, n_classes).to(dtype)), dim=-1
    )  # (B, n, C + 1)
    argmax = rho.argmax(dim=-1)  # first index among ties
    target = kappa.gather(-1, argmax.unsqueeze(-1)).squeeze(-1)
    return MaxRetrievalBatch(x=x, q=q, target=target, priority=rho, argmax=argmax)
