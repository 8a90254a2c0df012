"""Checkpoint tensors -> module parameters: name prefixes, expert layouts, FP8, dtypes and shape checks.

Modules are built on the meta device and each parameter is materialised straight from the memory-mapped file, so
loading never holds a second copy of the weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .checkpoint import Checkpoint
from .config import TextConfig
from .errors import CheckpointError

TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "")
VISION_PREFIXES = ("model.visual.", "visual.")

Progress = Callable[[int, int], None]


def find_prefix(ckpt: Checkpoint, probe: str, prefixes: tuple[str, ...], what: str) -> str:
    for prefix in prefixes:
        if prefix + probe in ckpt:
            return prefix
    raise CheckpointError(f"{ckpt.folder}: no '{probe}' tensor under any known prefix ({', '.join(map(repr, prefixes))}),"
                          f" so the {what} weights cannot be found. Is this a Qwen3.5/3.6 checkpoint?")


def param_dtype(tensor_shape: tuple[int, ...], compute_dtype: torch.dtype) -> torch.dtype:
    """Vectors (norm weights, biases, gates' scalars) stay fp32; matrices use the compute dtype."""
    return torch.float32 if len(tensor_shape) <= 1 else compute_dtype


def _set_param(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def _checked(ckpt: Checkpoint, source: str, expected: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    info = ckpt.infos.get(source)
    if info is not None and info.shape != expected:
        raise CheckpointError(f"{info.file}: tensor '{source}' has shape {list(info.shape)} but config.json implies "
                              f"{list(expected)}. The config.json does not belong to these weights: use the one from "
                              "the same release.")
    return ckpt.weight(source, dtype)


def load_module(module: nn.Module, ckpt: Checkpoint, prefix: str, compute_dtype: torch.dtype,
                special: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor | None] = lambda *_: None,
                progress: Progress | None = None) -> None:
    """Fills every parameter of a meta-device `module` from `prefix + name` (or from `special`, if it answers)."""
    params = list(module.named_parameters())
    for n, (name, param) in enumerate(params):
        shape = tuple(param.shape)
        dtype = param_dtype(shape, compute_dtype)
        value = special(name, shape, dtype)
        if value is None:
            value = _checked(ckpt, prefix + name, shape, dtype)
        _set_param(module, name, value)
        if progress:
            progress(n + 1, len(params))


def load_text_model(module: nn.Module, cfg: TextConfig, ckpt: Checkpoint, compute_dtype: torch.dtype,
                    progress: Progress | None = None) -> None:
    prefix = find_prefix(ckpt, "embed_tokens.weight", TEXT_PREFIXES, "language model")

    def special(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if name == "lm_head.weight":
            if "lm_head.weight" in ckpt:
                return _checked(ckpt, "lm_head.weight", shape, dtype)
            if cfg.tie_word_embeddings:
                return module.embed_tokens.weight
            raise CheckpointError(f"{ckpt.folder}: 'lm_head.weight' is missing and config.json does not tie it to "
                                  "the embeddings. The checkpoint is incomplete: download all of its shards.")
        if ".mlp.experts." in name:
            layer = int(name.split(".")[1])
            return load_experts(ckpt, f"{prefix}layers.{layer}.mlp.experts.", cfg, name.rsplit(".", 1)[1], dtype)
        return None

    load_module(module, ckpt, prefix, compute_dtype, special, progress)


def load_experts(ckpt: Checkpoint, base: str, cfg: TextConfig, which: str, dtype: torch.dtype) -> torch.Tensor:
    """One layer's routed experts as the fused tensor `which` ("gate_up_proj" [E, 2I, H] or "down_proj" [E, H, I]),
    whatever the checkpoint layout: fused, fused-transposed (told apart by shape), or per-expert (FP8 or not)."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    want = (e, 2 * i, h) if which == "gate_up_proj" else (e, h, i)
    fused = base + which
    if fused in ckpt:
        shape = ckpt.infos[fused].shape
        if shape == want:
            return ckpt.weight(fused, dtype)
        if shape == (want[0], want[2], want[1]):
            return ckpt.weight(fused, dtype).transpose(1, 2).contiguous()
        raise CheckpointError(f"{ckpt.infos[fused].file}: tensor '{fused}' has shape {list(shape)}; expected "
                              f"{list(want)} (or its transpose) from config.json. Use the config.json of this release.")
    out = torch.empty(want, dtype=dtype)
    for j in range(e):
        if which == "gate_up_proj":
            out[j, :i] = _checked(ckpt, f"{base}{j}.gate_proj.weight", (i, h), dtype)
            out[j, i:] = _checked(ckpt, f"{base}{j}.up_proj.weight", (i, h), dtype)
        else:
            out[j] = _checked(ckpt, f"{base}{j}.down_proj.weight", (h, i), dtype)
    return out
