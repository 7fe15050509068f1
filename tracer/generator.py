"""Consistent tensor generator.

Every parameter and batch is generated as a full logical tensor from a seed derived from its
canonical name, then sliced to the local shard by its layout. Reference and candidate therefore
start bit-identical whatever the parallel layout, and no rank needs to talk to another to agree.
"""

from __future__ import annotations

import hashlib

import torch


def seed_for(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a canonical name (stable across processes)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(seed, name))


def full_tensor(name: str, shape: tuple[int, ...], seed: int, *, init: str = "normal", std: float = 0.02,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full logical tensor for `name`: normal(0, std), ones or zeros, generated in fp32."""
    if init == "ones":
        t = torch.ones(shape)
    elif init == "zeros":
        t = torch.zeros(shape)
    elif init == "normal":
        t = torch.randn(shape, generator=_generator(seed, name)) * std
    else:
        raise ValueError(f"unknown init '{init}' for {name}")
    return t.to(dtype)


def perturb_signs(shape: tuple[int, ...] | torch.Size, seed: int, name: str) -> torch.Tensor:
    """Which elements of the logical tensor `name` a perturbed run moves up (True) or down: one draw
    per element of the FULL tensor, so every layout slices the same signs (`Layout.local`)."""
    return torch.randint(0, 2, tuple(shape), generator=_generator(seed, "perturb/" + name)).bool()


def step_ulp(t: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Every element moved one ulp of its own dtype: up where `up`, down elsewhere (zeros included).

    Multiplying by (1 + eps*u) and rounding back would leave most elements unchanged; a one-ulp
    step moves every element by a relative 2**-p..2**-(p-1) of its own precision."""
    inf = torch.tensor(float("inf"), dtype=t.dtype, device=t.device)
    return torch.where(up.to(t.device), torch.nextafter(t, inf), torch.nextafter(t, -inf))


def perturb_ulp(t: torch.Tensor, seed: int, name: str) -> torch.Tensor:
    """The full logical tensor `name` with every element moved one ulp (random sign, seeded by name)."""
    return step_ulp(t, perturb_signs(t.shape, seed, name))


def token_batch(seed: int, step: int, global_batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Token ids [global_batch, seq_len + 1] for one step; inputs = [:, :-1], labels = [:, 1:]."""
    g = _generator(seed, f"data/step{step}")
    return torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
