"""A GGUF file's header, metadata and tensor table, read in one pass over the memory map.

gguf-py's `GGUFReader` builds a NumPy memmap view for every part of every value: on Gemma 3's
262,144-token vocabulary that is ~4 million views and ~8 s of a start (docs/performance.md,
"Start-up"). This reader decodes the same fields with `struct` straight from the mapped bytes
(numeric arrays in one `np.frombuffer` each), and gives each tensor as a uint8 view of its
bytes, `[..., bytes per row]` as gguf-py shapes quantized ones. What it exposes is what
`GGUFReader` exposes and Lifeline uses: `fields` (key -> `Field` with `contents()`), `tensors`
(`Tensor`: name, type, GGUF-order shape, data, offset, bytes) and `data` (the map).

GGUF versions 2 and 3, in either byte order (`byte_order`: '<' as llama.cpp writes them; the
tensors' bytes of a big-endian file are as stored). Anything else (a cut or damaged file, a
count larger than the file, an unknown value type, version 1) raises `ValueError`, which
`GGUFFile` reports as a corrupt file. `skip`: key prefixes whose values are stepped over, not
decoded (the planner skips `tokenizer.`: it reads shapes only).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = 0x46554747  # "GGUF"
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

# GGUF value types: struct format (numbers), or the two kinds with a length
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(slots=True)
class Field:
    name: str
    value: Any

    def contents(self) -> Any:
        """The value as plain Python (str, int, float, bool, or a list of them), as
        `gguf.ReaderField.contents()` gives it."""
        return self.value


@dataclass(slots=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    """GGUF's order: ne0 (the row's length) first."""
    data: np.ndarray
    """The stored bytes, uint8, `[..., bytes per row]` (a view of the map: do not write)."""
    data_offset: int
    n_bytes: int


class GGUFReader:
    def __init__(self, path: str, mode: str = "r", skip: tuple[str, ...] = ()):
        self.data = np.memmap(path, mode=mode)
        buf = memoryview(self.data)
        self._buf, self._pos, self._end = buf, 0, len(buf)
        self.byte_order = "<"
        (magic,) = self._unpack("<I")
        if magic != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        (version,) = self._unpack("<I")
        self.byte_order = ">" if version & 0xFFFF == 0 else "<"  # a big-endian file's version
        if self.byte_order == ">":
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}: only 2 and 3")
        n_tensors, n_kv = self._unpack("<QQ")
        self._room(n_tensors * 24 + n_kv * 12, "the tensor and metadata counts")
        self.fields: dict[str, Field] = {  # as gguf-py lists the header's own numbers
            name: Field(name, value) for name, value in
            (("GGUF.version", version), ("GGUF.tensor_count", n_tensors), ("GGUF.kv_count", n_kv))}
        for _ in range(n_kv):
            key = self._string()
            if skip and key.startswith(skip):
                self._skip(self._unpack("<I")[0])
            else:
                self.fields[key] = Field(key, self._value(self._unpack("<I")[0]))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = self._unpack(f"<{n_dims}Q")
            raw_type, offset = self._unpack("<IQ")
            infos.append((name, dims, raw_type, offset))
        alignment = self.fields.get("general.alignment")
        alignment = int(alignment.value) if alignment is not None else DEFAULT_ALIGNMENT
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[Tensor] = [self._tensor(start, *info) for info in infos]
        del self._buf, buf

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int,
                offset: int) -> Tensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}: {dims[0]} values a row, not whole blocks of "
                             f"{block}")
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        n_bytes = rows * row_bytes
        begin = start + offset
        if begin + n_bytes > self._end:
            raise ValueError(f"tensor {name!r} ends at byte {begin + n_bytes:,}, the file "
                             f"has {self._end:,}")
        data = self.data[begin:begin + n_bytes].view(np.uint8)
        data = data.reshape(*reversed(dims[1:]), row_bytes)
        return Tensor(name, qtype, np.array(dims, dtype=np.uint64), data, begin, n_bytes)

    def _room(self, n: int, what: str) -> None:
        if n < 0 or self._pos + n > self._end:
            raise ValueError(f"{what} run past the end of the file (byte {self._pos:,})")

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        fmt = fmt.replace("<", self.byte_order)
        size = struct.calcsize(fmt)
        self._room(size, "a header field")
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        self._room(n, "a string")
        text = str(self._buf[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("<IQ")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item]).newbyteorder(self.byte_order)
            self._room(count * dtype.itemsize, "an array")
            values = np.frombuffer(self._buf, dtype, count, self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        if item == STRING:
            self._room(count * 8, "an array of strings")
            return self._strings(count)
        if item == ARRAY:
            return [self._value(ARRAY) for _ in range(count)]
        raise ValueError(f"unknown GGUF array item type {item}")

    def _skip(self, kind: int) -> None:
        """Step over a value without decoding it."""
        if kind in _SCALARS:
            self._room(struct.calcsize(_SCALARS[kind]), "a value")
            self._pos += struct.calcsize(_SCALARS[kind])
        elif kind == STRING:
            (n,) = self._unpack("<Q")
            self._room(n, "a string")
            self._pos += n
        elif kind == ARRAY:
            item, count = self._unpack("<IQ")
            if item in _SCALARS:
                self._room(count * struct.calcsize(_SCALARS[item]), "an array")
                self._pos += count * struct.calcsize(_SCALARS[item])
            elif item == STRING:  # a vocabulary's 262,144 strings: lengths only, in one loop
                self._room(count * 8, "an array")
                buf, pos, end = self._buf, self._pos, self._end
                unpack = struct.Struct(self.byte_order + "Q").unpack_from
                for _ in range(count):
                    if pos + 8 > end:
                        raise ValueError("an array of strings runs past the end of the file")
                    pos += 8 + unpack(buf, pos)[0]
                if pos > end:
                    raise ValueError("an array of strings runs past the end of the file")
                self._pos = pos
            else:
                self._room(count * 8, "an array")
                for _ in range(count):
                    self._skip(item)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")

    def _strings(self, count: int) -> list[str]:
        buf, pos, end, out = self._buf, self._pos, self._end, []
        unpack = struct.Struct(self.byte_order + "Q").unpack_from
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("an array of strings runs past the end of the file")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError("an array of strings runs past the end of the file")
            append(str(buf[pos:pos + n], "utf-8"))
            pos += n
        self._pos = pos
        return out
