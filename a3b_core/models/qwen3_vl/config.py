"""Qwen3-VL config.json -> frozen dataclasses, as the releases write it (text_config with rope_scaling or
rope_parameters, vision_config with deepstack_visual_indexes)."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...release.config import (ModelConfig, StoredLayers, check_grouped, eos_token_ids, experts_per_token, field,
                               layer_count, model_config, positive, positive_real, rope_config)
from ..vision import parse_vision_config

MODEL_TYPES = {
    "qwen3_vl_moe": True, "qwen3_vl_moe_text": True,  # value: is MoE
    "qwen3_vl": False, "qwen3_vl_text": False,
}
# transformers' defaults for what a config.json may leave out
DEFAULT_THETA = 500_000.0
DEFAULT_MROPE_SECTION = [24, 20, 20]


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # = head_dim: every channel is rotated
    rope_theta: float
    mrope_section: tuple[int, ...]
    num_experts: int  # 0 for a dense model
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int  # the dense MLP's width (dense models, and MoE models' mlp_only_layers)
    moe_layers: tuple[bool, ...]  # per layer: a mixture of experts (else the dense MLP)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    mrope_interleaved: bool = True  # Qwen3-VL always interleaves the t, h, w frequencies

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def moe_layers(text: dict, where: str, num_layers: int) -> tuple[bool, ...]:
    """Which layers are a mixture of experts: every decoder_sparse_step-th, except the mlp_only_layers."""
    step = positive(text, "decoder_sparse_step", where, default=1)
    dense = field(text, "mlp_only_layers", where, default=[], types=(list,))
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense):
        raise ConfigError(f"{where}: mlp_only_layers is {dense!r}; expected layer indices from 0 to {num_layers - 1}. "
                          "Use the config.json that came with the model.")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def parse_text_config(text: dict, where: str, is_moe: bool, top: dict, stored_layers: int | None) -> TextConfig:
    num_layers = layer_count(text, "num_hidden_layers", where, stored_layers, "decoder layers")
    vocab = positive(text, "vocab_size", where)
    hidden = positive(text, "hidden_size", where)
    num_heads = positive(text, "num_attention_heads", where)
    head_dim = positive(text, "head_dim", where, default=hidden // num_heads)
    num_kv = positive(text, "num_key_value_heads", where, default=num_heads)
    check_grouped(num_heads, num_kv, "num_attention_heads / num_key_value_heads", where)
    if field(text, "attention_bias", where, default=False, types=(bool,)):
        raise ConfigError(f"{where}: attention_bias is true, but Qwen3-VL's attention has no biases. Use the "
                          "config.json that came with the model.")
    rope = rope_config(text, top, where, head_dim, partial_default=1.0, theta_default=DEFAULT_THETA,
                       section_default=DEFAULT_MROPE_SECTION)
    experts, per_token = experts_per_token(text, where) if is_moe else (0, 0)
    layers = moe_layers(text, where, num_layers) if is_moe else (False,) * num_layers
    return TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rotary_dim=rope.rotary_dim,
        rope_theta=rope.theta,
        mrope_section=rope.section,
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=positive(text, "moe_intermediate_size", where) if is_moe else 0,
        intermediate_size=positive(text, "intermediate_size", where) if not all(layers) else 0,
        moe_layers=layers,
        rms_norm_eps=positive_real(field(text, "rms_norm_eps", where, default=1e-6, types=(int, float)),
                                   "rms_norm_eps", where),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
        max_position_embeddings=positive(text, "max_position_embeddings", where, default=262144),
        eos_token_ids=eos_token_ids(text, top, vocab, where),
    )


SPECIAL_TOKENS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                  "vision_end_token_id": 151653}  # the defaults, where config.json leaves them out


def parse_config(raw: dict, where: str = "config.json", stored: StoredLayers | None = None) -> ModelConfig:
    """config.json's object (its model_type one of MODEL_TYPES) -> ModelConfig; with `stored`, the layer counts
    must match what the weights hold."""
    return model_config(raw, where, stored, MODEL_TYPES[raw["model_type"]], parse_text_config, parse_vision_config,
                        SPECIAL_TOKENS)


def describe(config: ModelConfig) -> list[str]:
    """The config in a few lines, for `python -m a3b_core inspect`."""
    t, v = config.text, config.vision
    moe = sum(t.moe_layers)
    return [f"config: {config.model_type}, {t.num_layers} layers (all full attention, {t.num_heads} query / "
            f"{t.num_kv_heads} KV heads x {t.head_dim}), hidden {t.hidden_size}, vocab {t.vocab_size}, context "
            f"{t.max_position_embeddings}",
            (f"experts: {t.num_experts} per layer in {moe} layers, top-{t.num_experts_per_tok}, size "
             f"{t.moe_intermediate_size}, no shared expert" if t.is_moe
             else f"dense MLP: intermediate size {t.intermediate_size}"),
            (f"vision: {v.depth} blocks, hidden {v.hidden_size}, DeepStack from blocks "
             f"{', '.join(map(str, v.deepstack_indexes))}" if v else "vision: none")]
