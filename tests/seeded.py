"""Seeded randomness for tests that build TE modules: every value comes from a ``torch.Generator``
the test owns, never from the global RNG (seeding that from a test leaks into every later test).

``seeded_init(seed)`` is a TE module ``init_method`` that draws each weight (each expert's
``[out, in]`` weight for ``TEGroupedLinear``) from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (the
TE modules' default before they took TE's ``normal_(0, 0.023)``), or ``N(0, std)`` with ``std``
(``TEGroupedSwiGLUExperts``' default is 0.02), reproducibly without ``torch.manual_seed``.

Tests whose cases were built on the TE modules' former defaults (bf16 parameters, no bias,
Kaiming-uniform weights from the global RNG) pass them explicitly: ``BF16_NO_BIAS`` and
``nn_linear_init`` (``TELinear``'s) / ``fan_in_uniform_init`` (``TEGroupedLinear``'s, per expert);
their draws are the former defaults' bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

BF16_NO_BIAS = {"bias": False, "params_dtype": torch.bfloat16}
"""``TELinear`` / ``TEGroupedLinear`` keywords giving the choices they once defaulted to."""


def nn_linear_init(weight: torch.Tensor) -> None:
    """``nn.Linear``'s weight init (Kaiming-uniform, a = sqrt(5)) from the global RNG."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def fan_in_uniform_init(weight: torch.Tensor) -> None:
    """``U(-1/sqrt(in), 1/sqrt(in))`` from the global RNG (an expert's ``[out, in]`` weight)."""
    bound = 1.0 / math.sqrt(weight.shape[-1])
    nn.init.uniform_(weight, -bound, bound)


def seeded_init(seed: int, *, std: float | None = None) -> Callable[[torch.Tensor], None]:
    """``init_method(weight)``: ``N(0, std)`` when given, else ``U(+-1/sqrt(weight.shape[-1]))``."""
    gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def init(weight: torch.Tensor) -> None:
        if std is not None:
            weight.normal_(0.0, std, generator=gen)
        else:
            bound = 1.0 / math.sqrt(weight.shape[-1])
            weight.uniform_(-bound, bound, generator=gen)

    return init


def seeded_randn(seed: int) -> Callable[..., torch.Tensor]:
    """``randn(*shape, dtype=bf16, scale=1.0, requires_grad=False)``: normal values, one generator."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0,
              requires_grad: bool = False) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_(requires_grad)

    return randn


def spread_values(gen: torch.Generator, octaves: int) -> Callable[..., torch.Tensor]:
    """``make(*shape, dtype=bf16)``: normal values times ``2**U[-octaves, octaves)`` drawn from
    ``gen``, so MX blocks and per-tensor amaxes see a spread of magnitudes (distinct scales)."""

    def make(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        values = torch.randn(*shape, generator=gen)  # drawn before the exponents: the tests' inputs as before
        return (values * torch.exp2(torch.randint(-octaves, octaves, shape, generator=gen).float())).to(dtype)

    return make
