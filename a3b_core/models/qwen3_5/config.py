"""Qwen3.5/3.6 config.json -> frozen dataclasses, accepting every key spelling the family's releases use."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...release.config import (ModelConfig, StoredLayers, check_grouped, eos_token_ids, experts_per_token, field,
                               layer_count, model_config, positive, positive_real, rope_config)
from ..vision import parse_vision_config

MODEL_TYPES = {
    "qwen3_5_moe": True, "qwen3_5_moe_text": True,  # value: is MoE
    "qwen3_5": False, "qwen3_5_text": False,
}


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int  # 0 for a dense model
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    intermediate_size: int  # dense MLP width (dense models only)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def parse_text_config(text: dict, where: str, is_moe: bool, top: dict | None = None,
                      stored_layers: int | None = None) -> TextConfig:
    top = top or {}
    num_layers = layer_count(text, "num_hidden_layers", where, stored_layers, "decoder layers")
    vocab = positive(text, "vocab_size", where)
    hidden = positive(text, "hidden_size", where)
    num_heads = positive(text, "num_attention_heads", where)
    head_dim = positive(text, "head_dim", where, default=hidden // num_heads)

    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = positive(text, "full_attention_interval", where, default=4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or not all(t in ("full_attention", "linear_attention") for t in layer_types)):
        raise ConfigError(f"{where}: 'layer_types' must list {num_layers} entries, each 'full_attention' or "
                          f"'linear_attention'; got {layer_types!r}. Use the config.json that came with the model.")
    rope = rope_config(text, top, where, head_dim, partial_default=0.25, theta_default=10_000_000.0)
    eos_ids = eos_token_ids(text, top, vocab, where)
    experts, per_token = experts_per_token(text, where) if is_moe else (0, 0)
    num_kv = positive(text, "num_key_value_heads", where, default=num_heads)
    key_heads, value_heads = (positive(text, k, where) for k in ("linear_num_key_heads", "linear_num_value_heads"))
    check_grouped(num_heads, num_kv, "num_attention_heads / num_key_value_heads", where)
    check_grouped(value_heads, key_heads, "linear_num_value_heads / linear_num_key_heads", where)
    return TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=tuple(layer_types),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rotary_dim=rope.rotary_dim,
        rope_theta=rope.theta,
        mrope_section=rope.section,
        mrope_interleaved=rope.interleaved,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=positive(text, "linear_key_head_dim", where),
        linear_value_head_dim=positive(text, "linear_value_head_dim", where),
        linear_conv_kernel_dim=positive(text, "linear_conv_kernel_dim", where, default=4),
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=positive(text, "moe_intermediate_size", where) if is_moe else 0,
        shared_expert_intermediate_size=positive(text, "shared_expert_intermediate_size", where) if is_moe else 0,
        intermediate_size=0 if is_moe else positive(text, "intermediate_size", where),
        rms_norm_eps=positive_real(field(text, "rms_norm_eps", where, default=1e-6, types=(int, float)),
                                    "rms_norm_eps", where),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
        max_position_embeddings=positive(text, "max_position_embeddings", where, default=262144),
        eos_token_ids=eos_ids,
    )


def parse_qwen3_5_vision(vision: dict, where: str, stored_blocks: int | None):
    if vision.get("deepstack_visual_indexes"):
        raise ConfigError(f"{where}: vision_config.deepstack_visual_indexes is set, but Qwen3.5/3.6 vision towers "
                          "have no DeepStack; a Qwen3-VL config.json has model_type qwen3_vl_moe or qwen3_vl.")
    return parse_vision_config(vision, where, stored_blocks)


SPECIAL_TOKENS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                  "vision_end_token_id": 248054}  # the defaults, where config.json leaves them out


def parse_config(raw: dict, where: str = "config.json", stored: StoredLayers | None = None) -> ModelConfig:
    """config.json's object (its model_type one of MODEL_TYPES) -> ModelConfig; with `stored`, the layer counts
    must match what the weights hold."""
    return model_config(raw, where, stored, MODEL_TYPES[raw["model_type"]], parse_text_config, parse_qwen3_5_vision,
                        SPECIAL_TOKENS)


def describe(config: ModelConfig) -> list[str]:
    """The config in a few lines, for `python -m a3b_core inspect`."""
    t, v = config.text, config.vision
    full = t.layer_types.count("full_attention")
    return [f"config: {config.model_type}, {t.num_layers} layers ({full} full attention, {t.num_layers - full} "
            f"DeltaNet), hidden {t.hidden_size}, vocab {t.vocab_size}, context {t.max_position_embeddings}",
            (f"experts: {t.num_experts} per layer, top-{t.num_experts_per_tok}, size {t.moe_intermediate_size}, "
             f"shared expert {t.shared_expert_intermediate_size}" if t.is_moe
             else f"dense MLP: intermediate size {t.intermediate_size}"),
            f"vision: {v.depth} blocks, hidden {v.hidden_size}" if v else "vision: none"]
