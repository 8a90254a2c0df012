"""Small LoRA adapters for the demo model, written in PEFT's format (adapter_config.json and
adapter_model.safetensors) without PEFT: random seeded factors on the full-attention layers' q_proj and the DeltaNet
layers' out_proj, large enough to change the demo's greedy answers."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from a3b_core.runtime.loader import DEMO_MODELS

PEFT_LAYERS = "base_model.model.model.language_model.layers"


def write_demo_adapter(folder: Path, seed: int = 0, rank: int = 4, scale: float = 0.5) -> Path:
    """Writes an adapter for the demo models (their config.json gives the sizes) into `folder`; returns `folder`."""
    text = json.loads((DEMO_MODELS["a3b-demo"] / "config.json").read_text())["text_config"]
    hidden, heads, head_dim = text["hidden_size"], text["num_attention_heads"], text["head_dim"]
    delta_width = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, kind in enumerate(text["layer_types"]):
        # q_proj computes the queries and their output gate: 2 * heads * head_dim outputs
        module, inputs, outputs = (("self_attn.q_proj", hidden, 2 * heads * head_dim) if kind == "full_attention"
                                   else ("linear_attn.out_proj", delta_width, hidden))
        name = f"{PEFT_LAYERS}.{layer}.{module}"
        tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) * scale
        tensors[f"{name}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj", "out_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder
