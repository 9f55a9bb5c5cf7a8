"""The batch-invariant GPU products and norms (inference/kernels/triton/invariant.py) under
TRITON_INTERPRET=1: a row's bits do not depend on how many rows are computed with it, and the
results match torch's in float64 within float32's rounding."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

from inference.kernels.triton import invariant  # noqa: E402


@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_product_does_not_depend_on_the_row_count(bias):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    k, n = 200, 150  # neither a multiple of the tiles
    x = torch.randn(64, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    full = invariant.linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-6
    for rows in (1, 3, 17, 64):
        part = invariant.linear(x[:rows].contiguous(), w, b)
        assert torch.equal(part, full[:rows]), f"{rows} rows"


def test_add_rms_norm_per_row():
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    width = 96
    h = torch.randn(17, width, generator=g)
    delta = torch.randn(17, width, generator=g)
    w = torch.randn(width, generator=g)
    h1 = h.clone()
    out = invariant.add_rms_norm(h1, delta, w, 1e-5)
    s = h + delta
    assert torch.equal(h1, s)  # the residual stream updated in place
    ref = w.double() * s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
    for rows in (1, 3):
        h2 = h[:rows].clone()
        assert torch.equal(invariant.add_rms_norm(h2, delta[:rows], w, 1e-5), out[:rows])
    assert torch.equal(invariant.add_rms_norm(s.clone(), None, w, 1e-5), out)
