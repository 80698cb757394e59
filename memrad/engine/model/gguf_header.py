"""What a GGUF file says about itself, read from its header without touching its tensors.

gguf-py's GGUFReader turns every field into numpy views, the tokenizer's 50-150k strings
included: ~10 s on a 8 MB vocabulary file on this machine, which is what `memrad start` would
make the user wait before it could say anything. This reads the same header (gguf-py's
constants name the value and tensor types) in one pass over a memory map, keeping scalars,
strings and short arrays and only counting long ones:

    "GGUF" | version u32 | tensors u64 | fields u64
    field:  key (u64 length + utf-8) | value type u32 | value
            value: scalar | string (u64 length + bytes) | array (item type u32, count u64, items)
    tensor: name | dims u32 | dims x u64 (innermost first) | type u32 | offset u64

Little-endian GGUF v2 and v3 only (what llama.cpp writes); anything else is refused by name.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType

from memrad.engine.model.unavailable import ModelUnavailable

# Arrays longer than this are kept as their length only (the tokenizer's vocabulary, merges).
SHORT_ARRAY = 1024
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True, slots=True)
class LongArray:
    """An array field kept as its length (e.g. tokenizer.ggml.tokens)."""

    num_items: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str  # llama.cpp's name, e.g. "blk.3.attn_q.weight"
    shape: tuple[int, ...]  # as GGUF lists it: innermost (row length) first
    kind: str  # GGMLQuantizationType name: "Q4_K", "Q8_0", "F32", ...
    offset: int = 0  # its bytes' start in the file


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    fields: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def arch_field(self, name: str, default: Any = None) -> Any:
        """`{architecture}.{name}`, e.g. arch_field("block_count")."""
        return self.fields.get(f"{self.architecture}.{name}", default)


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        text = self.data[self.at : self.at + size].decode("utf-8", errors="replace")
        self.at += size
        return text

    def skip_string(self) -> None:
        size = self.unpack("<Q")  # read first: `self.at += self.unpack(...)` would drop the 8 bytes read
        self.at += size

    def value(self, kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if count <= SHORT_ARRAY:
                return [self.value(item) for _ in range(count)]
            if item == GGUFValueType.STRING:
                for _ in range(count):
                    self.skip_string()
            elif item == GGUFValueType.ARRAY:
                for _ in range(count):
                    self.value(GGUFValueType.ARRAY)
            else:
                self.at += count * struct.calcsize(_SCALARS[item])
            return LongArray(count)
        return self.unpack(_SCALARS[kind])


def read_f32(path: Path, tensor: TensorInfo) -> tuple[float, ...]:
    """The values of a small F32 tensor of the GGUF at `path` (e.g. Gemma 4's rope_freqs), read
    without gguf-py's reader (which parses the whole vocabulary first)."""
    if tensor.kind != "F32":
        raise ModelUnavailable(f"{path}: {tensor.name} is {tensor.kind}, where memrad reads it as F32")
    count = math.prod(tensor.shape)
    with open(path, "rb") as handle:
        handle.seek(tensor.offset)
        data = handle.read(4 * count)
    if len(data) != 4 * count:
        raise ModelUnavailable(f"{path} ends inside {tensor.name}")
    return struct.unpack(f"<{count}f", data)


def read_header(path: Path) -> GGUFHeader:
    """The fields and tensor list of the GGUF at `path` (raises ModelUnavailable if it is not one)."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                raise ModelUnavailable(f"{path} is not a GGUF file (it does not start with 'GGUF')")
            cursor = _Cursor(data)
            cursor.at = 4
            version = cursor.unpack("<I")
            if version not in (2, 3):
                raise ModelUnavailable(f"{path} is GGUF version {version}; memrad reads little-endian v2 and v3")
            num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
            fields = {}
            for _ in range(num_fields):
                key = cursor.string()
                fields[key] = cursor.value(cursor.unpack("<I"))
            tensors = []
            for _ in range(num_tensors):
                name = cursor.string()
                shape = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
                kind = GGMLQuantizationType(cursor.unpack("<I")).name
                tensors.append(TensorInfo(name, shape, kind, cursor.unpack("<Q")))  # offset into the data section
            alignment = int(fields.get("general.alignment", 32))
            start = -(-cursor.at // alignment) * alignment  # the data section follows, aligned
            tensors = [TensorInfo(t.name, t.shape, t.kind, start + t.offset) for t in tensors]
    except (struct.error, ValueError, OSError) as exc:
        raise ModelUnavailable(f"{path}: cannot read its GGUF header ({exc})") from exc
    return GGUFHeader(fields, tuple(tensors))
