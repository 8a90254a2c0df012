"""The bench's count of active parameters (bench/roofline.py), which puts the two model families on one scale."""
import json
from pathlib import Path

from a3b_core.models import family_for, parse_config
from bench.roofline import active_params

DATA = Path(__file__).parent / "data"


def released(name: str):
    config = parse_config(json.loads((DATA / name).read_text()))
    return family_for(config.model_type).text_model, config.text


def test_active_parameters_of_qwen3_vl_30b_a3b_by_hand():
    """Per layer: attention (q, k, v, o), the router, top-8 of 128 experts, the norms; then the LM head, the final
    norm and one embedding row (the table itself is looked up, not multiplied)."""
    layers, hidden, heads, kv_heads, head_dim, experts, top_k, inter, vocab = 48, 2048, 32, 4, 128, 128, 8, 768, 151936
    layer = (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + experts * hidden
             + top_k * 3 * hidden * inter + 2 * hidden + 2 * head_dim)
    assert active_params(*released("qwen3_vl_30b_a3b.config.json")) == layers * layer + vocab * hidden + 2 * hidden


def test_both_released_a3b_models_activate_about_three_billion():
    for name in ("qwen3_vl_30b_a3b.config.json", "qwen3_5_35b_a3b.config.json"):
        assert 2.8e9 < active_params(*released(name)) < 3.2e9, name  # "A3B": ~3 B active parameters
