"""A GGUF file's metadata -> a config.json-like object (model_type, text_config, the special token ids) that the
families' own parsers (models/<family>/config.py) check and parse as they do a release's config.json.

llama.cpp's converter writes the text config's fields as `{arch}.*` keys; this is the inverse of its
set_gguf_parameters for qwen35moe / qwen35 / qwen3vlmoe / qwen3vl. The config is text-only: the vision_config comes
from the separate mmproj file (gguf_mmproj.py).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import ConfigError
from .gguf import metadata

MODEL_TYPES = {"qwen35moe": "qwen3_5_moe", "qwen35": "qwen3_5", "qwen3vlmoe": "qwen3_vl_moe", "qwen3vl": "qwen3_vl"}
# config.json's token id fields, found by their token in the vocabulary (a release's config.json agrees with them).
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
# Tokens llama.cpp ends generation at besides the file's eos/eot ids (its end-of-generation set for Qwen vocabularies).
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def short_float(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.999999974752427e-07)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def config_from_gguf(reader: Any, where: str = "GGUF",
                     stored_shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """The config.json-like object of a GGUF file read by gguf.GGUFReader (`where` names it in messages).
    `stored_shapes`: the tensors' names and shapes (torch order) where the reader sees only some of them (a split
    set's first part); by default the reader's."""
    arch = metadata(reader, "general.architecture")
    if arch not in MODEL_TYPES:
        raise ConfigError(f"{where}: GGUF architecture {arch!r} is not supported; this pack reads "
                          f"{', '.join(MODEL_TYPES)}.")

    def key(name: str, default: Any = ...) -> Any:
        value = metadata(reader, f"{arch}.{name}", None)
        if value is None:
            if default is ...:
                raise ConfigError(f"{where}: the metadata key '{arch}.{name}' is missing. Convert the model again "
                                  "with a current llama.cpp (convert_hf_to_gguf.py).")
            return default
        return value

    tensors = stored_shapes if stored_shapes is not None else \
        {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"{where}: has no 'token_embd.weight' tensor, so it holds no language model (an MTP-only "
                          "draft or a vision projector?). Pass the model's own GGUF file.")
    layers = key("block_count") - key("nextn_predict_layers", 0)
    head_dim = key("attention.key_length", None)
    heads = key("attention.head_count")
    text: dict[str, Any] = {
        "vocab_size": tensors["token_embd.weight"][0],
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "rms_norm_eps": short_float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if head_dim is not None:
        text["head_dim"] = head_dim
    head_dim = head_dim or text["hidden_size"] // heads
    sections = list(key("rope.dimension_sections", [0, 0, 0, 0]))[:3]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": short_float(key("rope.freq_base")),
                            "mrope_section": sections, "mrope_interleaved": True}
    if arch.startswith("qwen35"):
        rope["partial_rotary_factor"] = key("rope.dimension_count") / head_dim
        recurrent = key("attention.recurrent_layers", None)
        if recurrent is not None:
            text["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
        else:
            text["full_attention_interval"] = key("full_attention_interval", 4)
        value_heads = key("ssm.time_step_rank")
        text.update(linear_num_key_heads=key("ssm.group_count"), linear_num_value_heads=value_heads,
                    linear_key_head_dim=key("ssm.state_size"),
                    linear_value_head_dim=key("ssm.inner_size") // max(value_heads, 1),
                    linear_conv_kernel_dim=key("ssm.conv_kernel"))
    text["rope_parameters"] = rope
    if arch.endswith("moe"):
        text.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                    moe_intermediate_size=key("expert_feed_forward_length"))
        if arch == "qwen35moe":
            text["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length")
        else:
            routed = {int(m[1]) for m in map(_BLOCK.match, tensors)
                      if m and f"blk.{m[1]}.ffn_gate_inp.weight" in tensors}
            text["mlp_only_layers"] = [i for i in range(layers) if i not in routed]
            if text["mlp_only_layers"] or key("feed_forward_length", None) is not None:
                text["intermediate_size"] = key("feed_forward_length")
    else:
        text["intermediate_size"] = key("feed_forward_length")

    tokens = metadata(reader, "tokenizer.ggml.tokens", [])
    ids = {token: i for i, token in enumerate(tokens)}
    eos = [metadata(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot")]
    eos += [ids[token] for token in END_TOKENS if token in ids]
    text["eos_token_id"] = list(dict.fromkeys(i for i in eos if isinstance(i, int)))
    config = {"model_type": MODEL_TYPES[arch], "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    config.update({field: ids[token] for field, token in VISION_TOKENS.items() if token in ids})
    return config
