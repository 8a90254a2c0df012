"""A GGUF file as a checkpoint: the tensors of the Hugging Face release, by their names and in their layouts, with
everything llama.cpp's convert_hf_to_gguf.py changed undone (it is the same interface as safetensors.Checkpoint,
so the loader, the planner and `inspect` read a GGUF as they read a model folder).

What the converter does, and what is undone here (GGUF -> HF), per architecture:
- qwen35moe / qwen35 (Qwen3.5/3.6): RMSNorm weights are stored as 1 + w (all but the DeltaNet gated norm) -> minus 1;
  A_log is stored as ssm_a = -exp(A_log) -> log(-ssm_a); dt_bias is named ssm_dt.bias; conv1d [C, 1, K] is stored
  [C, K]; where linear_num_value_heads > linear_num_key_heads, the value heads of in_proj_qkv (V rows), in_proj_z,
  in_proj_b, in_proj_a, dt_bias, A_log, conv1d (V rows) and out_proj (columns) are reordered from grouped
  (k0v0, k0v1, k1v0, ...) to tiled (k0v0, k1v0, ..., k0v1, ...) -> the inverse permutation.
- every MoE: gate_up_proj [E, 2I, H] is split into ffn_gate_exps and ffn_up_exps [E, I, H] -> concatenated (or
  ffn_gate_up_exps, written with --fuse-gate-up-exps, taken as is); down_proj [E, H, I] is kept.
- qwen3vlmoe / qwen3vl: only names (Qwen3-VL's transposed expert release is written as [E, I, H] / [E, H, I]).
- MTP layers (blk.N.* past block_count - nextn_predict_layers) are not exposed: the engine does not use them.

Tensors are read in the float types F32, F16 and BF16 and in the block types of gguf_file.READ_BLOCK_TYPES (Q8_0,
Q4_K, Q6_K, ...): a block-quantized tensor's TensorInfo.dtype is its gguf_file.BlockType, `blocks_at` gives a routed
expert's matrices as their blocks (the engine computes them from those), and everything else is dequantized when
read (by gguf-py, llama.cpp's own reference). Other types (most I-quants, ...) are refused by name.
A set split by gguf-split is one checkpoint (gguf_split.py): any part names it, each tensor is read from its part.
"""
from __future__ import annotations

import math
import mmap
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .gguf_file import BLOCK_TYPES, BlockType, TensorRecord, check_gguf_file
from .gguf_split import SPLIT_KEYS, check_split_set, split_parts
from .safetensors import drop_pages, names_under

FLOAT_TYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ARCHITECTURES = ("qwen35moe", "qwen35", "qwen3vlmoe", "qwen3vl")
TEXT = "model.language_model."
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# One layer's GGUF names -> HF names (under model.language_model.layers.N.) and how each was changed by the converter.
COMMON = {
    "attn_q.weight": ("self_attn.q_proj.weight", "copy"), "attn_k.weight": ("self_attn.k_proj.weight", "copy"),
    "attn_v.weight": ("self_attn.v_proj.weight", "copy"), "attn_output.weight": ("self_attn.o_proj.weight", "copy"),
    "ffn_gate_inp.weight": ("mlp.gate.weight", "copy"), "ffn_down_exps.weight": ("mlp.experts.down_proj", "copy"),
    "ffn_gate_up_exps.weight": ("mlp.experts.gate_up_proj", "copy"),
    "ffn_gate.weight": ("mlp.gate_proj.weight", "copy"), "ffn_up.weight": ("mlp.up_proj.weight", "copy"),
    "ffn_down.weight": ("mlp.down_proj.weight", "copy"),
}
QWEN35_LAYER = {
    **COMMON,
    "attn_norm.weight": ("input_layernorm.weight", "norm"),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", "norm"),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", "norm"),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", "norm"),
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", "v_rows"),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", "heads_rows"),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", "head_rows"),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", "head_rows"),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", "conv"),
    "ssm_dt.bias": ("linear_attn.dt_bias", "head_rows"),
    "ssm_a": ("linear_attn.A_log", "a_log"),
    "ssm_norm.weight": ("linear_attn.norm.weight", "copy"),
    "ssm_out.weight": ("linear_attn.out_proj.weight", "heads_cols"),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", "copy"),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", "copy"),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", "copy"),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", "row"),
}
QWEN3VL_LAYER = {
    **COMMON,
    "attn_norm.weight": ("input_layernorm.weight", "copy"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "copy"),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", "copy"),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", "copy"),
}
EXPERT_HALVES = ("ffn_gate_exps.weight", "ffn_up_exps.weight")  # -> mlp.experts.gate_up_proj, concatenated
# the converter's changes a block-quantized tensor can be kept through in its blocks: whole rows reordered (and
# matrices' halves joined) are the same blocks; reordered columns are undone on the product's inputs (matrix_blocks)
BLOCK_OPS = ("copy", "cat", "v_rows", "heads_rows", "heads_cols")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One HF tensor of a GGUF checkpoint: its shape as the release has it, its dtype (a torch dtype, or the
    BlockType of a matrix kept in its blocks), and where it comes from."""
    name: str
    file: Path
    dtype: torch.dtype | BlockType
    shape: tuple[int, ...]
    nbytes: int
    sources: tuple[TensorRecord, ...]  # the GGUF tensors it is made of
    op: str  # how: copy, norm, v_rows, heads_rows, head_rows, heads_cols, conv, a_log, row, cat


@dataclass(frozen=True)
class LinearHeads:
    """The DeltaNet head layout that the value-head reorder permutes by."""
    key_heads: int
    value_heads: int
    key_dim: int  # all key heads together (nk * dk): where the V rows of in_proj_qkv and conv1d start
    value_head_dim: int


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value of a GGUFReader (a scalar, a string or a list), or `default` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def open_reader(path: Path, records: list[TensorRecord]) -> Any:
    """gguf.GGUFReader on a file that check_gguf_file passed; its tensors must be the ones we found."""
    import gguf  # the reader of llama.cpp's own project (PyPI gguf); imported when a GGUF is opened
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise CheckpointError(f"{path}: the GGUF metadata cannot be read ({exc}). The file is corrupt: download it "
                              "again.") from exc
    found = {t.name: int(t.data_offset) for t in reader.tensors}
    if found != {r.name: r.offset for r in records}:
        raise CheckpointError(f"{path}: the GGUF reader and the header check disagree on the tensors; the file is "
                              "corrupt or crafted. Download it again.")
    return reader


class MappedCheckpoint:
    """What a GGUF model's and an mmproj's checkpoints share: tensors in `infos` read through `tensors` (a
    MappedTensors), `raw(name)` defined by each."""
    infos: dict[str, Any]
    tensors: MappedTensors
    reader: Any
    _sorted_names: list[str]

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def weight(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor in `dtype` (a copy releases the mapped pages it was made from)."""
        value = self.raw(name)
        if value.dtype == dtype:
            return value
        out = value.to(dtype)
        self.release(name)
        return out

    def release(self, name: str) -> None:
        """Drops the mapped pages of a tensor that was copied out (they are read again if it is used again)."""
        self.tensors.release(self.infos[name].sources)

    def release_under(self, prefix: str) -> None:
        """release() for every tensor whose name starts with `prefix`."""
        self._sorted_names = self._sorted_names or sorted(self.infos)
        for name in names_under(self._sorted_names, prefix):
            self.release(name)

    def close(self) -> None:
        self.tensors.close()
        self.reader = None


class GGUFCheckpoint(MappedCheckpoint):
    """A GGUF file's tensors under the HF release's names (model.language_model.layers.N...., lm_head.weight) and in
    its layouts. `path` and `folder` are the .gguf file, or a split set's first part whichever part was passed
    (messages and caches name it); `files` are all its parts."""

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] = (128, 128)):
        self.files = split_parts(Path(path))
        self.path = self.files[0]
        self.folder = self.path
        self.fp8_block = fp8_block  # unused (GGUF has no FP8 blocks); kept for the loader's interface
        part_records = [check_gguf_file(part) for part in self.files]
        readers = [open_reader(part, records) for part, records in zip(self.files, part_records)]
        check_split_set(self.files, [{key: metadata(r, key) for key in SPLIT_KEYS} for r in readers], part_records)
        self.reader = readers[0]  # the first part holds all the model's metadata
        records = [record for part in part_records for record in part]
        # every part's tensors as stored (torch order), for the config: the first part's reader sees only its own
        self.stored_shapes = {record.name: tuple(reversed(record.ne)) for record in records}
        self.architecture = metadata(self.reader, "general.architecture")
        if self.architecture not in ARCHITECTURES:
            kind = metadata(self.reader, "general.type")
            hint = (" It is a vision projector (mmproj): pass the model's GGUF, the mmproj is found beside it."
                    if self.architecture == "clip" or kind == "mmproj" else "")
            raise CheckpointError(f"{self.path}: GGUF architecture {self.architecture!r} is not supported; this pack "
                                  f"reads {', '.join(ARCHITECTURES)} (Qwen3.5/3.6 and Qwen3-VL, as llama.cpp's "
                                  f"convert_hf_to_gguf.py writes them).{hint}")
        for record in records:
            if record.type_name not in FLOAT_TYPES and record.type_name not in BLOCK_TYPES:
                raise CheckpointError(
                    f"{self.path}: tensor '{record.name}' is stored as {record.type_name}, which this pack does not "
                    f"read; GGUF tensors are read in {', '.join([*FLOAT_TYPES, *BLOCK_TYPES])}. Use a GGUF of one of "
                    "those (Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16, ...), or the model's safetensors release.")
        self.heads = self._linear_heads() if self.architecture.startswith("qwen35") else None
        self.infos: dict[str, GGUFTensorInfo] = self._map(records)
        self.tensors = MappedTensors()
        self._sorted_names: list[str] = []

    # ------------------------------------------------------------------------------------------- names and shapes
    def _linear_heads(self) -> LinearHeads:
        arch = self.architecture
        key_heads = metadata(self.reader, f"{arch}.ssm.group_count")
        value_heads = metadata(self.reader, f"{arch}.ssm.time_step_rank")
        key_head_dim = metadata(self.reader, f"{arch}.ssm.state_size")
        inner = metadata(self.reader, f"{arch}.ssm.inner_size")
        values = (key_heads, value_heads, key_head_dim, inner)
        if not all(isinstance(v, int) and v > 0 for v in values) or value_heads % key_heads or inner % value_heads:
            raise CheckpointError(f"{self.path}: the DeltaNet keys {arch}.ssm.group_count / time_step_rank / "
                                  f"state_size / inner_size are {list(values)}; expected positive integers with "
                                  "heads that divide evenly. Convert the model again with a current llama.cpp.")
        return LinearHeads(key_heads, value_heads, key_heads * key_head_dim, inner // value_heads)

    def _map(self, records: list[TensorRecord]) -> dict[str, GGUFTensorInfo]:
        arch = self.architecture
        layer_map = QWEN35_LAYER if arch.startswith("qwen35") else QWEN3VL_LAYER
        block_count = metadata(self.reader, f"{arch}.block_count")
        trunk = block_count - (metadata(self.reader, f"{arch}.nextn_predict_layers", 0) or 0) \
            if isinstance(block_count, int) else None
        top = {"token_embd.weight": (TEXT + "embed_tokens.weight", "copy"), "output.weight": ("lm_head.weight", "copy"),
               "output_norm.weight": (TEXT + "norm.weight", "norm" if arch.startswith("qwen35") else "copy")}
        infos: dict[str, GGUFTensorInfo] = {}
        halves: dict[int, dict[str, TensorRecord]] = {}
        for record in records:
            match = _BLOCK.match(record.name)
            if match is None:
                if record.name not in top:
                    raise self._unknown(record)
                name, op = top[record.name]
            else:
                layer, rest = int(match[1]), match[2]
                if trunk is not None and layer >= trunk:
                    continue  # an MTP (next-token prediction) layer
                if rest in EXPERT_HALVES:
                    halves.setdefault(layer, {})[rest] = record
                    continue
                if rest not in layer_map:
                    raise self._unknown(record)
                name, op = layer_map[rest]
                name = f"{TEXT}layers.{layer}.{name}"
            infos[name] = self._info(name, (record,), op)
        for layer, pair in sorted(halves.items()):
            name = f"{TEXT}layers.{layer}.mlp.experts.gate_up_proj"
            if len(pair) != 2 or name in infos:
                raise CheckpointError(f"{self.path}: layer {layer} has {', '.join(f'blk.{layer}.{n}' for n in pair)} "
                                      f"but not both of {' and '.join(EXPERT_HALVES)} alone. The file is incomplete: "
                                      "download it again.")
            infos[name] = self._info(name, (pair[EXPERT_HALVES[0]], pair[EXPERT_HALVES[1]]), "cat")
        return infos

    def _unknown(self, record: TensorRecord) -> CheckpointError:
        return CheckpointError(f"{self.path}: tensor '{record.name}' is not one llama.cpp's converter writes for "
                               f"{self.architecture}; the file is from another converter or model. Convert the "
                               "model again with a current llama.cpp.")

    def _info(self, name: str, sources: tuple[TensorRecord, ...], op: str) -> GGUFTensorInfo:
        shapes = [tuple(reversed(r.ne)) for r in sources]
        shape = shapes[0]
        if op == "cat":
            if shapes[0] != shapes[1] or len(shape) != 3:
                raise CheckpointError(f"{self.path}: '{sources[0].name}' {list(shapes[0])} and '{sources[1].name}' "
                                      f"{list(shapes[1])} should be two [E, I, H] halves. The file is corrupt.")
            shape = (shape[0], 2 * shape[1], shape[2])
        elif op == "conv":
            shape = (shape[0], 1, shape[-1])
        elif op == "row":
            shape = (1, shape[-1])
        dtypes = {FLOAT_TYPES.get(r.type_name) or BLOCK_TYPES[r.type_name] for r in sources}
        blocks = [d for d in dtypes if isinstance(d, BlockType)]
        if op in BLOCK_OPS and len(blocks) == len(dtypes):
            dtype = BLOCK_TYPES[sources[0].type_name] if len(blocks) == 1 else halves_type(*(BLOCK_TYPES[r.type_name] for r in sources))
        elif op in ("norm", "a_log") or len(dtypes) > 1 or blocks:
            dtype = torch.float32  # changed by the converter, or mixed: read as fp32
        else:
            dtype = dtypes.pop()
        self._check_heads(name, shape, op)
        return GGUFTensorInfo(name, sources[0].file, dtype, shape, sum(r.nbytes for r in sources), sources, op)

    def _check_heads(self, name: str, shape: tuple[int, ...], op: str) -> None:
        h = self.heads
        if h is None or op not in ("v_rows", "heads_rows", "head_rows", "heads_cols", "conv", "a_log"):
            return
        size = shape[1] if op == "heads_cols" else shape[0]
        expected = {"v_rows": h.key_dim * 2 + h.value_heads * h.value_head_dim,
                    "conv": h.key_dim * 2 + h.value_heads * h.value_head_dim,
                    "heads_rows": h.value_heads * h.value_head_dim, "heads_cols": h.value_heads * h.value_head_dim,
                    "head_rows": h.value_heads, "a_log": h.value_heads}[op]
        if size != expected:
            raise CheckpointError(f"{self.path}: '{name}' has shape {list(shape)}, which does not fit the DeltaNet "
                                  f"heads of the metadata ({h.key_heads} key / {h.value_heads} value heads); the "
                                  "metadata contradicts the tensors. Convert the model again.")

    # ------------------------------------------------------------------------------------------------ tensors
    def raw(self, name: str) -> torch.Tensor:
        """The tensor as the HF release has it: a view of the mapped file where the converter only renamed it, else
        a new tensor with the converter's change undone."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing (this GGUF has no "
                                  f"{name.removeprefix(TEXT)}). The file is incomplete or of another model: "
                                  "download it again.")
        parts = [self.tensors.as_float(r) for r in info.sources]
        if info.op == "cat":
            dtype = info.dtype if isinstance(info.dtype, torch.dtype) else torch.float32
            return torch.cat([p.to(dtype) for p in parts], dim=1)
        return undo(info.op, parts[0], self.heads, info.shape)

    def weight_at(self, name: str, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Matrix `index` of a stacked tensor [N, rows, cols] (fused experts) in `dtype`."""
        info = self.infos.get(name)
        if info is not None and info.op in ("cat", "copy"):
            return torch.cat([self.tensors.as_float(r, index).to(dtype) for r in info.sources])
        return self.raw(name)[index].to(dtype)

    def blocks_at(self, name: str, index: int) -> tuple[tuple[BlockType, torch.Tensor], ...] | None:
        """Matrix `index` of a stacked tensor kept in blocks (routed experts), as (block type, bytes [rows, bytes per
        row]) per part of its rows (gate, then up), viewing the mapped file; None if it is not kept in blocks."""
        info = self.infos[name]
        if not isinstance(info.dtype, BlockType) or len(info.shape) != 3:
            return None
        return tuple((BLOCK_TYPES[r.type_name], self.tensors.stored(r)[index]) for r in info.sources)

    def matrix_blocks(self, name: str) -> tuple[tuple[tuple[BlockType, torch.Tensor], ...], torch.Tensor | None] | None:
        """A dense matrix kept in blocks, as ((block type, bytes [rows, bytes per row]),) with the converter's row
        reorder undone, and the order its product must read its inputs in (x[..., order] times the stored matrix is
        the release's product where the converter reordered its columns; None where it did not); None if the matrix
        is not kept in blocks."""
        info = self.infos[name]
        if not isinstance(info.dtype, BlockType) or len(info.shape) != 2:
            return None
        record, = info.sources
        stored = self.tensors.stored(record)
        if info.op != "heads_cols":
            return ((info.dtype, undo(info.op, stored, self.heads, tuple(stored.shape))),), None
        # the release's column j is the stored column order[j]: its input j multiplies that stored column
        order = undo(info.op, torch.arange(info.shape[1])[None], self.heads, info.shape)[0]
        unchanged = torch.equal(order, torch.arange(info.shape[1]))  # as many value heads as key heads
        return ((info.dtype, stored),), None if unchanged else torch.argsort(order)


class MappedTensors:
    """GGUF tensors read from their files' memory maps (copy-on-write; one map per file, a split set's parts
    included, made when first read)."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def stored(self, record: TensorRecord) -> torch.Tensor:
        """The tensor as stored, in torch order, viewing the map: a float tensor, or a block-quantized one's bytes
        [..., rows, bytes per row]."""
        mapped = self._maps.get(record.file)
        if mapped is None:
            with open(record.file, "rb") as f:
                mapped = self._maps[record.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=record.nbytes, offset=record.offset)
        shape = tuple(reversed(record.ne))
        block_type = BLOCK_TYPES.get(record.type_name)
        if block_type is not None:
            return flat.view(*shape[:-1], block_type.row_bytes(shape[-1]))
        return flat.view(FLOAT_TYPES[record.type_name]).view(shape)

    def as_float(self, record: TensorRecord, index: int | None = None) -> torch.Tensor:
        """The tensor (or its matrix `index`) in a float dtype: as stored, or dequantized to float32 by gguf-py
        (llama.cpp's reference)."""
        stored = self.stored(record)
        stored = stored if index is None else stored[index]
        if record.type_name in FLOAT_TYPES:
            return stored
        import gguf
        return torch.from_numpy(gguf.quants.dequantize(stored.numpy(), gguf.GGMLQuantizationType(record.type_id)))

    def release(self, records: Iterable[TensorRecord]) -> None:
        """Drops the mapped pages of tensors that were copied out (they are read again if used again)."""
        for record in records:
            mapped = self._maps.get(record.file)
            if mapped is not None:
                drop_pages(mapped, record.offset, record.nbytes)

    def close(self) -> None:
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:  # a tensor still views it; the OS unmaps when that tensor dies
                pass
        self._maps = {}


def halves_type(first: BlockType, second: BlockType) -> BlockType:
    """The type of a matrix made of two equal halves in two block types (gate and up), for its name and its bytes:
    "Q4_0+Q5_1", with a block of both halves' blocks."""
    half = math.lcm(first.block_elements, second.block_elements)
    nbytes = half // first.block_elements * first.block_bytes + half // second.block_elements * second.block_bytes
    return BlockType(-1, f"{first}+{second}", 2 * half, nbytes)


def unreorder_heads(x: torch.Tensor, dim: int, key_heads: int, value_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of the converter's value-head reorder along `dim` (blocks of `head_dim`): tiled order
    (k0v0, k1v0, ..., k0v1, ...) back to grouped order (k0v0, k0v1, ..., k1v0, ...)."""
    shape = list(x.shape)
    ratio = value_heads // key_heads
    x = x.reshape(*shape[:dim], ratio, key_heads, head_dim, *shape[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shape)


def undo(op: str, x: torch.Tensor, heads: LinearHeads | None, shape: tuple[int, ...]) -> torch.Tensor:
    """One stored GGUF tensor -> the HF tensor, undoing the converter's change `op`."""
    if op == "copy":
        return x
    if op == "row":
        return x.reshape(shape)
    if op == "norm":
        return x.to(torch.float32) - 1  # the converter added 1 in fp32: exact
    assert heads is not None  # only qwen35 layers have these ops (checked when the tensor was mapped)
    hd, nk, nv, kd = heads.value_head_dim, heads.key_heads, heads.value_heads, heads.key_dim
    reorder: Callable[[torch.Tensor, int, int], torch.Tensor] = \
        lambda t, dim, size: unreorder_heads(t, dim, nk, nv, size)
    if op in ("v_rows", "conv"):
        x = torch.cat([x[:2 * kd], reorder(x[2 * kd:], 0, hd)])
        return x.unsqueeze(1) if op == "conv" else x
    if op == "heads_rows":
        return reorder(x, 0, hd)
    if op == "heads_cols":
        return reorder(x, 1, hd)
    if op == "head_rows":
        return reorder(x, 0, 1)
    if op == "a_log":
        return torch.log(-reorder(x.to(torch.float32), 0, 1))
    raise ValueError(op)
