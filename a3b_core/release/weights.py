"""Checkpoint tensors -> module parameters: name prefixes, dtypes and shape checks, whatever the model family.

Modules are built on the meta device and each parameter is materialized straight from the memory-mapped file, so
loading never holds a second copy of the weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import CheckpointError
from .safetensors import Checkpoint

Progress = Callable[[int, int], None]


def prefix_of(ckpt: Checkpoint, probe: str, prefixes: tuple[str, ...]) -> str | None:
    return next((prefix for prefix in prefixes if prefix + probe in ckpt), None)


def find_prefix(ckpt: Checkpoint, probe: str, prefixes: tuple[str, ...], what: str) -> str:
    prefix = prefix_of(ckpt, probe, prefixes)
    if prefix is not None:
        return prefix
    raise CheckpointError(f"{ckpt.folder}: no '{probe}' tensor under any known prefix ({', '.join(map(repr, prefixes))}),"
                          f" so the {what} weights cannot be found. Is this a checkpoint of a supported model family?")


def stays_fp32(name: str, tensor_shape: tuple[int, ...]) -> bool:
    """Vectors (norm weights, biases, gates' scalars) and the DeltaNet conv kernels (tiny, and applied in fp32) are
    kept in fp32 whatever the compute dtype."""
    return len(tensor_shape) <= 1 or name.endswith("conv1d.weight")


def param_dtype(name: str, tensor_shape: tuple[int, ...], compute_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if stays_fp32(name, tensor_shape) else compute_dtype


def set_param(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def check_shape(ckpt: Checkpoint, source: str, expected: tuple[int, ...]) -> None:
    info = ckpt.infos.get(source)
    if info is not None and info.shape != expected:
        raise CheckpointError(f"{info.file}: tensor '{source}' has shape {list(info.shape)} but config.json implies "
                              f"{list(expected)}. The config.json does not belong to these weights: use the one from "
                              "the same release.")


def checked(ckpt: Checkpoint, source: str, expected: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    check_shape(ckpt, source, expected)
    return ckpt.weight(source, dtype)


def load_module(module: nn.Module, ckpt: Checkpoint, prefix: str, compute_dtype: torch.dtype,
                special: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor | None] = lambda *_: None,
                progress: Progress | None = None) -> None:
    """Fills every parameter of a meta-device `module` from `prefix + name` (or from `special`, if it answers)."""
    params = list(module.named_parameters())
    for n, (name, param) in enumerate(params):
        shape = tuple(param.shape)
        dtype = param_dtype(name, shape, compute_dtype)
        value = special(name, shape, dtype)
        if value is None:
            value = checked(ckpt, prefix + name, shape, dtype)
        set_param(module, name, value)
        if progress:
            progress(n + 1, len(params))


def move(module: nn.Module, device: torch.device, moved: dict[int, torch.Tensor] | None = None) -> nn.Module:
    """Puts every parameter and buffer of `module` on `device`. Each is replaced by its copy there (not changed in
    place, as Module.to does), and `moved` remembers the copies across calls, so a tensor that two modules share
    (a tied lm_head and embed_tokens) is moved once and stays shared."""
    moved = {} if moved is None else moved
    for sub in module.modules():
        for store, as_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, tensor in list(store.items()):
                if tensor is None or tensor.device == device:
                    continue
                if id(tensor) not in moved:
                    copy = tensor.to(device)
                    moved[id(tensor)] = nn.Parameter(copy, requires_grad=False) if as_param else copy
                store[name] = moved[id(tensor)]
    return module
