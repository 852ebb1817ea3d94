"""Members trained together: layers whose weights carry a leading ensemble dimension.

``StackedLinear(members, in, out)`` holds ``members`` independent ``nn.Linear(in, out)`` layers as
one weight ``(S, out, in)`` and one bias ``(S, 1, out)``, and applies member ``s`` to slice ``s`` of
its input ``(S, ..., in)`` in one batched matrix product. Member ``s``'s weight and bias are
exactly ``nn.Linear``'s (same layout), so `member_state` / `stack_states` move weights
between an ensemble and its single models without copying values through arithmetic. It takes
``device``/``dtype`` as torch's layers do, so ``nn.utils.skip_init(StackedLinear, ...)`` builds one
without drawing from the global RNG (for members initialised from their own generators).

Measured against ``torch.func`` (``stack_module_state`` + ``functional_call`` + ``vmap``): vmap
cannot run [`attend`][sharpattn.attention.attend], whose input checks read values (``.item()``), and
the attention itself has no per-member weights, so the ensemble keeps ``attend`` and flattens the
member dimension into its batch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["StackedLinear", "member_state", "stack_states"]

Tensor = torch.Tensor


class StackedLinear(nn.Module):
    """``members`` linear layers ``in_features → out_features``, applied member-wise."""

    def __init__(
        self, members: int, in_features: int, out_features: int, *, device=None, dtype=None
    ):
        super().__init__()
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}.")
        self.members, self.in_features, self.out_features = members, in_features, out_features
        factory = {"device": device, "dtype": dtype}  # as torch's layers (nn.utils.skip_init)
        self.weight = nn.Parameter(torch.empty(members, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(members, 1, out_features, **factory))
        bound = 1 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        """``x (S, ..., in)`` → ``(S, ..., out)``: member s's layer on ``x[s]``."""
        s = x.shape[0]
        if s != self.members:
            raise ValueError(f"input has {s} members along dim 0, the layer {self.members}.")
        flat = x.reshape(s, -1, self.in_features)  # (S, N, in)
        out = torch.baddbmm(self.bias, flat, self.weight.transpose(1, 2))  # (S, N, out)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"members={self.members}, in_features={self.in_features}, out_features={self.out_features}"


def member_state(stacked: dict[str, Tensor], member: int) -> dict[str, Tensor]:
    """The ``nn.Linear``-layout state dict of one member of a stacked state dict."""
    out = {}
    for k, v in stacked.items():
        v = v[member]
        out[k] = v[0] if k.endswith("bias") and v.dim() == 2 and v.shape[0] == 1 else v
        out[k] = out[k].clone()
    return out


def stack_states(states: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack single models' state dicts into a `StackedLinear` ensemble's."""
    out = {}
    for k in states[0]:
        v = torch.stack([s[k] for s in states])
        out[k] = v.unsqueeze(1) if k.endswith("bias") and v.dim() == 2 else v
    return out
