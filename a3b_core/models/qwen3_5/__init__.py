"""Qwen3.5/3.6: the MoE models (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B, BF16 and the official FP8 releases) and the dense
sizes that share the architecture, text-only or with their vision tower."""
from __future__ import annotations

from ..checkpoint_layout import (VISION_PREFIXES, VISION_PROBE, classify, expert_layout, load_text_model,
                                 place_text_model, stored_layers)
from ..family import Family
from ..mrope import positions
from ..vision import VisionTower
from .cache import Cache
from .config import MODEL_TYPES, describe, parse_config
from .sizes import deltanet_state_bytes, kv_bytes, prefill_chunk
from .text import TextModel

FAMILY = Family(
    name="Qwen3.5/3.6", model_types=tuple(MODEL_TYPES), parse_config=parse_config, describe=describe,
    stored_layers=stored_layers, text_model=TextModel, vision_tower=VisionTower, load_text=load_text_model,
    place_text=place_text_model, vision_prefixes=VISION_PREFIXES, vision_probe=VISION_PROBE, positions=positions,
    new_cache=Cache, classify=classify, expert_layout=expert_layout, kv_bytes=kv_bytes,
    state_bytes=deltanet_state_bytes, state_part="deltanet_state", prefill_chunk=prefill_chunk)
