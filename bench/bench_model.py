"""The random-weight benchmark checkpoint, written once into the bench cache.

A Qwen3.5-MoE text model (1.82 B parameters, ~0.38 B active per token) in the official fused BF16 layout
(`model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`; `linear_attn.A_log` and
`linear_attn.norm.weight` in fp32 as the release stores them), `Qwen3_5MoeForCausalLM` in config.json. That layout
loads in our engine, in transformers and in llama.cpp's converter alike. Weights come from transformers' own
initializer (seeded), so norms, decay rates and routers have their intended ranges. There is no tokenizer: every
system is fed token ids.

A second folder holds the same weights in the official FP8 release layout (per-expert e4m3 experts, 128x128 block
scales), for our engine's FP8-stored experts.

A third, for image benchmarks, is the same text model under a vision tower: the release's tower shape per block
(hidden 1152, 16 heads, MLP 4304, patch 16, merge 2) but VISION_BLOCKS blocks, randomly initialized, in the
Qwen3_5MoeForConditionalGeneration layout, with the demo model's tokenizer (whose ids fit the vocabulary) so captions
can be asked for in text.

`--family qwen3_vl_moe` writes a Qwen3-VL-MoE text model of the same size class instead (1.7 B parameters, ~0.28 B
active: the same hidden size, layers, experts and attention heads, every layer full attention, no shared expert), as
the official BF16 release stores it: `Qwen3VLMoeForConditionalGeneration` names (`model.language_model.*`), fused
experts transposed (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`), everything bf16. Its hidden size is twice the
expert size, as in the Qwen3.5 bench, so `gate_up_proj` is square per expert and loaders (ours and transformers alike)
read it as not transposed: random weights of one distribution either way, so speeds are unaffected. It has no vision
tower: the bench feeds token ids only. Our engine alone runs it (bench/speed.py --vl), to compare the two families per
active parameter.

    python bench/bench_model.py [--small] [--fp8 | --vision] [--family qwen3_vl_moe]   # writes (if absent), prints it
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

BENCH_LAYOUT_VERSION = 1
EOS_TOKEN_ID = 2  # "</s>" in llama.cpp's stand-in llama-spm vocabulary

TEXT_CONFIG = dict(
    vocab_size=32000, hidden_size=1024, num_hidden_layers=16, full_attention_interval=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                         mrope_section=[6, 5, 5], mrope_interleaved=True),
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
    max_position_embeddings=262144, bos_token_id=1, eos_token_id=EOS_TOKEN_ID,
)
# A quick stand-in of the same family, to check the bench end to end in a few minutes (numbers mean nothing).
SMALL_CHANGES = dict(num_hidden_layers=4, num_experts=16, hidden_size=512, moe_intermediate_size=256,
                     shared_expert_intermediate_size=256)
# Qwen3.5-35B-A3B's vision tower, per block; the bench tower has few blocks (images cost mostly the text model)
VISION_CONFIG = dict(hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16, temporal_patch_size=2,
                     spatial_merge_size=2, num_position_embeddings=2304, in_channels=3, hidden_act="gelu_pytorch_tanh",
                     deepstack_visual_indexes=[], initializer_range=0.02)
VISION_BLOCKS = 2
# The Qwen3-VL-MoE bench: Qwen3.5's sizes where the families share a field, Qwen3-VL's own rotary (every channel
# rotated, theta and sections of the release)
VL_TEXT_CONFIG = dict(
    vocab_size=32000, hidden_size=1024, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, mrope_section=[24, 20, 20],
                                       mrope_interleaved=True),
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
    tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=262144, bos_token_id=1,
    eos_token_id=EOS_TOKEN_ID,
)
# The smallest vision tower transformers builds; its weights are dropped (the bench model has none)
VL_BUILD_VISION = dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, deepstack_visual_indexes=[])
FAMILIES = ("qwen3_5_moe", "qwen3_vl_moe")
FP32_IN_RELEASE = re.compile(r"linear_attn\.(A_log|norm\.weight)$")
# The official FP8 release: per-expert e4m3 experts with bf16 block scales; these matrices e4m3 with fp32
# scales; everything else as in the BF16 release.
FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
FP8_DENSE = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
                       r"|shared_expert\.(gate|up|down)_proj)\.weight$")
FP8_NOT_CONVERTED = ["lm_head", "model.embed_tokens", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                     "linear_attn.in_proj_b", "linear_attn.conv1d", "linear_attn.A_log", "linear_attn.dt_bias",
                     "linear_attn.norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                     "self_attn.k_norm", "model.norm"]


def bench_dir() -> Path:
    """Where all bench outputs live: $A3B_BENCH_DIR, else ~/.cache/a3b-bench (never inside the repository)."""
    return Path(os.environ.get("A3B_BENCH_DIR", Path.home() / ".cache" / "a3b-bench")).expanduser()


def text_config(small: bool = False) -> dict:
    return {**TEXT_CONFIG, **(SMALL_CHANGES if small else {})}


def bench_model_dir(small: bool = False, fp8: bool = False) -> Path:
    """The checkpoint folder (BF16, or the same weights in the FP8 release layout), written on first use (a few
    minutes; 3.6 GB for the full BF16 model, 2 GB for FP8)."""
    folder = bench_dir() / f"qwen35moe-bench-{'small' if small else '1.8b'}-v{BENCH_LAYOUT_VERSION}"
    if not (folder / "model.safetensors").is_file():
        write_checkpoint(folder, text_config(small))
    if not fp8:
        return folder
    fp8_folder = folder.with_name(folder.name + "-fp8")
    if not (fp8_folder / "model.safetensors").is_file():
        write_fp8_checkpoint(folder, fp8_folder)
    return fp8_folder


def vision_model_dir(small: bool = False) -> Path:
    """The text checkpoint under a random vision tower (see the module's docstring), written on first use."""
    text = bench_model_dir(small)
    folder = text.with_name(text.name + "-vision")
    if not (folder / "model.safetensors").is_file():
        write_vision_checkpoint(text, folder)
    return folder


def write_vision_checkpoint(text: Path, folder: Path, seed: int = 0) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    demo = Path(__file__).resolve().parent.parent / "a3b_core" / "demo" / "a3b-demo"
    print(f"[bench] writing the benchmark checkpoint with a vision tower to {folder}", flush=True)
    text_config = json.loads((text / "config.json").read_text())
    demo_config = json.loads((demo / "config.json").read_text())
    text_config["eos_token_id"] = demo_config["text_config"]["eos_token_id"]  # the demo tokenizer's end tokens
    vision_values = {**VISION_CONFIG, "depth": VISION_BLOCKS, "out_hidden_size": text_config["hidden_size"]}
    torch.manual_seed(seed)
    vision = Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(**vision_values)).to(torch.bfloat16)
    tensors = {f"model.visual.{name}": value.detach().contiguous() for name, value in vision.state_dict().items()}
    with safe_open(text / "model.safetensors", framework="pt") as reader:
        for name in reader.keys():
            tensors[name if name.startswith("lm_head.") else "model.language_model." + name.removeprefix("model.")] \
                = reader.get_tensor(name)
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "text_config": text_config,
              "vision_config": {"model_type": "qwen3_5_moe_vision", **vision_values},
              **{key: demo_config[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                    "vision_end_token_id")}}
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(demo / "tokenizer.json", partial / "tokenizer.json")
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    publish(partial, folder)


def checkpoint_folder(small: bool = False, fp8: bool = False, vision: bool = False,
                      family: str = FAMILIES[0]) -> Path:
    """bench_model_dir (or vision_model_dir, or vl_bench_model_dir) in a child process: building the model takes
    gigabytes this process should never hold."""
    flags = ((["--small"] if small else []) + (["--fp8"] if fp8 else []) + (["--vision"] if vision else [])
             + ["--family", family])
    out = subprocess.run([sys.executable, __file__, *flags], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def write_checkpoint(folder: Path, config_values: dict, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    print(f"[bench] writing the random benchmark checkpoint to {folder}", flush=True)
    config = Qwen3_5MoeTextConfig(**config_values)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: half the memory of an fp32 model
    try:
        model = Qwen3_5MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    tensors = {name: value.detach().to(torch.float32 if FP32_IN_RELEASE.search(name) else torch.bfloat16)
               .contiguous() for name, value in model.state_dict().items()}
    del model
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config.to_json_file(str(partial / "config.json"))
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    publish(partial, folder)


def vl_text_config(small: bool = False) -> dict:
    return {**VL_TEXT_CONFIG, **({k: v for k, v in SMALL_CHANGES.items() if k in VL_TEXT_CONFIG} if small else {})}


def vl_bench_model_dir(small: bool = False) -> Path:
    """The Qwen3-VL-MoE bench checkpoint folder, written on first use (3.4 GB for the full model)."""
    folder = bench_dir() / f"qwen3vlmoe-bench-{'small' if small else '1.7b'}-v{BENCH_LAYOUT_VERSION}"
    if not (folder / "model.safetensors").is_file():
        write_vl_checkpoint(folder, vl_text_config(small))
    return folder


def write_vl_checkpoint(folder: Path, text_values: dict, seed: int = 0) -> None:
    """A random Qwen3-VL-MoE text model in the BF16 release's layout: transformers holds fused experts as
    [E, 2I, H] and [E, H, I], the release stores them transposed (transformers' loader transposes them back)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    print(f"[bench] writing the random Qwen3-VL-MoE benchmark checkpoint to {folder}", flush=True)
    vision = {**VL_BUILD_VISION, "out_hidden_size": text_values["hidden_size"]}
    config = Qwen3VLMoeConfig(text_config=text_values, vision_config=vision, tie_word_embeddings=False)
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3VLMoeForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default_dtype)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.startswith("model.visual."):
            continue
        value = value.detach().to(torch.bfloat16)
        tensors[name] = (value.transpose(1, 2) if FUSED_EXPERTS.match(name) else value).contiguous()
    del model
    raw = config.to_dict()
    del raw["vision_config"]  # no vision weights: a vision_config would describe a tower that is not there
    text = raw["text_config"]
    text["num_experts"] = text.pop("num_local_experts")  # the releases' spelling
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    publish(partial, folder)


def write_fp8_checkpoint(source: Path, folder: Path) -> None:
    """The BF16 checkpoint's weights quantized as the official FP8 release stores them (128x128 blocks)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from a3b_core.formats.fp8 import quantize_fp8

    print(f"[bench] writing the FP8 benchmark checkpoint to {folder}", flush=True)
    tensors: dict[str, torch.Tensor] = {}

    def add_fp8(name: str, weight: torch.Tensor, scale_dtype: torch.dtype) -> None:
        q, scale = quantize_fp8(weight.float())
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, scale.to(scale_dtype)

    with safe_open(source / "model.safetensors", framework="pt") as reader:
        for name in reader.keys():
            value = reader.get_tensor(name)
            fused = FUSED_EXPERTS.match(name)
            if fused is not None:
                inter = value.shape[1] // 2 if fused[2] == "gate_up_proj" else None
                for expert, matrix in enumerate(value):
                    parts = {"down_proj": matrix} if inter is None else \
                        {"gate_proj": matrix[:inter], "up_proj": matrix[inter:]}
                    for part, weight in parts.items():
                        add_fp8(f"{fused[1]}.{expert}.{part}.weight", weight, torch.bfloat16)
            elif FP8_DENSE.search(name):
                add_fp8(name, value, torch.float32)
            else:
                tensors[name] = value
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": FP8_NOT_CONVERTED}
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    publish(partial, folder)


def publish(partial: Path, folder: Path) -> None:
    """Renames a finished folder into place: a checkpoint is whole or absent, never half written."""
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def main() -> None:
    """Writes the checkpoint (in its own process, so the parent bench stays small: children inherit its peak RSS)."""
    parser = argparse.ArgumentParser(description="Writes the benchmark checkpoint into the bench cache.")
    parser.add_argument("--small", action="store_true")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--fp8", action="store_true", help="the FP8-layout copy (Qwen3.5 only)")
    layout.add_argument("--vision", action="store_true", help="the copy under a vision tower (Qwen3.5 only)")
    parser.add_argument("--family", choices=FAMILIES, default=FAMILIES[0])
    args = parser.parse_args()
    if args.family == FAMILIES[1]:
        if args.fp8 or args.vision:
            parser.error("--fp8 and --vision: the Qwen3-VL-MoE bench model has neither copy")
        print(vl_bench_model_dir(args.small))
    else:
        print(vision_model_dir(args.small) if args.vision else bench_model_dir(args.small, args.fp8))


if __name__ == "__main__":
    main()
