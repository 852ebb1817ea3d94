"""One seeding scheme: a ``numpy.random.SeedSequence`` per (seed, purpose, ...), so the streams for
initialisation, data, probes and test sets never overlap and never depend on the global RNG."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------


def seed_int(*key: int) -> int:
    """A 63-bit seed for one purpose of one run seed: ``SeedSequence(key)``'s first 64 bits,
    halved (torch takes seeds below 2⁶³). Distinct keys give independent streams."""
    if not key:
        raise ValueError("seed_int needs at least one integer.")
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint32)
    return int(state.view(np.uint64)[0] >> 1)


def generator(*key: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with `seed_int` of ``key``."""
    return torch.Generator().manual_seed(seed_int(*key))


def numpy_generator(*key: int) -> np.random.Generator:
    """A NumPy ``Generator`` seeded with `seed_int` of ``key``."""
    return np.random.default_rng(seed_int(*key))


@contextlib.contextmanager
def seeded(*key: int) -> Iterator[None]:
    """Run the block with the global torch RNG seeded from ``key`` (for code that draws from it,
    such as ``nn.Module`` initialisation), then restore the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_int(*key))
        yield
