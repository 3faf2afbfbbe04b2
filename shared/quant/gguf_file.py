"""A GGUF file's header read fast: its metadata values and its tensors as views of the file's memory map.

The format is ggml's (docs/gguf.md of llama.cpp: magic, version, tensor and key-value counts, the key-value pairs,
the tensor infos, then the tensor data at general.alignment). gguf.GGUFReader reads the same, but builds a numpy
view per value of every array, ~100K of them for a tokenizer's vocabulary and merges (about 4 s for the default
model); this reads scalars and strings and steps over arrays (the loader needs none of them). Type constants,
sizes and dequantization stay the gguf package's. Little-endian files of versions 2 and 3 (what llama.cpp writes).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}  # fmt: skip
# (the element types a tensor's data keeps; every other type is read as its blocks' bytes, as GGUFReader does)
_ELEMENTS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}  # fmt: skip


class Array:
    """A metadata array stepped over: its element type and length, not its values."""

    def __init__(self, element_type: GGUFValueType, length: int):
        self.element_type, self.length = element_type, length

    def __repr__(self) -> str:
        return f"Array({self.element_type.name}, {self.length})"


@dataclass
class GGUFTensor:
    """One tensor: shape in GGUF order (the innermost dimension first), its ggml type, and data, a read-only view:
    elements shaped reversed(shape) for float and integer types, else bytes [..., rows, bytes per row]."""

    name: str
    shape: np.ndarray
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class GGUFFile:
    """fields: {key: int | float | bool | str | Array}; tensors: GGUFTensor in file order.

    Raises:
        ValueError: not GGUF (magic), another version or byte order, a value type or tensor type it does not know,
            or a file that ends before its header or a tensor's data does (truncated).
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        self._offset = 0
        if bytes(self._read(4)) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (its magic is not GGUF)")
        (version,) = self._unpack("<I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (or a big-endian file): only little-endian versions "
                             f"{VERSIONS} are read")  # fmt: skip
        num_tensors, num_fields = self._unpack("<QQ")
        self.fields = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(GGUFValueType(self._unpack("<I")[0]))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            raw_type, offset = self._unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, ggml_type, data_start + offset)
                        for name, dims, ggml_type, offset in infos]  # fmt: skip

    def _read(self, num_bytes: int) -> memoryview:
        end = self._offset + num_bytes
        if end > len(self._buf):
            raise ValueError(f"the file ends at byte {len(self._buf)}, inside its header (truncated?)")
        view, self._offset = self._buf[self._offset:end], end
        return view

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        return bytes(self._read(length)).decode("utf-8")

    def _value(self, value_type: GGUFValueType):
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type == GGUFValueType.ARRAY:
            element_type, length = GGUFValueType(self._unpack("<I")[0]), self._unpack("<Q")[0]
            if element_type in _SCALARS:  # (fixed size: stepped over at once)
                self._read(length * struct.calcsize(_SCALARS[element_type]))
            else:
                for _ in range(length):
                    self._value(element_type)
            return Array(element_type, length)
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type!r}")
        return self._unpack(_SCALARS[value_type])[0]

    def _tensor(self, name: str, dims: tuple[int, ...], ggml_type: GGMLQuantizationType, start: int) -> GGUFTensor:
        num_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        shape = tuple(reversed(dims))
        if ggml_type in _ELEMENTS:
            dtype, count = np.dtype(_ELEMENTS[ggml_type]), num_elements
        else:
            dtype, count = np.dtype(np.uint8), num_elements // block_size * type_size
            shape = (*shape[:-1], shape[-1] // block_size * type_size)
        end = start + count * dtype.itemsize
        if end > len(self._map):
            raise ValueError(f"tensor {name}'s data ends at byte {end}, past the file's end {len(self._map)} "
                             f"(truncated?)")  # fmt: skip
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(shape)
        return GGUFTensor(name, np.array(dims, dtype=np.uint64), ggml_type, data)
