"""The interface of a model family: what differs between families, as the engine, the planner and generation use
it."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..release.config import ModelConfig, StoredLayers
from ..release.safetensors import Checkpoint

Tensors = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # checkpoint name -> (shape, dtype)


@dataclass(frozen=True)
class Family:
    """What differs between model families, as the engine, the planner and generation use it."""
    name: str
    model_types: tuple[str, ...]
    parse_config: Callable[[dict, str, StoredLayers | None], ModelConfig]
    describe: Callable[[ModelConfig], list[str]]  # the config in a few lines, for `inspect`
    stored_layers: Callable[[Checkpoint], StoredLayers]  # decoder layers and vision blocks the weights hold
    text_model: Callable[[Any], nn.Module]  # the text decoder for config.text (built on the meta device)
    vision_tower: Callable[[Any], nn.Module]  # the vision tower for config.vision
    load_text: Callable[..., str]  # fills a text decoder from the checkpoint; returns its name prefix
    place_text: Callable[..., None]  # (text, dense device, embedding device, {layer: routed experts' device})
    vision_prefixes: tuple[str, ...]  # where the vision tower's tensors may be named
    vision_probe: str  # a tensor name every vision tower has
    positions: Callable[..., tuple[torch.Tensor, int]]  # one prompt's rotary positions and rope delta
    new_cache: Callable[..., Any]  # a generation cache for a batch
    classify: Callable[[str], tuple[str, int | None]]  # a tensor name -> (planner group, text layer)
    expert_layout: Callable[[ModelConfig, Tensors], str]  # how routed experts are stored, for `inspect`
    kv_bytes: Callable[[ModelConfig, int, str, str], int]  # (config, tokens, kv format, compute format)
    state_bytes: Callable[[ModelConfig], int]  # recurrent state of one sequence, at any length
    state_part: str  # the planner's name for that state ("<kind>_state"), "" for a family without one
    prefill_chunk: Callable[[ModelConfig, int, int, str], int]  # (config, workspace, rows, compute format) -> tokens
