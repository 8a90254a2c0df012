"""Checkpoints of the Qwen families -> their modules: tensor names and prefixes (the same in every family's
releases), routed-expert layouts (fused [E, 2I, H] as Qwen3.5's BF16 release, fused and transposed [E, H, 2I] as
Qwen3-VL's BF16 release and, in FP8 with stacked block scales, its FP8 release; per-expert, and FP8 per expert with
block scales as Qwen3.5's FP8 release), and which part of the model each tensor belongs to (for the planner)."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..formats.fp8 import FP8_BLOCK, Fp8Linear
from ..formats.gguf import GgufBlocks
from ..formats.stores import QuantizedExperts, convert_experts
from ..formats.dense import QuantizedLinear, ReleasedMatrix, is_quantised_dense
from ..formats.table import FLOAT_FORMATS, FORMAT_OF_DTYPE, FP8, GGUF, format_named
from ..release.config import ModelConfig, StoredLayers
from ..release.safetensors import FP8_DTYPES, Checkpoint
from ..release.weights import Progress, check_shape, checked, find_prefix, load_module, move, prefix_of
from .layers import RoutedExperts

TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "")
VISION_PREFIXES = ("model.visual.", "visual.")
VISION_PROBE = "pos_embed.weight"  # a tensor every vision tower has: where the vision weights are found
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def stored_layers(ckpt: Checkpoint) -> StoredLayers:
    """How many decoder layers and vision blocks the checkpoint holds, from its tensor names alone."""
    return StoredLayers(text=_block_count(ckpt, "embed_tokens.weight", TEXT_PREFIXES, "layers"),
                        vision=_block_count(ckpt, VISION_PROBE, VISION_PREFIXES, "blocks"))


def _block_count(ckpt: Checkpoint, probe: str, prefixes: tuple[str, ...], blocks: str) -> int | None:
    """Highest `<prefix><blocks>.N.` index + 1 under the prefix that holds `probe`; None when no prefix does."""
    prefix = prefix_of(ckpt, probe, prefixes)
    if prefix is None:
        return None
    numbered = re.compile(re.escape(prefix + blocks) + r"\.(\d+)\.")
    return max((int(match[1]) + 1 for match in map(numbered.match, ckpt.infos) if match), default=0)


ExpertPlacement = Callable[[int], tuple[str, torch.device]]  # layer -> (expert format, device)


def load_text_model(module: nn.Module, cfg: Any, ckpt: Checkpoint, compute_dtype: torch.dtype,
                    progress: Progress | None = None, expert_placement: ExpertPlacement | None = None,
                    cache_dirs: Mapping[str, Path] | None = None, released_dense: str | None = None) -> str:
    """Fills a meta-device text model (layers.DecoderModel; `cfg` has the fields layers.py reads). Routed experts
    follow `expert_placement` (default: the compute dtype, on the CPU): float formats are loaded on the CPU (placing
    the model moves them), quantized ones are built on their device; int8/int4 are converted one expert at a time
    and cached under `cache_dirs[format]` for the next load.
    `released_dense` fp8: dense matrices stored as FP8 stay FP8 (Fp8Linear); gguf: dense matrices that
    formats/dense.py quantizes stay in a GGUF's blocks where it stores them so (QuantizedLinear). A tied lm_head is
    the embedding's own Parameter. Returns the checkpoint's name prefix."""
    prefix = find_prefix(ckpt, "embed_tokens.weight", TEXT_PREFIXES, "language model")
    if released_dense is not None:
        keep_released_linears(module, ckpt, prefix, released_dense)
    placement = expert_placement or (lambda layer: (FORMAT_OF_DTYPE[compute_dtype], torch.device("cpu")))
    float_experts: dict[int, torch.dtype] = {}
    for layer, block in enumerate(module.layers):
        if not isinstance(block.mlp, RoutedExperts):
            continue
        fmt, device = placement(layer)
        if fmt in FLOAT_FORMATS:
            float_experts[layer] = FLOAT_FORMATS[fmt]
        else:
            cache_dir = (cache_dirs or {}).get(fmt)
            block.mlp.experts = load_quantized_experts(ckpt, f"{prefix}layers.{layer}.mlp.experts.", cfg, fmt, device,
                                                       cache_dir / f"layer{layer}.safetensors" if cache_dir else None)

    def special(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if name == "lm_head.weight":
            if "lm_head.weight" in ckpt:
                return checked(ckpt, "lm_head.weight", shape, dtype)
            if cfg.tie_word_embeddings:
                return module.embed_tokens.weight
            raise CheckpointError(f"{ckpt.folder}: 'lm_head.weight' is missing and config.json does not tie it to "
                                  "the embeddings. The checkpoint is incomplete: download all of its shards.")
        if ".mlp.experts." in name:
            layer = int(name.split(".")[1])
            base, which = f"{prefix}layers.{layer}.mlp.experts.", name.rsplit(".", 1)[1]
            return load_experts(ckpt, base, cfg, which, float_experts[layer])
        return None

    load_module(module, ckpt, prefix, compute_dtype, special, progress)
    if "lm_head.weight" not in ckpt:
        module.lm_head.weight = module.embed_tokens.weight
    return prefix


def keep_released_linears(module: nn.Module, ckpt: Checkpoint, prefix: str, fmt: str) -> None:
    """Swaps each bias-free Linear whose checkpoint weight is stored in `fmt` for a module that keeps it so: FP8
    (with block scales) an Fp8Linear; GGUF blocks, for the matrices formats/dense.py quantizes, a QuantizedLinear
    (the mapped pages are then dropped: the blocks are copied)."""
    for name, child in list(module.named_modules()):
        source = "lm_head.weight" if name == "lm_head" else f"{prefix}{name}.weight"  # the releases' names
        if not (isinstance(child, nn.Linear) and child.bias is None and source in ckpt):
            continue
        check_shape(ckpt, source, tuple(child.weight.shape))
        parent, _, leaf = name.rpartition(".")
        if fmt == FP8 and source + "_scale_inv" in ckpt and ckpt.infos[source].dtype in FP8_DTYPES:
            kept = Fp8Linear(ckpt.raw(source), ckpt.raw(source + "_scale_inv"), ckpt.fp8_block)
        elif fmt == GGUF and is_quantised_dense(source, tuple(child.weight.shape)) \
                and (blocks := ckpt.matrix_blocks(source)) is not None:
            kept = QuantizedLinear(GGUF, ReleasedMatrix(tuple(child.weight.shape), *blocks))
            ckpt.release(source)
        else:
            continue
        setattr(module.get_submodule(parent), leaf, kept)


def load_experts(ckpt: Checkpoint, base: str, cfg: Any, which: str, dtype: torch.dtype) -> torch.Tensor:
    """One layer's routed experts as the fused tensor `which` ("gate_up_proj" [E, 2I, H] or "down_proj" [E, H, I])."""
    e = cfg.num_experts
    fused = base + which
    shape = expert_shape(cfg, which, fused=True)
    info = ckpt.infos.get(fused)
    if info is not None and info.dtype not in FP8_DTYPES:  # FP8 ones are dequantized expert by expert, below
        if info.shape == shape:
            return ckpt.weight(fused, dtype)
        if info.shape == (e, shape[2], shape[1]):  # stored transposed: copied into the layout the products read
            out = torch.empty(shape, dtype=dtype).copy_(ckpt.raw(fused).transpose(1, 2))
            ckpt.release(fused)
            return out
    out = torch.empty(shape, dtype=dtype)
    for j in range(e):
        out[j] = expert_matrix(ckpt, base, cfg, which, j).to(dtype)
    return out


def expert_shape(cfg: Any, which: str, fused: bool = False) -> tuple[int, ...]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    shape = (2 * i, h) if which == "gate_up_proj" else (h, i)
    return (cfg.num_experts, *shape) if fused else shape


def expert_matrix(ckpt: Checkpoint, base: str, cfg: Any, which: str, j: int) -> torch.Tensor:
    """Expert j's fp32 matrix [2I, H] (gate rows, then up) or [H, I], whatever the checkpoint layout: fused,
    fused-transposed (told apart by shape: H != I != 2I in every real model), or per-expert, FP8 or not."""
    out_dim, in_dim = expert_shape(cfg, which)
    fused = base + which
    if fused in ckpt:
        shape = ckpt.infos[fused].shape
        if shape == (cfg.num_experts, out_dim, in_dim):
            return ckpt.weight_at(fused, j)
        if shape == (cfg.num_experts, in_dim, out_dim):
            return ckpt.weight_at(fused, j).t()
        raise CheckpointError(f"{ckpt.infos[fused].file}: tensor '{fused}' has shape {list(shape)}; expected "
                              f"{[cfg.num_experts, out_dim, in_dim]} (or its transpose) from config.json. Use the "
                              "config.json of this release.")
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    if which == "down_proj":
        return checked(ckpt, f"{base}{j}.down_proj.weight", (h, i), torch.float32)
    return torch.cat([checked(ckpt, f"{base}{j}.gate_proj.weight", (i, h), torch.float32),
                      checked(ckpt, f"{base}{j}.up_proj.weight", (i, h), torch.float32)])


def load_quantized_experts(ckpt: Checkpoint, base: str, cfg: Any, fmt: str, device: torch.device,
                           cache_file: Path | None) -> QuantizedExperts:
    """One layer's routed experts (checkpoint names under `base`) in a quantized format, as formats/stores.py makes
    them: the released FP8 matrices where the format is fp8 and the blocks line up, a GGUF's blocks where the format
    is gguf, else each expert's matrix."""

    def released_fp8(which: str, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        fused = base + which
        if fused in ckpt:  # fused FP8 experts are kept if their blocks are the store's (square: transposing keeps them)
            if fused + "_scale_inv" not in ckpt or ckpt.fp8_block != (FP8_BLOCK, FP8_BLOCK):
                return None
            q, scale = ckpt.raw(fused)[e], ckpt.raw(fused + "_scale_inv")[e]
            return (q, scale) if q.shape == expert_shape(cfg, which) else (q.t(), scale.t())
        if cfg.moe_intermediate_size % FP8_BLOCK or base + f"{e}.down_proj.weight_scale_inv" not in ckpt:
            return None
        names = [f"{base}{e}.{part}.weight" for part in (["down_proj"] if which == "down_proj"
                                                          else ["gate_proj", "up_proj"])]
        # gate and up stacked: their scale blocks line up, the intermediate size being a multiple of the block
        return torch.cat([ckpt.raw(n) for n in names]), torch.cat([ckpt.raw(n + "_scale_inv").float() for n in names])

    def released_blocks(which: str, e: int) -> tuple | None:
        return ckpt.blocks_at(base + which, e)

    stored = None
    if format_named(fmt).layout is GgufBlocks:  # a GGUF's experts as stored: the block types of each matrix's parts
        stored = {which: (tuple((t, b.shape[0]) for t, b in released_blocks(which, 0)),)
                  for which in ("gate_up_proj", "down_proj")}
    experts = convert_experts(fmt, (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size),
                              lambda which, e: expert_matrix(ckpt, base, cfg, which, e),
                              released_fp8 if stored is None else released_blocks, device, cache_file,
                              lambda: ckpt.release_under(base), stored)
    return move(experts, device)


def place_text_model(text: nn.Module, dense: torch.device, embed: torch.device,
                     expert_devices: dict[int, torch.device]) -> None:
    """Moves the dense parts to `dense`, the embedding table to `embed` and the routed experts of the layers in
    `expert_devices` to theirs (other layers' experts stay where loading put them). A tied lm_head stays the
    embedding table itself, so it is never held twice."""
    moved: dict[int, torch.Tensor] = {}
    move(text.embed_tokens, embed, moved)
    for index, layer in enumerate(text.layers):
        experts = layer.mlp._modules.pop("experts", None)
        move(layer, dense, moved)
        if experts is not None:
            layer.mlp.experts = move(experts, expert_devices[index]) if index in expert_devices else experts
    move(text.norm, dense, moved)
    move(text.lm_head, dense, moved)


# --------------------------------------------------------------------------------------- parts, for the planner
def classify(name: str) -> tuple[str, int | None]:
    """A tensor name -> (group, text layer or None). Groups: embed_tokens, lm_head, mixers, shared_experts,
    routers, mlp (dense models), norms, experts (routed), vision, mtp, other."""
    if name.startswith("mtp.") or ".mtp." in name:
        return "mtp", None
    if name.startswith("visual.") or ".visual." in name:
        return "vision", None
    if name.endswith("embed_tokens.weight"):
        return "embed_tokens", None
    if name.endswith("lm_head.weight"):
        return "lm_head", None
    match = _LAYER.search(name)
    if match is None:
        return ("norms" if name.endswith("norm.weight") else "other"), None
    layer, rest = int(match[1]), match[2]
    for prefix, group in (("mlp.experts.", "experts"), ("mlp.gate.", "routers"),
                          ("mlp.shared_expert", "shared_experts"), ("mlp.", "mlp"),
                          ("linear_attn.", "mixers"), ("self_attn.", "mixers")):
        if rest.startswith(prefix):
            return group, layer
    return ("norms" if "norm" in rest else "other"), layer


def expert_layout(config: ModelConfig, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
    """How the routed experts of the text layers are stored: fused, fused-transposed, per-expert, or none."""
    names = [n for n in tensors if classify(n)[0] == "experts"]
    if not names:
        return "none (dense MLP)"
    fp8 = " fp8 (block scales)" if any(tensors[n][1] in FP8_DTYPES for n in names) else ""
    fused = [n for n in names if n.endswith("experts.gate_up_proj")]
    if not fused:
        return "per-expert" + fp8
    t = config.text
    shape = tuple(tensors[fused[0]][0])
    if shape == (t.num_experts, 2 * t.moe_intermediate_size, t.hidden_size):
        return "fused [E, 2I, H]" + fp8
    if shape == (t.num_experts, t.hidden_size, 2 * t.moe_intermediate_size):
        return "fused-transposed [E, H, 2I]" + fp8
    return f"fused, unexpected shape {list(shape)}"
