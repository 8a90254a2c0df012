"""Tiny Qwen3-VL checkpoints in every released layout, plus fp32 reference outputs from the transformers oracle.

`build_qwen3_vl_fixtures()` builds everything once into `$A3B_TEST_CACHE/qwen3_vl-<key>` (default under
/tmp/a3b-test-cache), keyed by the source of this file and of tiny_models.py (whose helpers it uses), the tiny
tokenizer and the transformers version; like tiny_models, a build goes to a temporary folder renamed into place.

Models (weights seeded, 1-D parameters noised by N(0, 0.1), router weights x3, every value bf16-exact):
- text: vocab 512, hidden 128, 4 layers, 4 heads / 2 KV heads x 32 (all channels rotated), mrope_section [6, 5, 5]
  (interleaved), theta 5e6; MoE: 8 experts top-3, expert size 96 (so H, I and 2I differ, as in
  every release), no shared expert; dense: intermediate_size 256.
- vision: depth 4, hidden 64, 2 heads, intermediate 128, patch 16, merge 2, 64 position embeddings, out_hidden 128,
  DeepStack from blocks [0, 2, 3] (added after decoder layers 0, 1, 2).
- token ids as tiny_models (image pad 508, vision start/end 506/507); text_config.eos_token_id [505, 503].

Folders (config.json, tokenizer.json, preprocessor_config.json, and a chat_template.json of the Instruct release):
- moe_hf     Qwen3VLMoeForConditionalGeneration.save_pretrained, fp32: fused experts as transformers holds them,
             gate_up_proj [E, 2I, H] and down_proj [E, H, I]; text_config spells the expert count num_local_experts.
- moe_bf16   the same weights in the official BF16 layout: fused experts stored transposed,
             `mlp.experts.gate_up_proj [E, H, 2I]` (gate columns first) and `mlp.experts.down_proj [E, I, H]`, bf16,
             in three shards with model.safetensors.index.json; text_config spells num_experts, as the release.
- moe_fp8    the official FP8 layout: the fused experts stored transposed as in moe_bf16, but in e4m3, each with
             fp32 block scales `mlp.experts.gate_up_proj_scale_inv [E, H/128, 2I/128]` (`down_proj_scale_inv`
             likewise), e4m3 self_attn q/k/v/o_proj with fp32 `weight_scale_inv`, 128x128 blocks; everything else
             bf16; quantization_config in config.json (its ignored_layers: lm_head, the routers, the vision tower).
- dense      Qwen3VLForConditionalGeneration.save_pretrained (model_type qwen3_vl), its own seed, fp32.

References `refs/<folder>.safetensors` (moe_hf and moe_bf16 share `refs/moe.safetensors`; moe_fp8's come from the model
holding its dequantized weights), computed in fp32 with eager attention, named as tiny_models documents: groups
text (input_ids [2, 80]), image_a (the 384x384 image, 144 tokens), image_ab (384x384 then 300x200, 144 + 70 tokens),
gen_text and gen_image (32 greedy tokens), with .router_topk_L{i} for the MoE models. Here .image_embeds is
[n, 4, 128]: the merger's output, then the three DeepStack levels.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from tests import tiny_models as tm
from tests.tiny_tokenizer import build_tiny_tokenizer

TEXT_DIMS = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[6, 5, 5], mrope_interleaved=True),
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False, intermediate_size=256,
    eos_token_id=[tm.IM_END, tm.ENDOFTEXT], initializer_range=0.05, hidden_act="silu",
)
MOE_DIMS = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=96, decoder_sparse_step=1,
                mlp_only_layers=[])
VISION_DIMS = dict(depth=4, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=64, out_hidden_size=128, initializer_range=0.05,
                   deepstack_visual_indexes=[0, 2, 3], hidden_act="gelu_pytorch_tanh")

FUSED_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")
FP8_LINEAR = re.compile(r"self_attn\.[qkvo]_proj\.weight$")
TEMPLATE = Path(__file__).parent / "data" / "qwen3_vl_instruct_chat_template.jinja"


@dataclass(frozen=True)
class VlFixtures:
    root: Path
    moe_hf: Path
    moe_bf16: Path
    moe_fp8: Path
    dense: Path
    square_image: Path
    wide_image: Path

    def refs(self, model_dir: Path) -> dict[str, torch.Tensor]:
        name = {"moe_hf": "moe", "moe_bf16": "moe"}.get(model_dir.name, model_dir.name)
        return load_file(self.root / "refs" / f"{name}.safetensors")


def cache_key() -> str:
    digest = hashlib.sha256()
    for source in (Path(__file__), Path(tm.__file__), TEMPLATE):
        digest.update(source.read_bytes())
    digest.update(build_tiny_tokenizer().to_str().encode())
    digest.update(version("transformers").encode() + version("torch").encode())
    return digest.hexdigest()[:16]


def build_qwen3_vl_fixtures() -> VlFixtures:
    root = Path(os.environ.get("A3B_TEST_CACHE", "/tmp/a3b-test-cache")) / f"qwen3_vl-{cache_key()}"
    tm.build_once(root, _build_all)
    return _fixtures_at(root)


def _fixtures_at(root: Path) -> VlFixtures:
    return VlFixtures(root=root, moe_hf=root / "moe_hf", moe_bf16=root / "moe_bf16", moe_fp8=root / "moe_fp8",
                      dense=root / "dense", square_image=root / "refs" / "square_384x384.png",
                      wide_image=root / "refs" / "wide_300x200.png")


# ---------------------------------------------------------------- models
def _moe_model() -> torch.nn.Module:
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    config = Qwen3VLMoeConfig(text_config={**TEXT_DIMS, **MOE_DIMS}, vision_config=VISION_DIMS, **tm.TOKEN_IDS)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    return tm._finish(Qwen3VLMoeForConditionalGeneration(config), seed=103)


def _dense_model() -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    config = Qwen3VLConfig(text_config=TEXT_DIMS, vision_config=VISION_DIMS, **tm.TOKEN_IDS)
    config._attn_implementation = "eager"
    torch.manual_seed(4)
    return tm._finish(Qwen3VLForConditionalGeneration(config), seed=104)


def _official_bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The release's names and layout: fused experts transposed to [E, H, 2I] and [E, I, H]; everything bf16."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach().to(torch.bfloat16)
        out[name] = value.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj",
                                                                          "experts.down_proj")) else value.clone()
    return out


def _fp8_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """The official-FP8 tensors of `model`, and a copy of the model holding their dequantized values."""
    tensors = _official_bf16_state(model)
    dequantized = copy.deepcopy(model)
    params = dict(dequantized.named_parameters())
    for name in list(tensors):
        if not name.startswith("model.language_model."):
            continue
        if FUSED_EXPERTS.search(name):  # stored [E, in, out]: each expert's matrix quantized as stored
            pairs = [tm.quantise_fp8(matrix, torch.float32) for matrix in tensors[name]]
            tensors[name], tensors[name + "_scale_inv"] = (torch.stack(part) for part in zip(*pairs))
            with torch.no_grad():
                params[name].copy_(torch.stack([tm.dequantise_fp8(q, s).t() for q, s in pairs]))
        elif FP8_LINEAR.search(name):
            quantized, scale = tm.quantise_fp8(tensors[name], torch.float32)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantized, scale
            with torch.no_grad():
                params[name].copy_(tm.dequantise_fp8(quantized, scale))
    return tensors, dequantized


def _fp8_quantization_config(model: torch.nn.Module) -> dict:
    """As the release writes it: the matrices left in bf16 listed one by one (the vision tower's under both of its
    prefixes)."""
    matrices = [name for name, module in model.named_modules()
                if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() >= 2]
    kept = [name for name in matrices if name.startswith("model.visual.") or name.endswith(("lm_head", "mlp.gate"))]
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [tm.FP8_BLOCK, tm.FP8_BLOCK],
            "ignored_layers": kept + [name.removeprefix("model.") for name in kept if name.startswith("model.visual.")]}


# ---------------------------------------------------------------- writers
def _write_extras(folder: Path) -> None:
    build_tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "preprocessor_config.json").write_text(json.dumps(tm.PREPROCESSOR, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE.read_text(encoding="utf-8")}))


def _write_like(source: Path, folder: Path, tensors: dict[str, torch.Tensor], shards: list[str], **changes) -> None:
    folder.mkdir()
    config = {**json.loads((source / "config.json").read_text()), **changes}
    text = config["text_config"]
    text["num_experts"] = text.pop("num_local_experts")  # the releases' spelling
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _write_extras(folder)
    tm._write_sharded(tensors, folder, shards)


# ---------------------------------------------------------------- references
def _vision_refs(model: torch.nn.Module, group: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mm_types = (inputs["input_ids"] == tm.IMAGE_PAD).int()
    with torch.no_grad():
        position_ids, rope_deltas = model.model.get_rope_index(inputs["input_ids"], mm_types, inputs["image_grid_thw"])
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    levels = [torch.cat(out.pooler_output)] + [torch.cat(feature) for feature in out.deepstack_features]
    return {f"{group}.position_ids": position_ids, f"{group}.rope_deltas": rope_deltas.reshape(1, 1),
            f"{group}.image_embeds": torch.stack(levels, dim=1).float()}


def _all_refs(model: torch.nn.Module, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, tm.ENDOFTEXT, (2, 80), generator=torch.Generator().manual_seed(7))
    refs = tm._forward_refs(model, "text", {"input_ids": ids})
    text_prompt = torch.tensor([build_tiny_tokenizer().encode(tm.TEXT_PROMPT, add_special_tokens=False).ids])
    refs |= tm._generate_refs(model, "gen_text", {"input_ids": text_prompt})
    square, wide = images
    for group, group_images in (("image_a", [square]), ("image_ab", [square, wide])):
        inputs = tm._image_inputs(group_images)
        refs |= tm._forward_refs(model, group, inputs) | _vision_refs(model, group, inputs)
    refs |= tm._generate_refs(model, "gen_image", tm._image_inputs([square]))
    return {k: v.contiguous() for k, v in refs.items()}


def _build_all(root: Path) -> None:
    fx = _fixtures_at(root)
    (root / "refs").mkdir()
    tm.synthetic_image(384, 384, seed=13).save(fx.square_image)
    tm.synthetic_image(300, 200, seed=12).save(fx.wide_image)
    images = [Image.open(fx.square_image).convert("RGB"), Image.open(fx.wide_image).convert("RGB")]

    moe = _moe_model()
    moe.save_pretrained(fx.moe_hf)
    _write_extras(fx.moe_hf)
    save_file(_all_refs(moe, images), root / "refs" / "moe.safetensors")
    _write_like(fx.moe_hf, fx.moe_bf16, _official_bf16_state(moe),
                [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)], dtype="bfloat16")

    fp8_tensors, dequantized = _fp8_state(moe)
    _write_like(fx.moe_hf, fx.moe_fp8, fp8_tensors, [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)],
                dtype="bfloat16", quantization_config=_fp8_quantization_config(moe))
    save_file(_all_refs(dequantized, images), root / "refs" / "moe_fp8.safetensors")

    dense = _dense_model()
    dense.save_pretrained(fx.dense)
    _write_extras(fx.dense)
    save_file(_all_refs(dense, images), root / "refs" / "dense.safetensors")
