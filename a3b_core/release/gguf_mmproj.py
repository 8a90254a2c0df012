"""A GGUF vision projector (mmproj) as a checkpoint: the vision tower of Qwen3.5/3.6 and Qwen3-VL under the Hugging
Face release's names (model.visual.*) and layouts, its vision_config from the clip.vision.* metadata, and the check
that it belongs to the text model it is loaded with. A GGUF model and its mmproj are then one checkpoint
(GGUFWithVision).

llama.cpp's convert_hf_to_gguf.py --mmproj (Qwen3VLVisionModel, projector type qwen3vl_merger) writes the tower with
these changes, undone here (GGUF -> HF):
- patch_embed.proj.weight, a Conv3d kernel [hidden, C, 2, p, p], is split along time into v.patch_embd.weight and
  v.patch_embd.weight.1 ([hidden, C, p, p] each) -> stacked again on dim 2.
- merger.linear_fc1 / linear_fc2 are mm.0 / mm.2, merger.norm is v.post_ln; deepstack_merger_list.K is
  v.deepstack.B, B being the block that DeepStack level K reads (clip.vision.is_deepstack_layers marks them).
- every other tensor is only renamed (qkv stays fused; the position table, norms and biases are kept as they are).

The float types F32, F16 and BF16 are read as stored; block-quantized matrices (Q8_0, ...: the types a GGUF model's
tensors are read in) are dequantized to float32 when read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from .gguf import FLOAT_TYPES, GGUFCheckpoint, MappedCheckpoint, MappedTensors, metadata, open_reader
from .gguf_file import BLOCK_TYPES, TensorRecord, check_gguf_file

VISION = "model.visual."
PROJECTOR_TYPE = "qwen3vl_merger"
IMAGE_NORMALIZATION = (0.5, 0.5, 0.5)  # the releases' image_mean and image_std, which media.image applies
PATCH_HALVES = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # -> patch_embed.proj.weight, stacked on dim 2
TOP = {"v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
       "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
       "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
       "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
BLOCK_PARTS = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
               "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
DEEPSTACK_PARTS = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
_BLOCK = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_DEEPSTACK = re.compile(r"^v\.deepstack\.(\d+)\.(\w+)\.(weight|bias)$")
# The model families (text config model_type) and whether their vision towers have DeepStack mergers.
DEEPSTACK_FAMILIES = {"qwen3_vl_moe": True, "qwen3_vl": True, "qwen3_5_moe": False, "qwen3_5": False}
FAMILY_NAMES = {True: "Qwen3-VL", False: "Qwen3.5/3.6"}


@dataclass(frozen=True)
class MmprojTensorInfo:
    """One HF vision tensor of an mmproj: its shape and dtype as the release has them, and where it comes from."""
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    sources: tuple[TensorRecord, ...]  # one GGUF tensor, or the two temporal halves of the patch embedding


class MmprojCheckpoint(MappedCheckpoint):
    """An mmproj GGUF's tensors under the HF release's names (model.visual....), and its `vision_config`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.folder = self.path
        self.files = [self.path]
        records = check_gguf_file(self.path)
        self.reader = open_reader(self.path, records)
        arch, kind = metadata(self.reader, "general.architecture"), metadata(self.reader, "general.type")
        projector = metadata(self.reader, "clip.projector_type", metadata(self.reader, "clip.vision.projector_type"))
        if arch != "clip" or not metadata(self.reader, "clip.has_vision_encoder", False):
            raise CheckpointError(f"{self.path}: not a vision projector (general.architecture {arch!r}, general.type "
                                  f"{kind!r}; an mmproj has 'clip' with a vision encoder). Pass the mmproj-*.gguf "
                                  "file converted from the model's release, or mmproj='none' for text only.")
        if projector != PROJECTOR_TYPE:
            raise CheckpointError(f"{self.path}: projector type {projector!r} is not {PROJECTOR_TYPE!r} (Qwen3.5/3.6 "
                                  "and Qwen3-VL): an mmproj of another model. Pass the mmproj converted from the "
                                  "same release as the model, or mmproj='none' for text only.")
        for record in records:
            if record.type_name not in FLOAT_TYPES and record.type_name not in BLOCK_TYPES:
                raise CheckpointError(
                    f"{self.path}: tensor '{record.name}' is stored as {record.type_name}; mmproj tensors are read in "
                    f"{', '.join([*FLOAT_TYPES, *BLOCK_TYPES])}. Use an F16, BF16 or F32 mmproj.")
        self.deepstack_blocks = self._deepstack_blocks()
        self.infos: dict[str, MmprojTensorInfo] = self._map(records)
        self.vision_config = self._vision_config()
        self.tensors = MappedTensors()
        self._sorted_names: list[str] = []

    # ------------------------------------------------------------------------------------------- names and config
    def _key(self, name: str) -> Any:
        value = metadata(self.reader, f"clip.vision.{name}")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{self.path}: the metadata key 'clip.vision.{name}' is {value!r}; expected a "
                                  "positive integer. Convert the mmproj again with a current llama.cpp "
                                  "(convert_hf_to_gguf.py --mmproj).")
        return value

    def _deepstack_blocks(self) -> list[int]:
        marks = metadata(self.reader, "clip.vision.is_deepstack_layers", [])
        return [index for index, mark in enumerate(marks) if mark]

    def _map(self, records: list[TensorRecord]) -> dict[str, MmprojTensorInfo]:
        level_of = {block: level for level, block in enumerate(self.deepstack_blocks)}
        infos: dict[str, MmprojTensorInfo] = {}
        halves: dict[str, TensorRecord] = {}
        for record in records:
            block, deepstack = _BLOCK.match(record.name), _DEEPSTACK.match(record.name)
            if record.name in PATCH_HALVES:
                halves[record.name] = record
                continue
            if record.name in TOP:
                name = TOP[record.name]
            elif block and block[2] in BLOCK_PARTS:
                name = f"blocks.{block[1]}.{BLOCK_PARTS[block[2]]}.{block[3]}"
            elif deepstack and deepstack[2] in DEEPSTACK_PARTS and int(deepstack[1]) in level_of:
                name = f"deepstack_merger_list.{level_of[int(deepstack[1])]}.{DEEPSTACK_PARTS[deepstack[2]]}." \
                       f"{deepstack[3]}"
            else:
                raise CheckpointError(f"{self.path}: tensor '{record.name}' is not one llama.cpp's converter writes "
                                      f"for a {PROJECTOR_TYPE} vision tower; the file is from another converter or "
                                      "model. Convert the mmproj again with a current llama.cpp.")
            infos[VISION + name] = self._info(VISION + name, (record,))
        if set(halves) != set(PATCH_HALVES):
            raise CheckpointError(f"{self.path}: the patch embedding needs both {' and '.join(PATCH_HALVES)} (the two "
                                  "temporal halves of its Conv3d kernel); the file is incomplete or from another "
                                  "converter. Convert the mmproj again.")
        name = VISION + "patch_embed.proj.weight"
        infos[name] = self._info(name, tuple(halves[h] for h in PATCH_HALVES))
        return infos

    def _info(self, name: str, sources: tuple[TensorRecord, ...]) -> MmprojTensorInfo:
        shapes = {tuple(reversed(r.ne)) for r in sources}
        if len(shapes) != 1:
            raise CheckpointError(f"{self.path}: the two halves of the patch embedding have shapes "
                                  f"{sorted(map(list, shapes))}; they must be equal. The file is corrupt.")
        shape = shapes.pop()
        if len(sources) == 2:
            if len(shape) != 4:
                raise CheckpointError(f"{self.path}: '{sources[0].name}' has shape {list(shape)}; expected a "
                                      "[hidden, channels, patch, patch] kernel. The file is corrupt.")
            shape = (shape[0], shape[1], 2, shape[2], shape[3])
        dtypes = {FLOAT_TYPES.get(r.type_name, torch.float32) for r in sources}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        return MmprojTensorInfo(name, self.path, dtype, shape, sum(r.nbytes for r in sources), sources)

    def _vision_config(self) -> dict[str, Any]:
        """The release's config.json vision_config, from the metadata and the tensors' shapes."""
        depth, patch = self._key("block_count"), self._key("patch_size")
        table = self.infos.get(VISION + "pos_embed.weight")
        if table is None or len(table.shape) != 2:
            raise CheckpointError(f"{self.path}: the position table 'v.position_embd.weight' is missing or not a "
                                  "matrix; the file is incomplete or from another converter. Convert the mmproj "
                                  "again.")
        positions, hidden = table.shape
        image_size = self._key("image_size")
        if positions != (image_size // patch) ** 2:
            raise CheckpointError(f"{self.path}: the position table has {positions} rows, but image_size "
                                  f"{image_size} / patch_size {patch} implies {(image_size // patch) ** 2}. The "
                                  "metadata contradicts the tensors: convert the mmproj again.")
        for key in ("image_mean", "image_std"):
            value = metadata(self.reader, f"clip.vision.{key}")
            if value is not None and not np.allclose(value, IMAGE_NORMALIZATION, atol=1e-6):
                raise CheckpointError(f"{self.path}: clip.vision.{key} is {list(value)}, but Qwen3.5/3.6 and Qwen3-VL "
                                      f"images are normalized with {list(IMAGE_NORMALIZATION)}: an mmproj of another "
                                      "model. Pass the mmproj converted from the model's release.")
        if any(block >= depth for block in self.deepstack_blocks):
            raise CheckpointError(f"{self.path}: clip.vision.is_deepstack_layers marks blocks "
                                  f"{self.deepstack_blocks} of {depth}. The file is corrupt: convert it again.")
        config = {
            "depth": depth, "hidden_size": self._key("embedding_length"),
            "num_heads": self._key("attention.head_count"), "intermediate_size": self._key("feed_forward_length"),
            "patch_size": patch, "temporal_patch_size": 2, "spatial_merge_size": self._key("spatial_merge_size"),
            "in_channels": self.infos[VISION + "patch_embed.proj.weight"].shape[1],
            "num_position_embeddings": positions, "out_hidden_size": self._key("projection_dim"),
            # llama.cpp runs the blocks' MLP with its tanh-approximated GELU, as the releases' gelu_pytorch_tanh
            "hidden_act": "gelu_pytorch_tanh",
        }
        if not metadata(self.reader, "clip.use_gelu", False):
            raise CheckpointError(f"{self.path}: clip.use_gelu is not set, but Qwen3.5/3.6 and Qwen3-VL vision blocks "
                                  "use GELU: an mmproj of another model or converter. Convert the mmproj again with "
                                  "a current llama.cpp.")
        if hidden != config["hidden_size"]:
            raise CheckpointError(f"{self.path}: the position table is {hidden} wide but clip.vision.embedding_length "
                                  f"is {config['hidden_size']}. The file is corrupt: convert it again.")
        if self.deepstack_blocks:
            config["deepstack_visual_indexes"] = list(self.deepstack_blocks)
        return config

    def check_fits(self, model_path: Path, text_config: dict, model_type: str) -> None:
        """Refuses an mmproj of another model: another family (DeepStack or not), or a projection size that is not the
        text model's hidden size."""
        fix = (f"an mmproj of another model. Use the mmproj converted from the same release as {model_path.name}, "
               "or mmproj='none' for text only.")
        wants_deepstack = DEEPSTACK_FAMILIES.get(model_type)
        has_deepstack = bool(self.deepstack_blocks)
        if wants_deepstack is not None and wants_deepstack != has_deepstack:
            raise CheckpointError(f"{self.path} is a {FAMILY_NAMES[has_deepstack]} vision tower but {model_path} is "
                                  f"a {FAMILY_NAMES[wants_deepstack]} model: {fix}")
        projection, hidden = self.vision_config["out_hidden_size"], text_config.get("hidden_size")
        if projection != hidden:
            raise CheckpointError(f"{self.path} projects images to {projection} features but {model_path} has hidden "
                                  f"size {hidden}: {fix}")
        merger_out = self.infos.get(VISION + "merger.linear_fc2.weight")
        if merger_out is None or merger_out.shape[0] != projection:
            shape = None if merger_out is None else list(merger_out.shape)
            raise CheckpointError(f"{self.path}: the merger's output 'mm.2.weight' is {shape}, expected "
                                  f"{projection} rows (clip.vision.projection_dim). The file is corrupt or from "
                                  "another converter: convert it again.")

    # ------------------------------------------------------------------------------------------------ tensors
    def raw(self, name: str) -> torch.Tensor:
        """The tensor as the HF release has it (the patch embedding's halves stacked again)."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing (this mmproj has no "
                                  f"{name.removeprefix(VISION)}). The file is incomplete or of another model: "
                                  "convert the mmproj again.")
        parts = [self.tensors.as_float(r).to(info.dtype) for r in info.sources]
        return torch.stack(parts, dim=2) if len(parts) == 2 else parts[0]

    def weight_at(self, name: str, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.raw(name)[index].to(dtype)


class GGUFWithVision:
    """A GGUF model and its mmproj as one checkpoint (the interface of GGUFCheckpoint and safetensors.Checkpoint):
    the text tensors from the model, model.visual.* from the mmproj. `folder` is the model file (caches and
    messages name it); `files` both files."""

    def __init__(self, text: GGUFCheckpoint, vision: MmprojCheckpoint):
        self.text, self.vision = text, vision
        self.path = self.folder = text.path
        self.files = [text.path, vision.path]
        self.reader = text.reader
        self.infos: dict[str, Any] = {**text.infos, **vision.infos}

    @property
    def fp8_block(self) -> tuple[int, int]:
        return self.text.fp8_block

    @fp8_block.setter
    def fp8_block(self, value: tuple[int, int]) -> None:
        self.text.fp8_block = value

    def _part(self, name: str) -> GGUFCheckpoint | MmprojCheckpoint:
        return self.vision if name.startswith(VISION) else self.text

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def raw(self, name: str) -> torch.Tensor:
        return self._part(name).raw(name)

    def weight(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._part(name).weight(name, dtype)

    def weight_at(self, name: str, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._part(name).weight_at(name, index, dtype)

    def release(self, name: str) -> None:
        self._part(name).release(name)

    def release_under(self, prefix: str) -> None:
        self.text.release_under(prefix)
        self.vision.release_under(prefix)

    def close(self) -> None:
        self.text.close()
        self.vision.close()


def find_mmproj(model_path: str | Path) -> Path | None:
    """The mmproj beside a GGUF model: the one mmproj*.gguf in its folder; of several, the one whose name (after
    'mmproj') shares the longest start with the model file's name, if only one does. None when there is none."""
    model_path = Path(model_path)
    candidates = sorted(p for p in model_path.parent.glob("*")
                        if p.is_file() and p.suffix.lower() == ".gguf" and p.name.lower().startswith("mmproj")
                        and p != model_path)
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    stem = model_path.stem.lower()

    def shared(candidate: Path) -> int:
        rest = candidate.stem.lower().removeprefix("mmproj").lstrip("-_. ")
        return len(next((stem[:n] for n in range(min(len(stem), len(rest)), 0, -1) if stem[:n] == rest[:n]), ""))

    scores = {candidate: shared(candidate) for candidate in candidates}
    best = max(scores.values())
    winners = [candidate for candidate, score in scores.items() if score == best]
    if best > 0 and len(winners) == 1:
        return winners[0]
    raise CheckpointError(f"{model_path}: {len(candidates)} vision projectors lie beside the model "
                          f"({', '.join(c.name for c in candidates)}) and none is clearly its own. Pass the one to "
                          "use with mmproj= (the CLI's --mmproj, the loader node's mmproj input), or mmproj='none' "
                          "for text only.")
