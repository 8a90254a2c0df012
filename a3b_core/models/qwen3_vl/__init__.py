"""Qwen3-VL: the MoE models (Qwen3-VL-30B-A3B-Instruct / -Thinking, BF16 and the official FP8 releases) and the dense
sizes (2B, 4B, 8B, 32B), text-only or with their DeepStack vision tower."""
from __future__ import annotations

from ..checkpoint_layout import (VISION_PREFIXES, VISION_PROBE, classify, expert_layout, load_text_model,
                                 place_text_model, stored_layers)
from ..family import Family
from ..mrope import positions
from ..vision import VisionTower
from .config import MODEL_TYPES, describe, parse_config
from .sizes import kv_bytes, prefill_chunk, state_bytes
from .text import TextModel, new_cache

FAMILY = Family(
    name="Qwen3-VL", model_types=tuple(MODEL_TYPES), parse_config=parse_config, describe=describe,
    stored_layers=stored_layers, text_model=TextModel, vision_tower=VisionTower, load_text=load_text_model,
    place_text=place_text_model, vision_prefixes=VISION_PREFIXES, vision_probe=VISION_PROBE, positions=positions,
    new_cache=new_cache, classify=classify, expert_layout=expert_layout, kv_bytes=kv_bytes, state_bytes=state_bytes,
    state_part="", prefill_chunk=prefill_chunk)
