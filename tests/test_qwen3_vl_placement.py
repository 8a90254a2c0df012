"""The planner on the real Qwen3-VL shapes: Qwen3-VL-30B-A3B in its BF16 and FP8 release layouts and the dense sizes,
from header inventories (names, shapes, dtypes; no weights), and `plan` / `inspect` on header-only folders.

The inventories are transformers' own modules for the released config.json (built on the meta device), in the
release's layout: BF16 with the fused experts stored transposed; FP8 with the same fused experts and the attention
projections in e4m3, each with fp32 128x128 block scales (`<experts>_scale_inv` stacked per expert, `weight_scale_inv`),
everything else bf16."""
import json
import math
import re
from functools import cache
from pathlib import Path

import pytest
import torch

from a3b_core.__main__ import main
from a3b_core.errors import PlacementError
from a3b_core.models import parse_config
from a3b_core.models.checkpoint_layout import expert_layout
from a3b_core.runtime.placement import GiB, PRESETS, make_plan, plan_for_folder
from tests.test_placement import bytes_read, part, run_cli, write_header_only_checkpoint

DATA = Path(__file__).parent / "data"
RAM = 64 * GiB
FP8_BLOCK = 128
FP8_MATRIX = re.compile(r"language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj\.weight"
                        r"|mlp\.experts\.(gate_up|down)_proj)$")
# The dense releases' config.json values that size them (the rest as Qwen3-VL-30B-A3B's)
DENSE = {
    "2B": dict(text=dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         intermediate_size=6144, tie_word_embeddings=True),
               vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2048,
                           deepstack_visual_indexes=[5, 11, 17])),
    "4B": dict(text=dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=9728, tie_word_embeddings=True),
               vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560,
                           deepstack_visual_indexes=[5, 11, 17])),
    "8B": dict(text=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=12288, tie_word_embeddings=False),
               vision=dict(out_hidden_size=4096)),
    "32B": dict(text=dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                          intermediate_size=25600, tie_word_embeddings=False),
                vision=dict(out_hidden_size=5120)),
}


def moe_raw() -> dict:
    return json.loads((DATA / "qwen3_vl_30b_a3b.config.json").read_text())


def dense_raw(size: str) -> dict:
    raw = moe_raw()
    text = {k: v for k, v in raw["text_config"].items() if k not in ("num_experts", "num_experts_per_tok",
                                                                      "moe_intermediate_size", "decoder_sparse_step",
                                                                      "mlp_only_layers", "norm_topk_prob")}
    raw |= {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": {**text, **DENSE[size]["text"], "model_type": "qwen3_vl_text"},
            "vision_config": {**raw["vision_config"], **DENSE[size]["vision"], "model_type": "qwen3_vl"},
            "tie_word_embeddings": DENSE[size]["text"]["tie_word_embeddings"]}
    return raw


def transformers_tensors(raw: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names and shapes of transformers' model for this config.json, as it holds them."""
    import transformers
    moe = raw["model_type"] == "qwen3_vl_moe"
    config_class, model_class = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)
                                 if moe else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    config = config_class(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type",
                                                                         "transformers_version")})
    with torch.device("meta"):
        model = model_class(config)
    tied = config.tie_word_embeddings
    return {name: (tuple(t.shape), torch.bfloat16) for name, t in model.state_dict().items()
            if not (tied and name == "lm_head.weight")}


@cache
def inventory(kind: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """"bf16" / "fp8": Qwen3-VL-30B-A3B's release layouts; "dense-<size>": a dense release (BF16)."""
    if kind.startswith("dense-"):
        return transformers_tensors(dense_raw(kind.removeprefix("dense-")))
    out = {}
    for name, (shape, dtype) in transformers_tensors(moe_raw()).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored transposed: [E, H, 2I], [E, I, H]
            shape = (shape[0], shape[2], shape[1])
        out[name] = (shape, dtype)
    if kind == "fp8":
        for name, (shape, _) in list(out.items()):
            if FP8_MATRIX.search(name):
                out[name] = (shape, torch.float8_e4m3fn)
                # "weight_scale_inv" beside a weight, "gate_up_proj_scale_inv" beside fused experts
                out[name + "_scale_inv"] = (shape[:-2] + tuple(-(-n // FP8_BLOCK) for n in shape[-2:]), torch.float32)
    return out


@cache
def config(kind: str):
    return parse_config(dense_raw(kind.removeprefix("dense-")) if kind.startswith("dense-") else moe_raw())


def plan(kind: str, preset: str, **kw):
    kw.setdefault("cpu_free", RAM)
    kw.setdefault("has_cuda", True)
    return make_plan(config(kind), inventory(kind), preset, **kw)


def file_bytes(kind: str) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in inventory(kind).values())


# ----------------------------------------------------------------------------------------------- the inventories
def test_inventories_have_the_releases_sizes():
    bf16, fp8 = inventory("bf16"), inventory("fp8")
    params = lambda inv: sum(math.prod(s) for n, (s, _) in inv.items() if not n.endswith("_scale_inv"))
    assert params(bf16) == params(fp8) and 31.0e9 < params(bf16) < 31.2e9  # "31B" on the model card
    assert 61e9 < file_bytes("bf16") < 63e9 and 31e9 < file_bytes("fp8") < 34e9
    assert bf16["model.language_model.layers.0.mlp.experts.gate_up_proj"][0] == (128, 2048, 1536)
    assert bf16["model.language_model.layers.47.mlp.experts.down_proj"][0] == (128, 768, 2048)
    assert sum(".deepstack_merger_list." in n for n in bf16) == 3 * 6
    assert fp8["model.language_model.layers.3.mlp.experts.gate_up_proj_scale_inv"] == ((128, 16, 12), torch.float32)
    assert fp8["model.language_model.layers.3.mlp.experts.down_proj_scale_inv"][0] == (128, 6, 16)
    assert fp8["model.language_model.layers.3.self_attn.q_proj.weight_scale_inv"] == ((32, 16), torch.float32)
    assert sum(dtype == torch.float8_e4m3fn for _, dtype in fp8.values()) == 48 * 6
    assert expert_layout(config("bf16"), bf16) == "fused-transposed [E, H, 2I]"
    assert expert_layout(config("fp8"), fp8) == "fused-transposed [E, H, 2I] fp8 (block scales)"


# ----------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_fits_its_budget(kind, preset):
    p = plan(kind, preset)
    assert p.gpu_budget == PRESETS[preset].vram_gib * GiB and 0 < p.gpu_bytes <= p.gpu_budget
    assert p.cpu_bytes <= p.cpu_budget
    for name in ("kv_cache", "cuda_context", "workspace", "lm_head", "mixers", "routers"):
        assert part(p, name).device == "cuda", name
    assert part(p, "deltanet_state") is None  # Qwen3-VL keeps no recurrent state
    # every one of the 48 layers attends fully: 48 x 2 x 4 KV heads x 128 x 2 bytes = 96 KiB a token in bf16
    if p.kv_dtype == "bf16":
        assert part(p, "kv_cache").bytes == p.max_context * (96 * 1024 + 1)
    assert p.expert_format_gpu == ("fp8" if kind == "fp8" else "bf16")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_8gb_keeps_every_routed_expert_in_ram(kind):
    p = plan(kind, "8gb")
    assert p.gpu_expert_layers == () and part(p, "routed_experts_gpu") is None
    assert p.expert_format_cpu == "int8" and p.dense_device == "cuda" and p.embed_device == "cpu"
    assert any("--cpu-moe" in note for note in p.notes)


def test_bigger_presets_hold_more_expert_layers():
    counts = [len(plan("fp8", preset).gpu_expert_layers) for preset in PRESETS]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] > 0


def test_cpu_preset_puts_everything_in_ram():
    p = plan("bf16", "cpu")
    assert p.gpu_bytes == 0 and all(x.device == "cpu" for x in p.parts) and p.max_context == 32768


@pytest.mark.parametrize("size, smallest", [("2B", "8gb"), ("4B", "12gb"), ("8B", "16gb"), ("32B", None)])
def test_dense_sizes_fit_from_the_smallest_preset_that_holds_their_weights(size, smallest):
    """A dense model's layers all live on the GPU (the embedding table may stay in RAM): the 4B needs 12gb, the 32B
    (67 GB) no preset."""
    kind = f"dense-{size}"
    assert expert_layout(config(kind), inventory(kind)) == "none (dense MLP)"
    fitted = []
    for preset in PRESETS:
        try:
            p = plan(kind, preset)
        except PlacementError as error:
            assert "To fix" in str(error)
            continue
        assert p.gpu_bytes <= p.gpu_budget and p.expert_format_cpu == "none"
        fitted.append(preset)
    presets = list(PRESETS)
    assert fitted == (presets[presets.index(smallest):] if smallest else [])
    assert plan(kind, "cpu", cpu_free=256 * GiB).gpu_bytes == 0


# ----------------------------------------------------------------------------------------------- folders and CLI
@pytest.fixture(scope="module")
def real_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_vl_30b_a3b_fp8")
    raw = moe_raw() | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                               "weight_block_size": [128, 128]}}
    (folder / "config.json").write_text(json.dumps(raw))
    assert write_header_only_checkpoint(folder, inventory("fp8")) > 31e9
    yield folder
    (folder / "model.safetensors").unlink()


def test_planning_a_folder_reads_only_headers(real_folder):
    before = bytes_read()
    p = plan_for_folder(real_folder, "16gb", has_cuda=True, cpu_free=RAM)
    assert bytes_read() - before < 8 * 2**20  # the 32 GB of weights are never read (the header is a few MB)
    assert p.to_json() == plan("fp8", "16gb").to_json()


def test_cli_plan_and_inspect(real_folder, capsys):
    out = run_cli("plan", real_folder, "--preset", "8gb", "--vram", "8", "--ram", "64", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == json.loads(json.dumps(plan("fp8", "8gb", gpu_free=8 * GiB).to_json()))
    assert main(["inspect", str(real_folder)]) == 0
    text = capsys.readouterr().out
    assert "family: Qwen3-VL" in text and "48 layers (all full attention" in text
    assert "experts: 128 per layer in 48 layers, top-8" in text and "DeepStack from blocks 8, 16, 24" in text
    assert "expert layout: fused-transposed [E, H, 2I] fp8 (block scales)" in text
