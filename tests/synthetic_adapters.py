"""LoRA adapters in PEFT's saved format written without PEFT (seeded random factors), for tests that need an adapter
of a given shape quickly: bad inputs, every weight format, the stand-in GPU, the CLI and ComfyUI. Tests that compare
against PEFT itself build their adapters with PEFT (tests/tiny_loras.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from a3b_core.runtime.loader import DEMO_MODELS

PEFT_PREFIX = "base_model.model."


def factors(out: int, inp: int, r: int, seed: int, size: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_A [r, in] and lora_B [out, r], seeded, whose product has entries of about `size` / sqrt(in)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, inp, generator=g) / inp ** 0.5, torch.randn(out, r, generator=g) * size / r ** 0.5


def write_adapter(folder: Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], r: int, alpha: float,
                  tensors: dict[str, torch.Tensor] | None = None, **config: object) -> Path:
    """A PEFT adapter folder: `weights` maps module names (as in the transformers model) to (lora_A, lora_B);
    `tensors` adds raw entries (names without PEFT's prefix); `config` adds or overrides adapter_config.json keys."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = {f"{PEFT_PREFIX}{name}.lora_{which}.weight": t.contiguous()
             for name, (a, b) in weights.items() for which, t in (("A", a), ("B", b))}
    saved |= {f"{PEFT_PREFIX}{name}": t.contiguous() for name, t in (tensors or {}).items()}
    save_file(saved, folder / "adapter_model.safetensors")
    targets = sorted({name.rsplit(".", 1)[-1] for name in weights})
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "use_rslora": False} | config))
    return folder


def qwen3_5_adapter(folder: Path, config: dict, r: int = 4, seed: int = 0, size: float = 0.5,
                    vision: bool = True, experts: bool = True) -> Path:
    """An adapter on every kind of weight of a Qwen3.5 MoE vision-language model (config: its config.json):
    attention q/o, DeltaNet in_proj_qkv / out_proj, shared-expert gate_proj, the routed experts' stacks, lm_head, and
    the vision tower's qkv and the merger's first Linear."""
    text, prefix = config["text_config"], "model.language_model.layers"
    h, heads, hd = text["hidden_size"], text["num_attention_heads"], text["head_dim"]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, kind in enumerate(text["layer_types"]):
        if kind == "full_attention":
            weights[f"{prefix}.{i}.self_attn.q_proj"] = factors(2 * heads * hd, h, r, seed + 10 * i, size)
            weights[f"{prefix}.{i}.self_attn.o_proj"] = factors(h, heads * hd, r, seed + 10 * i + 1, size)
        else:
            keys = text["linear_num_key_heads"] * text["linear_key_head_dim"]
            values = text["linear_num_value_heads"] * text["linear_value_head_dim"]
            weights[f"{prefix}.{i}.linear_attn.in_proj_qkv"] = factors(2 * keys + values, h, r, seed + 10 * i, size)
            weights[f"{prefix}.{i}.linear_attn.out_proj"] = factors(h, values, r, seed + 10 * i + 1, size)
        shared = text["shared_expert_intermediate_size"]
        weights[f"{prefix}.{i}.mlp.shared_expert.gate_proj"] = factors(shared, h, r, seed + 10 * i + 2, size)
        if experts:
            e, inter = text["num_experts"], text["moe_intermediate_size"]
            # as PEFT saves target_parameters: A [E * r, in], B [out, r * E]; nested wrappers put one stack's
            # factors under `.base_layer`
            weights[f"{prefix}.{i}.mlp.experts.base_layer"] = factors(2 * inter, h, r * e, seed + 10 * i + 3, size)
            weights[f"{prefix}.{i}.mlp.experts"] = factors(h, inter, r * e, seed + 10 * i + 4, size)
    weights["lm_head"] = factors(text["vocab_size"], h, r, seed + 7, size)
    if vision:
        v = config["vision_config"]
        vh, merged = v["hidden_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
        for block in range(v["depth"]):
            weights[f"model.visual.blocks.{block}.attn.qkv"] = factors(3 * vh, vh, r, seed + 100 + block, size)
        weights["model.visual.merger.linear_fc1"] = factors(merged, merged, r, seed + 200, size)
    return write_adapter(folder, weights, r, 2 * r)


def write_demo_adapter(folder: Path, seed: int = 0, rank: int = 4, size: float = 6.0) -> Path:
    """An adapter for the demo models (their config.json gives the sizes) on the full-attention layers' q_proj and the
    DeltaNet layers' out_proj, large enough to change the demo's greedy answers."""
    text = json.loads((DEMO_MODELS["a3b-demo"] / "config.json").read_text())["text_config"]
    hidden, heads, head_dim = text["hidden_size"], text["num_attention_heads"], text["head_dim"]
    values = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    weights = {}
    for layer, kind in enumerate(text["layer_types"]):
        # q_proj computes the queries and their output gate: 2 * heads * head_dim outputs
        module, inputs, outputs = (("self_attn.q_proj", hidden, 2 * heads * head_dim) if kind == "full_attention"
                                   else ("linear_attn.out_proj", values, hidden))
        weights[f"model.language_model.layers.{layer}.{module}"] = factors(outputs, inputs, rank, seed + layer, size)
    return write_adapter(folder, weights, rank, rank)
