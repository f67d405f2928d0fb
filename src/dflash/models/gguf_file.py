"""Reading a GGUF file: header, metadata, tensor directory, and memory-mapped tensor bytes.

`gguf.GGUFReader` turns every element of every metadata array into its own numpy view, which takes
seconds for a 262k-token vocabulary. This reader parses the same layout directly (strings in one
pass, numeric arrays with `numpy.frombuffer`), checks that every tensor's bytes lie inside the file,
and leaves dequantisation to `gguf.quants.dequantize`. Layout (little-endian, versions 2 and 3):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key, u32 value_type, value)          string = u64 length + UTF-8 bytes
    tensor_count x (string name, u32 n_dims, n_dims x u64 ne, u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data; offsets are relative to it.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from dflash.errors import ModelLoadError

__all__ = ["GGUFFile", "GGUFTensorInfo"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_NUMPY_DTYPES: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
# Plain float types that `gguf.quants.dequantize` does not cover.
_PLAIN_FLOATS = {GGMLQuantizationType.F64: "<f8"}


class _Truncated(Exception):
    """The header ends before the structure it describes."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory. `shape` is in torch/numpy order (GGUF's `ne` reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute position in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """A parsed GGUF file; tensor bytes stay memory-mapped until dequantised."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as fh:
                self.file_size = self.path.stat().st_size
                if self.file_size < 24:
                    self._check_magic(fh.read(4))
                    raise ModelLoadError(f"{self.path}: truncated GGUF file ({self.file_size} bytes)")
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"{self.path}: cannot be read: {exc.strerror or exc}") from None
        self._check_magic(self._map[:4])
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        try:
            self._parse()
        except _Truncated as exc:
            raise ModelLoadError(f"{self.path}: truncated or corrupt GGUF header ({exc})") from None
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise ModelLoadError(f"{self.path}: corrupt GGUF header: {exc}") from None

    def _check_magic(self, head: bytes) -> None:
        if head != _MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (starts with {head!r}, expected b'GGUF')")

    # ----------------------------------------------------------------------------------------- parsing
    def _parse(self) -> None:
        self._pos = 4
        version = self._scalar(GGUFValueType.UINT32)
        if version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            if swapped in (2, 3):
                raise ModelLoadError(f"{self.path}: big-endian GGUF files are not supported")
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {version} (supported: 2, 3)")
        self.version = int(version)
        n_tensors = int(self._scalar(GGUFValueType.UINT64))
        n_kv = int(self._scalar(GGUFValueType.UINT64))
        # Every kv and tensor entry takes at least 12 bytes: bounds the counts before looping.
        if (n_tensors + n_kv) * 12 > self.file_size:
            raise _Truncated(
                f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in {self.file_size} bytes"
            )
        for _ in range(n_kv):
            key = self._string()
            vtype = int(self._scalar(GGUFValueType.UINT32))
            self.metadata[key] = self._value(vtype, key)
        raw_infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = int(self._scalar(GGUFValueType.UINT32))
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            ne = tuple(int(self._scalar(GGUFValueType.UINT64)) for _ in range(n_dims))
            qtype_id = int(self._scalar(GGUFValueType.UINT32))
            offset = int(self._scalar(GGUFValueType.UINT64))
            raw_infos.append((name, ne, qtype_id, offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        self.data_offset = -(-self._pos // alignment) * alignment
        for name, ne, qtype_id, offset in raw_infos:
            self.tensors[name] = self._tensor_info(name, ne, qtype_id, offset)

    def _tensor_info(self, name: str, ne: tuple[int, ...], qtype_id: int, offset: int) -> GGUFTensorInfo:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown ggml type {qtype_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne and ne[0] % block:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} rows of {ne[0]} values are not whole {qtype.name} blocks of {block}"
            )
        n_bytes = math.prod(ne) // block * type_size
        start = self.data_offset + offset
        if start + n_bytes > self.file_size:
            raise ModelLoadError(
                f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes {start}..{start + n_bytes} "
                f"but the file has {self.file_size} bytes"
            )
        return GGUFTensorInfo(name, tuple(reversed(ne)), qtype, start, n_bytes)

    def _need(self, n: int) -> None:
        if n < 0 or self._pos + n > self.file_size:
            raise _Truncated(f"needs {n} bytes at offset {self._pos}, file has {self.file_size}")

    def _scalar(self, vtype: int) -> Any:
        fmt, size = _SCALAR_FORMATS[vtype]
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        if vtype == GGUFValueType.FLOAT32:  # the shortest decimal that is this float32: 1e-05, not 9.99e-06
            return float(str(np.float32(value)))
        return value

    def _string(self) -> str:
        length = int(self._scalar(GGUFValueType.UINT64))
        self._need(length)
        text = self._map[self._pos : self._pos + length].decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, vtype: int, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype in _SCALAR_FORMATS:
            return self._scalar(vtype)
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"metadata {key!r} has unknown value type {vtype}")
        item_type = int(self._scalar(GGUFValueType.UINT32))
        count = int(self._scalar(GGUFValueType.UINT64))
        if item_type in _NUMPY_DTYPES:
            dtype = np.dtype(_NUMPY_DTYPES[item_type])
            self._need(count * dtype.itemsize)
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).tolist()
            self._pos += count * dtype.itemsize
            return values
        if item_type == GGUFValueType.STRING:
            self._need(count * 8)
            return self._string_array(count)
        if item_type == GGUFValueType.ARRAY:
            return [self._value(GGUFValueType.ARRAY, key) for _ in range(count)]
        raise ValueError(f"metadata {key!r} is an array of unknown type {item_type}")

    def _string_array(self, count: int) -> list[str]:
        buf, pos, size = self._map, self._pos, self.file_size
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated(f"string array ends at offset {pos}")
            (length,) = unpack(buf, pos)
            pos += 8
            if pos + length > size:
                raise _Truncated(f"string of {length} bytes at offset {pos}")
            out.append(buf[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self._pos = pos
        return out

    # ------------------------------------------------------------------------------------------ access
    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored bytes of `info`, shaped (..., bytes per row), read-only and memory-mapped."""
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
        if not info.shape:
            return data
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        return data.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop the pages of `info`'s bytes from this process's resident memory once they have been copied: a
        read-only mapping's pages are the page cache's, so a later read faults them back in. Without this every
        page read while loading stays resident beside the copies made of it (the whole file, at the peak)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        stop = min(len(self._map), -(-(info.offset + info.n_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The values of `info` as float32 with shape `info.shape` (may share memory with the file)."""
        raw = self.raw(info)
        if info.qtype in _PLAIN_FLOATS:
            values = raw.view(_PLAIN_FLOATS[info.qtype]).astype(np.float32)
        else:
            try:
                values = dequantize(raw, info.qtype)
            except NotImplementedError:
                raise ModelLoadError(
                    f"{self.path}: tensor {info.name!r} uses {info.qtype.name}, which cannot be dequantised"
                ) from None
        return values.reshape(info.shape).astype(np.float32, copy=False)
