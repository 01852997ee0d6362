"""Tolerances for comparing a computed tensor with its reference, set from the reference's magnitude."""

from __future__ import annotations

import functools

import torch


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, msg=None,
                          floor: float = 0.0) -> None:
    """Assert elementwise |actual - expected| <= rel * (max|expected| + |expected|), the absolute part never
    less than `floor`.

    The same computation done in another order (parallel layouts, another CPU's SIMD width or thread count)
    rounds fp32 sums differently. The rounding error of a sum is a fraction of the magnitude of its terms, not
    of its result: an element near zero that comes from cancelling terms carries the error of those terms. So
    the absolute tolerance is `rel` of the reference's scale, its largest absolute value; a bare small atol
    makes tiny elements demand more precision than float rounding of the sum gives, and holds on one CPU but
    not on another. `floor` is an absolute minimum for tensors whose error does not follow their own scale
    (weights moved by Adam on rounding noise alone). `msg` (a string, or a callable taking torch's message)
    names what is compared.
    """
    magnitudes = expected.detach().abs().float()
    magnitudes = magnitudes[torch.isfinite(magnitudes)]
    scale = float(magnitudes.max()) if magnitudes.numel() else 0.0
    atol = max(rel * scale, floor)
    if isinstance(msg, str):
        msg = functools.partial("{}: {}".format, msg)
    torch.testing.assert_close(actual, expected, rtol=rel, atol=atol, msg=msg)


def assert_close_in_norm(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, msg: str = "") -> None:
    """Assert ||actual - expected|| <= rel * ||expected|| (L2 norms over the whole tensor).

    For what training carries from step to step (Adam's moments after several steps): rounding differences
    compound through the steps, and the few elements with near-zero second moments carry them beyond any
    elementwise bound, while the tensor as a whole stays as close as the weights do.
    """
    where = f"{msg}: " if msg else ""
    assert actual.shape == expected.shape, f"{where}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = float((actual.detach().double() - expected.detach().double()).norm())
    reference = float(expected.detach().double().norm())
    assert error <= rel * reference, f"{where}L2 difference {error:.3e} exceeds {rel:.0e} of the norm {reference:.3e}"
