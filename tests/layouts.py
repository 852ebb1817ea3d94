"""Memory layouts of attention inputs, for the suites that draw them
(tests/contract/test_adversarial.py, tests/paths/test_layouts.py): real model code hands
attention heads-last views, transposed keys, slices and expanded tensors, and a path that reads
memory by hand (a private kernel, a C++ loop on raw pointers) can misread any of them silently."""

from __future__ import annotations

import torch

#: every layout :func:`laid_out` makes. ``d_major`` and ``sliced`` leave the last dimension
#: non-contiguous (a transposed buffer, ``x[..., ::2]``): torch's private CPU flash kernel
#: misread those, silently, before the fused paths copied them.
LAYOUTS = (
    "contiguous",
    "heads_last",  # a [B, L, H, D] buffer seen as [B, H, L, D] (q.view(B, L, H, D).transpose(1, 2))
    "d_major",  # a [B, H, D, L] buffer: kᵀ stored, k used
    "sliced",  # every other element of a wider buffer
    "offset",  # a view 3 elements into its storage
    "expanded",  # stride 0 over batch and heads: one [1, 1, L, D] block
    "overlapping",  # row i starts D // 2 elements after row i − 1 (values repeat across rows)
)


def laid_out(x: torch.Tensor, layout: str, g: torch.Generator | None = None) -> torch.Tensor:
    """``x`` ``[B, H, L, D]`` in ``layout``, on x's device and in its dtype. The values are x's but
    for ``expanded`` (x's first batch and head, repeated) and ``overlapping`` (new values, drawn
    from ``g``, that rows share): paths are compared on the tensor returned."""
    b, h, n, d = x.shape
    if x.numel() == 0:
        return x
    if layout == "heads_last":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "d_major":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        wide = torch.zeros(b, h, n, 2 * d, dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "offset":
        flat = torch.zeros(x.numel() + 3, dtype=x.dtype, device=x.device)
        flat[3:] = x.reshape(-1)
        return flat[3:].view(x.shape)
    if layout == "expanded":
        return x[:1, :1].expand(x.shape)
    if layout == "overlapping":
        step = max(1, d // 2)
        per = max(n - 1, 0) * step + d
        base = torch.randn(b * h * per, generator=g, dtype=torch.float64)
        base = base.to(x.device, x.dtype) * x.detach().abs().amax().clamp_min(1.0).to(x.dtype)
        return base.as_strided(x.shape, (h * per, per, step, 1))
    if layout == "contiguous":
        return x.contiguous()
    raise ValueError(f"unknown layout {layout!r}")
