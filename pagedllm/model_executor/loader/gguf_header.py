"""A GGUF file's header (metadata and tensor directory) read in milliseconds.

The `gguf` package's `GGUFReader` builds numpy views for every part of every field,
vocabulary strings included: on a small model's file (49k tokens and 48k merges) that is
3.6 s, paid once by the server's front end (the config) and once by its engine core (the
config and weights), on every start. Only the metadata values and the tensor directory are
needed here, and the vocabulary arrays only for their length (transformers builds the
tokenizer from the file itself): walking past them takes milliseconds.

The package still supplies the format's tables (value types, block sizes) and the
dequantizers; tensor data are views of one read-only memory map, shaped as `GGUFReader`
shapes them (typed for float and integer types, bytes [.., bytes a row] for block types),
which `gguf.quants.dequantize` takes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# Metadata value types (GGUFValueType) with a fixed size: struct code.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numpy items (GGMLQuantizationType): F32, F16, I8, I16, I32,
# I64, F64; every other type is blocks, kept as bytes.
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
          28: np.float64}


@dataclass(frozen=True)
class StringArray:
    """An array of strings left unread (the vocabulary, the merges): its length only."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # a gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order, as the file lists it: shape[0] is the innermost
    data: np.ndarray  # a read-only view of the file


class GGUFHeader:
    """`fields`: metadata key -> value (int, float, bool, str, a numpy array for numeric
    arrays, StringArray for arrays of strings); `tensors`: the directory in file order."""

    def __init__(self, path: str):
        import gguf

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise ValueError(f"{path} is a big-endian GGUF file; only little-endian files are supported")
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
        self._buf, self._pos = buf, 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            if key in self.fields:
                raise ValueError(f"{path}: duplicate metadata key {key!r}")
            self.fields[key] = self._value(vtype)
        directory = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ttype, offset = self._unpack("<IQ")
            directory.append((name, tuple(int(d) for d in dims), ttype, offset))
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: general.alignment {align} is not a power of two")
        start = -(-self._pos // align) * align
        raw = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in directory:
            n = int(np.prod(dims)) if dims else 1
            np_dims = tuple(reversed(dims))
            begin = start + offset
            qtype = gguf.GGMLQuantizationType(ttype)
            if ttype in _PLAIN:
                dtype = np.dtype(_PLAIN[ttype])
                data = raw[begin : begin + n * dtype.itemsize].view(dtype).reshape(np_dims)
            else:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                data = raw[begin : begin + n // block * size].reshape(
                    gguf.quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(GGUFTensor(name, qtype, dims, data))
        del self._buf

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._buf[start : start + n].decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF metadata type {vtype}")
        itype, count = self._unpack("<IQ")
        if itype in _SCALARS:
            code = _SCALARS[itype]
            values = np.frombuffer(self._buf, dtype=np.dtype("<" + code), count=count, offset=self._pos)
            self._pos += values.nbytes
            return values.copy()
        if itype == _STRING:  # skipped: each item is a u64 length and that many bytes
            buf, pos = self._buf, self._pos
            for _ in range(count):
                pos += 8 + int.from_bytes(buf[pos : pos + 8], "little")
            self._pos = pos
            return StringArray(count)
        return [self._value(itype) for _ in range(count)]  # arrays of arrays
