"""config.json parsing: every key spelling of the Qwen3.5 family, and clear errors for the rest."""
import json
import math

import pytest

from a3b_core.errors import ConfigError
from a3b_core.models import load_config, parse_config
from a3b_core.release.config import MAX_LAYERS, StoredLayers

TEXT = {
    "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 128, "eos_token_id": 505,
}
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
        "mrope_interleaved": True}


def nested(**text_extra) -> dict:
    return {"model_type": "qwen3_5_moe", "text_config": {**TEXT, "rope_parameters": ROPE, **text_extra},
            "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                              "out_hidden_size": 128, "num_position_embeddings": 64},
            "image_token_id": 508}


def test_nested_text_config_with_rope_parameters():
    cfg = parse_config(nested())
    t = cfg.text
    assert (t.rotary_dim, t.rope_theta, t.mrope_section, t.mrope_interleaved) == (16, 1e7, (3, 3, 2), True)
    assert t.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + \
        ("full_attention",)
    assert t.is_moe and t.eos_token_ids == (505,)
    assert cfg.vision.out_hidden_size == 128 and cfg.image_token_id == 508


def test_older_spelling_rope_scaling_and_top_level_theta_and_factor():
    text = {**TEXT, "rope_scaling": {"mrope_section": [3, 3, 2], "mrope_interleaved": True, "type": "mrope"},
            "rope_theta": 5e6, "partial_rotary_factor": 0.25}
    t = parse_config({"model_type": "qwen3_5_moe_text", **text}).text
    assert (t.rope_theta, t.rotary_dim, t.mrope_section) == (5e6, 16, (3, 3, 2))


def test_layer_types_given_and_interval_derived():
    given = ["full_attention", "linear_attention"] * 4
    assert parse_config(nested(layer_types=given)).text.layer_types == tuple(given)
    derived = parse_config(nested(full_attention_interval=2)).text.layer_types
    assert derived == ("linear_attention", "full_attention") * 4


def test_dense_qwen3_5():
    text = {k: v for k, v in TEXT.items() if "expert" not in k}
    cfg = parse_config({"model_type": "qwen3_5", "text_config": {**text, "intermediate_size": 256,
                                                                 "rope_parameters": ROPE}})
    assert not cfg.text.is_moe and cfg.text.intermediate_size == 256 and cfg.vision is None


def test_eos_list():
    assert parse_config(nested(eos_token_id=[505, 503])).text.eos_token_ids == (505, 503)


@pytest.mark.parametrize("raw,message", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({}, "model_type None"),
    (nested(num_hidden_layers=None), "'num_hidden_layers' is missing"),
    (nested(hidden_size="128"), "'hidden_size' is '128'; expected int"),
    (nested(hidden_size=True), "'hidden_size' is True"),
    (nested(num_experts=0), "'num_experts' is 0; expected a positive"),
    (nested(layer_types=["full_attention"]), "'layer_types' must list 8"),
    (nested(rope_parameters={**ROPE, "mrope_section": [4, 4, 4]}), "mrope_section"),
    (nested(rope_parameters={**ROPE, "rope_type": "yarn"}), "rope_type 'yarn'"),
    (nested(rope_parameters={**ROPE, "rope_theta": math.nan}), "'rope_theta' is nan"),
    (nested(rope_parameters={**ROPE, "rope_theta": math.inf}), "'rope_theta' is inf"),
    (nested(rope_parameters={**ROPE, "rope_theta": -math.inf}), "'rope_theta' is -inf"),
    (nested(rope_parameters={**ROPE, "partial_rotary_factor": math.nan}), "'partial_rotary_factor' is nan"),
    (nested(rope_parameters={**ROPE, "partial_rotary_factor": 1.5}), "'partial_rotary_factor' is 1.5"),
    (nested(rms_norm_eps=math.nan), "'rms_norm_eps' is nan"),
    (nested(num_hidden_layers=10**9), f"'num_hidden_layers' is 1000000000; .* {MAX_LAYERS}"),
    (nested(hidden_size=10**400), "'hidden_size' is a 401-digit number"),
    (nested(eos_token_id=512), "eos_token_id .*512.* vocab_size"),
    ({**nested(), "image_token_id": 2**63}, "'image_token_id' is 9223372036854775808"),
    ({"model_type": "qwen3_5_moe", "text_config": [1]}, "'text_config' must be an object"),
])
def test_bad_configs(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_layer_counts_are_checked_against_the_weights():
    with pytest.raises(ConfigError, match=r"'num_hidden_layers' is 8 but the weights hold 4 decoder layers"):
        parse_config(nested(), stored=StoredLayers(text=4, vision=2))
    with pytest.raises(ConfigError, match=r"'depth' is 2 but the weights hold 3 vision blocks"):
        parse_config(nested(), stored=StoredLayers(text=8, vision=3))
    with pytest.raises(ConfigError, match=r"'num_hidden_layers' is 1000000000 but the weights hold 8"):
        parse_config(nested(num_hidden_layers=10**9), stored=StoredLayers(text=8, vision=2))
    assert parse_config(nested(), stored=StoredLayers(text=8, vision=2)).text.num_layers == 8
    assert parse_config(nested(), stored=StoredLayers(text=8, vision=None)).vision.depth == 2  # no vision weights


def test_vision_depth_is_capped_without_weights():
    raw = nested()
    raw["vision_config"]["depth"] = 10**7
    with pytest.raises(ConfigError, match=f"'depth' is 10000000; .* {MAX_LAYERS}"):
        parse_config(raw)


def test_vision_heads_must_divide_the_vision_width():
    raw = nested()
    raw["vision_config"]["hidden_size"] = raw["vision_config"]["num_heads"] + 1
    with pytest.raises(ConfigError, match="hidden_size 3 / num_heads 2 must give a whole head size"):
        parse_config(raw)


def test_deepstack_vision_is_refused():
    raw = nested()
    raw["vision_config"]["deepstack_visual_indexes"] = [8, 16, 24]
    with pytest.raises(ConfigError, match="deepstack"):
        parse_config(raw)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(nested()))
    assert load_config(tmp_path).text.num_layers == 8


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_literals_in_the_file(tmp_path, literal):
    text = json.dumps(nested()).replace('"rope_theta": 10000000.0', f'"rope_theta": {literal}')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"config.json: 'rope_theta' is -?(nan|inf)"):
        load_config(tmp_path)


def test_5000_digit_integer_in_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(nested()).replace("{", '{"n": ' + "9" * 5000 + ", ", 1))
    with pytest.raises(ConfigError, match="config.json: cannot be parsed as JSON .*digits"):
        load_config(tmp_path)
