"""GGUF tensor types to float32: llama.cpp's block formats, dequantized with numpy.

Each function takes a tensor's bytes as ``[blocks, block_bytes]`` uint8 and returns
``[blocks, block_values]`` float32, with the arithmetic in llama.cpp's order
(``dequantize_row_*`` in ggml-quants.c): scales are expanded from float16 to float32 and
multiplied before the quant, ``(d * sc) * q - (dmin * m)``. The importer reads every tensor
through here; the tests compare whole models with transformers' GGUF loader, which dequantizes
with the ``gguf`` package's own code.
"""

from __future__ import annotations

import numpy as np

# ggml tensor types (gguf.GGMLQuantizationType) -> (name, values a block, bytes a block)
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
TYPE_IDS = {name: t for t, (name, _, _) in TYPES.items()}


def type_name(ttype: int) -> str:
    """A ggml type's name (llama.cpp's, for a type not read here too)."""
    if ttype in TYPES:
        return TYPES[ttype][0]
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ttype).name
    except ValueError:
        return f"type {ttype}"


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """A float16 field of every block, as float32 [blocks, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32]: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q8_0(b):
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.float32) - 8.0)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes of a little-endian uint32 -> [blocks, 32] its bits, lowest first."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.astype(np.float32) - 16.0)


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K/Q5_K 6-bit scales and mins -> [blocks, 8] each
    (``get_scale_min_k4``)."""
    s = s.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b, q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 groups of 32 values, each ``(d * sc) * q - (dmin * m)``."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    scale = (d * sc)[:, :, None]
    offset = (dmin * mn)[:, :, None]
    return (scale * q.reshape(-1, 8, 32).astype(np.float32) - offset).reshape(-1, 256)


def _q4_k(b):
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 runs of 32 bytes: group 2i low, 2i+1 high
    q = np.stack([qs & 0x0F, qs >> 4], axis=2)  # [blocks, 4, 2, 32]
    return _k_affine(b, q)


def _q5_k(b):
    qh = b[:, 16:48]  # [blocks, 32]: bit 2i and 2i+1 of byte l are groups 2i, 2i+1's fifth
    qs = b[:, 48:176].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2)  # [blocks, 4, 2, 32]
    bits = np.stack([(qh >> g) & 1 for g in range(8)], axis=1).reshape(-1, 4, 2, 32)
    return _k_affine(b, low | (bits << 4))


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 64)  # two halves of 128 values
    qh = b[:, 128:192].reshape(-1, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = _f16(b, 208)[:, :, None]
    lo, hi = ql[:, :, :32], ql[:, :, 32:]
    q = (
        np.stack(
            [
                (lo & 0x0F) | (((qh >> 0) & 3) << 4),
                (hi & 0x0F) | (((qh >> 2) & 3) << 4),
                (lo >> 4) | (((qh >> 4) & 3) << 4),
                (hi >> 4) | (((qh >> 6) & 3) << 4),
            ],
            axis=2,
        ).astype(np.float32)
        - 32.0
    )  # [blocks, 2, 4, 32]
    # value l of run r in half h has scale sc[h, 2r + l // 16]
    scale = (d * sc).reshape(-1, 2, 4, 2, 1)
    q = q.reshape(-1, 2, 4, 2, 16)
    return (scale * q).reshape(-1, 256)


def _q2_k(b):
    sc = b[:, 0:16]
    qs = b[:, 16:80].reshape(-1, 2, 32)  # two halves of 128 values
    d, dmin = _f16(b, 80), _f16(b, 82)
    # half h, shift j (4), then 2 runs of 16 values: scale index 8h + 2j + r
    q = np.stack([(qs >> (2 * j)) & 3 for j in range(4)], axis=2)  # [blocks, 2, 4, 32]
    q = q.reshape(-1, 16, 16).astype(np.float32)
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(-1, 256)


def _q3_k(b):
    hmask = b[:, 0:32]
    qs = b[:, 32:96].reshape(-1, 2, 32)
    raw = b[:, 96:108].copy().view("<u4").astype(np.uint32)  # [blocks, 3]
    a0, a1, tmp = raw[:, 0], raw[:, 1], raw[:, 2]
    k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    aux = np.stack(
        [
            (a0 & k2) | (((tmp >> 0) & k1) << 4),
            (a1 & k2) | (((tmp >> 2) & k1) << 4),
            ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
            ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
        ],
        axis=1,
    ).astype("<u4")
    scales = aux.view(np.int8).astype(np.float32) - 32.0  # [blocks, 16]
    d = _f16(b, 108)
    low = np.stack([(qs >> (2 * j)) & 3 for j in range(4)], axis=2)  # [blocks, 2, 4, 32]
    # the high bit of value l of (half h, shift j) is bit 4h + j of hmask[l]; clear means -4
    high = np.stack([(hmask >> (4 * h + j)) & 1 for h in range(2) for j in range(4)], axis=1)
    q = low.reshape(-1, 8, 32).astype(np.float32) - 4.0 * (1 - high.astype(np.float32))
    dl = (d * scales)[:, :, None]
    return (dl * q.reshape(-1, 16, 16)).reshape(-1, 256)


_BLOCKS = {
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    8: _q8_0,
    10: _q2_k,
    11: _q3_k,
    12: _q4_k,
    13: _q5_k,
    14: _q6_k,
}


def dequantize(data: np.ndarray, ttype: int) -> np.ndarray:
    """A tensor's bytes (uint8, whole blocks) -> its values, float32, flat."""
    if ttype not in TYPES:
        raise ValueError(f"GGUF tensor type {ttype} is not supported")
    raw = np.ascontiguousarray(data).view(np.uint8)
    if ttype == 0:
        return raw.view("<f4").astype(np.float32)
    if ttype == 1:
        return raw.view("<f2").astype(np.float32)
    if ttype == 30:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    _, _, size = TYPES[ttype]
    out = _BLOCKS[ttype](raw.reshape(-1, size))
    return np.ascontiguousarray(out, dtype=np.float32).reshape(-1)
