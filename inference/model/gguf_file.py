"""A GGUF file's metadata and tensor table, read in one pass over its header.

``gguf.GGUFReader`` builds a numpy view for every part of every field, which for a tokenizer of
49,152 tokens and as many merges is most of an import's time (bench/RESULTS.md, "Service
measurements"). This reads the same header (GGUF versions 2 and 3, little-endian) with
``struct`` and returns plain Python values: what ``ReaderField.contents()`` gives for each
field, and each tensor's name, type, shape and bytes (a read-only view of the file, mapped).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (gguf.GGUFValueType)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)
_SCALARS = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
_NUMPY = {t: np.dtype(f) for t, f in _SCALARS.items()}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # a ggml type (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # as GGUF stores it: the fastest-varying dimension first
    data: np.ndarray  # its bytes (uint8), a read-only view of the file


@dataclass
class GGUFFile:
    fields: dict[str, Any]
    tensors: list[GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buf):
        self.buf = buf
        self.at = 0

    def take(self, fmt: str):
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.at)
        except struct.error:
            raise GGUFFormatError(f"the header ends early, at byte {self.at}") from None
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        end = self.at + n
        if end > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes at byte {self.at} runs past the file")
        s = bytes(self.buf[self.at : end]).decode("utf-8")
        self.at = end
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, n = self.take("<I"), self.take("<Q")
            if sub in _NUMPY:  # numbers: one view, then Python values
                dt = _NUMPY[sub]
                end = self.at + n * dt.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"an array of {n} at byte {self.at} runs past the file")
                out = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.at).tolist()
                self.at = end
                return out
            return [self.value(sub) for _ in range(n)]
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise GGUFFormatError(f"unknown value type {vtype} at byte {self.at}")
        return self.take(fmt)


def read_gguf(path: str | Path) -> GGUFFile:
    """The fields and tensors of the GGUF file at ``path``; raises GGUFFormatError (or
    OSError) for a file that is not one."""
    from gguf.constants import GGML_QUANT_SIZES

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFFormatError("no GGUF magic at the start")
    c.at = 4
    version = c.take("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (2 and 3 are read)")
    n_tensors, n_fields = c.take("<Q"), c.take("<Q")
    # the header's counts first, as GGUFReader shows them
    fields: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": n_tensors,
        "GGUF.kv_count": n_fields,
    }
    for _ in range(n_fields):
        key = c.string()
        fields[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
        infos.append((name, dims, c.take("<I"), c.take("<Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-c.at // align) * align
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, dims, ttype, offset in infos:
        if ttype not in GGML_QUANT_SIZES:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {ttype}")
        block, size = GGML_QUANT_SIZES[ttype]
        n = int(np.prod(dims, dtype=np.int64))
        if n % block:
            raise GGUFFormatError(f"tensor {name!r}: {n} values are not whole blocks of {block}")
        lo = start + offset
        hi = lo + n // block * size
        if hi > len(data):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, ttype, dims, data[lo:hi]))
    return GGUFFile(fields, tensors)
