"""Safetensors checkpoints: headers parsed and checked by us, tensors memory-mapped, FP8 dequantized on request.

Only safetensors is ever read. Headers are validated before any tensor is touched, so a corrupt or hostile file
fails with a CheckpointError naming it instead of crashing or reading out of bounds.
"""
from __future__ import annotations

import bisect
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from .config import inside_folder

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parses and checks one safetensors header without reading tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short to be safetensors. "
                                      "The download is incomplete: download this file again.")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: header claims {header_len} bytes but the file has {size}. The file is "
                                      "truncated or not safetensors: download it again.")
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc}). Check the file exists and is readable.") from exc
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON, or an over-long integer
        raise CheckpointError(f"{path}: header is not valid JSON ({exc}); the file is corrupt. Download it again.") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; the file is corrupt. Download it again.")

    data_start = 8 + header_len
    data_len = size - data_start
    infos: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        infos[name] = _tensor_info(path, name, entry, data_start, data_len)
        spans.append((infos[name].offset, infos[name].offset + infos[name].nbytes, name))
    spans.sort()
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise CheckpointError(f"{path}: tensors '{name_a}' and '{name_b}' overlap in the file; it is corrupt or "
                                  "crafted. Download it again from the model's release.")
    return infos


def _tensor_info(path: Path, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    bad = f"{path}: tensor '{name}' has a malformed header entry"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{bad} ({entry!r}). The file is corrupt: download it again.")
    dtype = DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise CheckpointError(f"{path}: tensor '{name}' has dtype {entry.get('dtype')!r}, which is not supported "
                              f"(expected one of {', '.join(DTYPES)}). Use the model's original safetensors release "
                              "(GGUF-style quantizations are not read).")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)):
        raise CheckpointError(f"{bad} (shape {shape!r}, data_offsets {offsets!r}). Download the file again.")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if not 0 <= begin <= end <= data_len or end - begin != nbytes:
        raise CheckpointError(f"{path}: tensor '{name}' needs {nbytes} bytes at [{begin}, {end}) but the data section "
                              f"has {data_len}; the file is truncated or corrupt. Download it again.")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, nbytes)


def drop_pages(mm: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drops the mapped pages wholly inside [offset, offset + nbytes): a copied-out tensor's source (they are read
    again if it is used again)."""
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def names_under(sorted_names: list[str], prefix: str) -> list[str]:
    """The names of a sorted list that start with `prefix`."""
    first = bisect.bisect_left(sorted_names, prefix)
    last = first
    while last < len(sorted_names) and sorted_names[last].startswith(prefix):
        last += 1
    return sorted_names[first:last]


def find_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, from the index when there is one."""
    index = folder / INDEX_NAME
    if index.is_file():
        inside_folder(folder, index, CheckpointError)
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: cannot be read as a safetensors index ({exc!r}). "
                                  "Download it again.") from exc
        files = []
        for name in names:
            if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
                raise CheckpointError(f"{index}: lists the shard {name!r}, which is not a plain file name inside the "
                                      "model folder. Use the index file from the model's release.")
            path = folder / name
            if not path.is_file():
                raise CheckpointError(f"{path}: this shard is listed in {INDEX_NAME} but missing. Download it into "
                                      f"{folder} (the model needs all {len(names)} shards).")
            files.append(inside_folder(folder, path, CheckpointError))
        return files
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())  # not pipes or folders
    if files:
        return [inside_folder(folder, p, CheckpointError) for p in files]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []
    if pickles:
        raise CheckpointError(f"{folder}: holds only pickle checkpoints ({', '.join(pickles[:3])}), which can run "
                              "arbitrary code and are never loaded. Download the model's .safetensors release instead.")
    raise CheckpointError(f"{folder}: no .safetensors weights found. Point to the model folder that holds "
                          "config.json and the model.safetensors files.")


class Checkpoint:
    """All tensors of a model folder: headers up front, data memory-mapped on demand."""

    def __init__(self, folder: str | Path, fp8_block: tuple[int, int] = (128, 128)):
        self.folder = Path(folder)
        self.fp8_block = fp8_block
        self.files = find_weight_files(self.folder)
        self.infos: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.infos:
                    raise CheckpointError(f"{path}: tensor '{name}' also appears in {self.infos[name].file.name}; "
                                          "remove the duplicate shard.")
                self.infos[name] = info
        self._maps: dict[Path, mmap.mmap] = {}
        self._sorted_names: list[str] = []  # for release_under, built on first use

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor as is, a view of the memory-mapped file (copy-on-write: never writes the file)."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"{self.folder}: tensor '{name}' is missing. The checkpoint is incomplete or "
                                  "not a Qwen3.5 model: download all of its files.")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        mm = self._maps.get(info.file)
        if mm is None:
            with open(info.file, "rb") as f:
                mm = self._maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return flat.view(info.dtype).view(info.shape)

    def weight(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor in `dtype`, dequantizing FP8 with its `weight_scale_inv` (128x128 blocks) or `weight_scale`."""
        q = self.raw(name)
        if not q.dtype.is_floating_point:
            stored = next(k for k, v in DTYPES.items() if v == q.dtype)
            raise CheckpointError(f"{self.infos[name].file}: weight '{name}' is stored as {stored}, an integer "
                                  "type, not as floating point. The file is not a Qwen3.5 release: download "
                                  "the model's safetensors again.")
        if q.dtype == dtype:
            return q  # a view of the mapped file: pages are read when first used, shared with the page cache
        if q.dtype in FP8_DTYPES:
            out = dequantize_fp8(q, self._fp8_scale(name), name, self.fp8_block, dtype)
        else:
            out = q.to(dtype)
        self.release(name)
        return out

    def weight_at(self, name: str, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Matrix `index` of a stacked tensor [N, rows, cols] (fused experts) in `dtype`; FP8 is dequantized with the
        same matrix of its stacked block scales [N, rows / block, cols / block]."""
        q = self.raw(name)[index]
        if q.dtype in FP8_DTYPES:
            return dequantize_fp8(q, self._fp8_scale(name)[index], name, self.fp8_block, dtype)
        return q.to(dtype)

    def release(self, name: str) -> None:
        """Drops the mapped pages of a tensor that was copied out, so converting a checkpoint never holds the file
        and its converted copy in memory together (the pages are read again if the tensor is used again)."""
        info = self.infos[name]
        mm = self._maps.get(info.file)
        if mm is not None:
            drop_pages(mm, info.offset, info.nbytes)

    def release_under(self, prefix: str) -> None:
        """release() for every tensor whose name starts with `prefix`."""
        self._sorted_names = self._sorted_names or sorted(self.infos)
        for name in names_under(self._sorted_names, prefix):
            self.release(name)

    def _fp8_scale(self, name: str) -> torch.Tensor:
        for suffix in ("_scale_inv", "_scale"):
            if name + suffix in self.infos:
                return self.raw(name + suffix)
        raise CheckpointError(f"{self.infos[name].file}: '{name}' is stored as FP8 but has no '{name}_scale_inv' or "
                              f"'{name}_scale' beside it, so it cannot be dequantized. The download is incomplete: "
                              "download all the files of the FP8 release again.")

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a tensor still views it; the OS unmaps when that tensor dies
                pass
        self._maps.clear()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, name: str = "weight", block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = q * scale in `dtype`, with scale per tensor (one value) or per `block` (ceil-div: edge blocks may be
    partial). Products are formed in fp32 and rounded to `dtype` once; whole blocks broadcast their scale instead of
    expanding it to the matrix's size."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return (q.to(torch.float32) * scale.reshape(())).to(dtype)
    rows, cols = q.shape[-2:] if q.dim() >= 2 else (0, 0)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if q.dim() != 2 or tuple(scale.shape) != grid:
        raise CheckpointError(f"'{name}': FP8 scale of shape {tuple(scale.shape)} does not fit weight "
                              f"{tuple(q.shape)} with {block[0]}x{block[1]} blocks (expected {grid}). The file is "
                              "corrupt or uses another block size (config.json quantization_config.weight_block_size): use the "
                              "config.json of the same release.")
    if rows % block[0] == 0 and cols % block[1] == 0:
        blocks = q.to(torch.float32).view(grid[0], block[0], grid[1], block[1]) * scale[:, None, :, None]
        return blocks.view(rows, cols).to(dtype)
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (q.to(torch.float32) * full[:rows, :cols]).to(dtype)
