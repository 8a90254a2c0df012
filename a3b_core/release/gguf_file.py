"""A GGUF file's header walked and checked by us before `gguf.GGUFReader` parses it: magic, version, every metadata
entry and tensor record inside the file, known tensor types, and tensor data inside the file without overlaps.

gguf-py's reader trusts the header (a truncated or crafted file makes it fail with a bare ValueError or IndexError,
or build views past the end), so every way a file can be bad is refused here first with a CheckpointError that
names the file and the fix.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_COUNT = 2**31  # tensors, metadata entries, array items: far above any model (a vocabulary has ~250k tokens)
# Metadata value types: fixed sizes (u8, i8, u16, i16, u32, i32, f32, bool, -, -, u64, i64, f64); 8 string, 9 array.
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
# ggml tensor types: id -> (name, elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES has them.
TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# The block types whose tensors are read (computed from their blocks, or dequantized); the others are refused by name.
READ_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
REDOWNLOAD = "The file is truncated or corrupt: download it again (and check its size against the release)."


@dataclass(frozen=True)
class BlockType:
    """A ggml block-quantized tensor type. It stands where a torch dtype stands for float tensors (a checkpoint's
    TensorInfo.dtype, the planner's inventory), so it prints as its name and knows its bytes."""
    type_id: int
    name: str
    block_elements: int
    block_bytes: int

    def __str__(self) -> str:
        return self.name

    def row_bytes(self, columns: int) -> int:
        return columns // self.block_elements * self.block_bytes

    def stored_bytes(self, numel: int) -> int:
        return numel // self.block_elements * self.block_bytes


BLOCK_TYPES: dict[str, BlockType] = {name: BlockType(type_id, name, block, nbytes)
                                     for type_id, (name, block, nbytes) in TENSOR_TYPES.items()
                                     if name in READ_BLOCK_TYPES}


@dataclass(frozen=True)
class TensorRecord:
    name: str
    type_id: int
    ne: tuple[int, ...]  # ggml order: the fastest dimension first
    offset: int  # absolute byte offset in the file
    nbytes: int
    file: Path  # the file it is in (a split set's part)

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.type_id][0]


class _Cursor:
    def __init__(self, path: Path, buf: mmap.mmap | bytes, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise CheckpointError(f"{self.path}: the header ends inside {what} (byte {self.pos} of {self.size}). "
                                  f"{REDOWNLOAD}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def count(self, what: str) -> int:
        n = self.u64(what)
        if n > MAX_COUNT:
            raise CheckpointError(f"{self.path}: {what} is {n}, far beyond any model. {REDOWNLOAD}")
        return n

    def string(self, what: str) -> str:
        raw = self.take(self.count(f"the length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: {what} is not UTF-8 ({exc}). {REDOWNLOAD}") from exc


def check_gguf_file(path: str | Path) -> list[TensorRecord]:
    """Walks the whole header of a GGUF file and checks it; returns its tensor records. Reads only the header."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 24:
                head = f.read()
                if not head.startswith(MAGIC):
                    raise CheckpointError(f"{path}: not a GGUF file (it does not start with 'GGUF'). Pass a .gguf "
                                          "model file, or a model folder holding config.json and .safetensors files.")
                raise CheckpointError(f"{path}: file is {size} bytes, too short to be GGUF. {REDOWNLOAD}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(path, buf, size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc}). Check the file exists and is readable.") from exc


def _walk(path: Path, buf: mmap.mmap, size: int) -> list[TensorRecord]:
    cur = _Cursor(path, buf, size)
    if cur.take(4, "the magic") != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it does not start with 'GGUF'). Pass a .gguf model file, or "
                              "a model folder holding config.json and .safetensors files.")
    version = cur.u32("the version")
    if version not in VERSIONS:
        swapped = struct.unpack(">I", struct.pack("<I", version))[0]
        hint = (" It is a big-endian GGUF: use the little-endian file of the release." if swapped in VERSIONS
                else " Convert the model again with a current llama.cpp.")
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (only {', '.join(map(str, VERSIONS))})."
                              + hint)
    n_tensors = cur.count("the tensor count")
    n_fields = cur.count("the metadata count")
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_fields):
        key = cur.string(f"the name of metadata entry {i}")
        kind = cur.u32(f"the type of '{key}'")
        if key == "general.alignment":
            if kind != 4:
                raise CheckpointError(f"{path}: 'general.alignment' has type {kind}, expected uint32. {REDOWNLOAD}")
            alignment = cur.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise CheckpointError(f"{path}: 'general.alignment' is {alignment}, not a power of two. {REDOWNLOAD}")
            continue
        _skip_value(cur, kind, f"'{key}'", depth=0)
    records = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        if name in seen:
            raise CheckpointError(f"{path}: tensor '{name}' is listed twice. {REDOWNLOAD}")
        seen.add(name)
        n_dims = cur.u32(f"the rank of '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CheckpointError(f"{path}: tensor '{name}' has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS}). "
                                  f"{REDOWNLOAD}")
        ne = tuple(cur.u64(f"the shape of '{name}'") for _ in range(n_dims))
        type_id = cur.u32(f"the type of '{name}'")
        offset = cur.u64(f"the offset of '{name}'")
        if type_id not in TENSOR_TYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has ggml type id {type_id}, which no GGUF reader here "
                                  "knows. Use a GGUF made by a current llama.cpp with a common quantization "
                                  "(F16, BF16, Q8_0, Q4_K_M ...).")
        _, block, block_bytes = TENSOR_TYPES[type_id]
        numel = 1
        for d in ne:
            if not 0 < d < 2**40:
                raise CheckpointError(f"{path}: tensor '{name}' has shape {list(ne)}. {REDOWNLOAD}")
            numel *= d
        if ne[0] % block:
            raise CheckpointError(f"{path}: tensor '{name}' ({TENSOR_TYPES[type_id][0]}) has rows of {ne[0]} values, "
                                  f"not a multiple of its block of {block}. {REDOWNLOAD}")
        records.append(TensorRecord(name, type_id, ne, offset, numel // block * block_bytes, path))
    data_start = -(-cur.pos // alignment) * alignment
    spans = []
    for r in records:
        if r.offset % alignment:
            raise CheckpointError(f"{path}: tensor '{r.name}' starts at data offset {r.offset}, not a multiple of the "
                                  f"alignment {alignment}. {REDOWNLOAD}")
        begin = data_start + r.offset
        if begin + r.nbytes > size:
            raise CheckpointError(f"{path}: tensor '{r.name}' needs bytes [{begin}, {begin + r.nbytes}) but the file "
                                  f"has {size}. {REDOWNLOAD}")
        spans.append((begin, begin + r.nbytes, r.name))
    spans.sort()
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise CheckpointError(f"{path}: tensors '{name_a}' and '{name_b}' overlap in the file; it is corrupt or "
                                  "crafted. Download it again from the model's release.")
    return [TensorRecord(r.name, r.type_id, r.ne, data_start + r.offset, r.nbytes, path) for r in records]


def _skip_value(cur: _Cursor, kind: int, what: str, depth: int) -> None:
    if kind in FIXED_SIZES:
        cur.take(FIXED_SIZES[kind], what)
    elif kind == STRING:
        cur.take(cur.count(f"the length of {what}"), what)
    elif kind == ARRAY and depth < 3:  # arrays of arrays exist in the format; no model nests deeper
        item = cur.u32(f"the item type of {what}")
        n = cur.count(f"the length of {what}")
        if item in FIXED_SIZES:
            cur.take(n * FIXED_SIZES[item], what)
        else:
            for _ in range(n):
                _skip_value(cur, item, what, depth + 1)
    else:
        raise CheckpointError(f"{cur.path}: metadata {what} has value type {kind}, which GGUF does not define. "
                              f"{REDOWNLOAD}")
