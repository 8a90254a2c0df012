"""Tiny Qwen3.5 checkpoints in every layout a3b_core loads, plus fp32 reference outputs from the transformers oracle.

`build_fixtures()` builds everything once (10-20 s, one thread) into a cache folder keyed by the source of this
file, the tiny tokenizer and the transformers version, and returns a `Fixtures` with the paths. The cache lives in
`$A3B_TEST_CACHE/<key>` (default `/tmp/a3b-test-cache/<key>`); a build goes to a temporary folder that is renamed into
place, so a crashed build never leaves a half cache.

Models (all weights seeded, 1-D parameters noised by N(0, 0.1), router weights x3, every value
exactly bf16-representable so the bf16 folders are lossless):
- text: vocab 512, hidden 128, layers [lin, lin, lin, full], 4 heads / 2 KV heads x 64, partial rotary 0.25,
  mrope_section [3, 3, 2] interleaved, theta 1e7, GatedDeltaNet 2 key / 4 value heads x 32, conv 4;
  MoE: 8 experts top-2, expert size 256, shared expert 128; dense: intermediate_size 256.
- vision: depth 2, hidden 64, 2 heads, intermediate 128, patch 16, merge 2, 64 position embeddings, out_hidden 128.
- token ids: <|endoftext|> 503, <|im_start|> 504, <|im_end|> 505, vision_start 506, vision_end 507, image_pad 508,
  video_pad 509; text_config.eos_token_id [505, 503].

Folders (each has config.json, tokenizer.json; the VL ones also preprocessor_config.json):
- moe_hf          Qwen3_5MoeForConditionalGeneration.save_pretrained, fp32, transformers' per-expert names
                  `model.language_model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`, one model.safetensors.
- moe_fused_bf16  the same weights in the official BF16 layout: fused `mlp.experts.gate_up_proj [E,2I,H]`
                  and `mlp.experts.down_proj [E,H,I]`, bf16 except `linear_attn.A_log` and `linear_attn.norm.weight`
                  (fp32), in `model.safetensors-0000{1,2,3}-of-00003.safetensors` + `model.safetensors.index.json`.
- moe_fp8         the same weights in the official FP8 layout: per-expert e4m3 experts with bf16
                  `.weight_scale_inv`; e4m3 q/k/v/o_proj, in_proj_qkv, in_proj_z, out_proj, shared_expert.* with fp32
                  scales; 128x128 blocks; everything else bf16 as in moe_fused_bf16; `model-0000{1,2}-of-00002
                  .safetensors` + `model.safetensors.index.json`; config.json has a quantization_config.
- moe_text        Qwen3_5MoeForCausalLM.save_pretrained of the same language model (names `model.layers.*`,
                  `lm_head.weight`, per-expert experts), fp32.
- dense           Qwen3_5ForConditionalGeneration.save_pretrained (model_type qwen3_5), its own seed, fp32.

References, `refs/<model>.safetensors` (see `Fixtures.refs`; moe_hf and moe_fused_bf16 share `refs/moe.safetensors`;
moe_fp8's come from the same transformers model with its quantized matrices replaced by their dequantized values).
All computed in fp32 with eager attention. T is the prompt length, n the number of image tokens (= sum h*w/4).
Groups present: moe and moe_fp8 and dense: text, image_a, image_b, image_ab, gen_text, gen_image; moe_text: text,
gen_text.
- text.input_ids [2, 80] int64 (random ids < 503, longer than one 64-token DeltaNet chunk)
- text.logits [2, 80, 512]; text.hidden_states [5, 2, 80, 128] (embeddings, then after each layer; the last entry is
  after the final norm, as transformers returns it)
- image_{a,b,ab}: a = one 384x384 image (grid 24x24, 144 tokens), b = one 300x200 image (grid 14x20, 70 tokens),
  ab = both, in that order (214 tokens). Prompt: "<|im_start|>user\n" + per image (vision_start, image_pad * n_i,
  vision_end) + "Describe the image in one sentence.<|im_end|>\n<|im_start|>assistant\n".
  .input_ids [1, T]; .pixel_values [patches, 1536] (Qwen2VLImageProcessorPil with the real settings);
  .image_grid_thw [images, 3]; .position_ids [3, 1, T] and .rope_deltas [1, 1] (get_rope_index);
  .image_embeds [n, 128] (vision tower + merger output, images concatenated); .logits [1, T, 512];
  .hidden_states [5, 1, T, 128]
- MoE models only, for text and each image group: .router_topk_L{i} [rows, 2] int64 for layers i = 0..3, rows =
  batch*T in row-major (batch, position) order; the two expert ids of a token are ordered by router probability,
  highest first (torch.topk of the softmax). .router_gap_L{i} [rows] float32: per token, the smallest gap between
  consecutive sorted router logits among its top 3, i.e. how decisive selection and order are (a test may exempt
  tokens whose gap is below its tolerance); .router_min_gap [1]: the minimum of those over all tokens and layers.
- gen_text / gen_image: greedy `generate(do_sample=False, max_new_tokens=32)` with eos disabled, so exactly 32 tokens.
  .prompt_ids [1, P] (gen_image's prompt is image_a's, with image_a's pixel_values/grid); .output_ids [1, 32] (the
  generated tokens only); .step_logits [32, 512] (the logits each new token was picked from, via the cache).

Images: `Fixtures.square_image` (384x384) and `Fixtures.wide_image` (300x200) are the PNGs the image groups used.
"""
from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file

from tests.tiny_tokenizer import build_tiny_tokenizer

ENDOFTEXT, IM_START, IM_END = 503, 504, 505
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 506, 507, 508, 509
TOKEN_IDS = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
                 vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)

TEXT_DIMS = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
    eos_token_id=[IM_END, ENDOFTEXT], initializer_range=0.05,
)
MOE_DIMS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=128)
DENSE_DIMS = dict(intermediate_size=256)
VISION_DIMS = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=64, out_hidden_size=128, initializer_range=0.05)

# The real preprocessor_config.json values.
PREPROCESSOR = dict(
    size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2, merge_size=2,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_resize=True, resample=3, do_rescale=True,
    rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True,
    image_processor_type="Qwen2VLImageProcessorFast", processor_class="Qwen3VLProcessor",
)

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Language-model matrices the official FP8 release quantizes; experts get bf16 scales, the rest fp32.
FP8_EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
FP8_OTHER = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
                       r"|shared_expert\.(gate|up|down)_proj)\.weight$")
FP32_IN_BF16_RELEASE = re.compile(r"linear_attn\.(A_log|norm\.weight)$")

GEN_TOKENS = 32
PROMPT_HEAD = "<|im_start|>user\n"
PROMPT_TAIL = "Describe the image in one sentence.<|im_end|>\n<|im_start|>assistant\n"
TEXT_PROMPT = "<|im_start|>user\nThe quick brown fox jumps over the lazy dog.<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Fixtures:
    root: Path
    moe_hf: Path
    moe_fused_bf16: Path
    moe_fp8: Path
    moe_text: Path
    dense: Path
    square_image: Path  # 384x384 PNG used by image_a / image_ab
    wide_image: Path  # 300x200 PNG used by image_b / image_ab

    def refs_file(self, model_dir: Path) -> Path:
        """The reference file of one model folder (moe_hf and moe_fused_bf16 share one)."""
        name = {"moe_hf": "moe", "moe_fused_bf16": "moe"}.get(model_dir.name, model_dir.name)
        return self.root / "refs" / f"{name}.safetensors"

    def refs(self, model_dir: Path) -> dict[str, torch.Tensor]:
        """Reference tensors of one model folder, named as in the module docstring."""
        return load_file(self.refs_file(model_dir))


def cache_key() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for source in (Path(__file__), here / "tiny_tokenizer.py"):
        digest.update(source.read_bytes())
    digest.update(build_tiny_tokenizer().to_str().encode())
    digest.update(version("transformers").encode() + version("torch").encode())
    return digest.hexdigest()[:16]


def build_fixtures(root: Path | None = None) -> Fixtures:
    """Build the fixtures into `root` unless they are already there; safe to call from several processes."""
    root = Path(root) if root is not None else \
        Path(os.environ.get("A3B_TEST_CACHE", "/tmp/a3b-test-cache")) / cache_key()
    build_once(root, _build_all)
    return _fixtures_at(root)


def build_once(root: Path, build: Callable[[Path], None]) -> None:
    """Runs build(folder) into a staging folder renamed to `root`, unless `root` exists; one builder at a time (a
    file lock beside it), the others wait and reuse its result; a crashed build leaves nothing at `root`."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not root.exists():
            staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # these matrices are tiny: extra threads only add spin-wait (conv1d 300x slower)
            try:
                build(staging)
                staging.rename(root)
            finally:
                torch.set_num_threads(threads)
                shutil.rmtree(staging, ignore_errors=True)


def _fixtures_at(root: Path) -> Fixtures:
    return Fixtures(root=root, moe_hf=root / "moe_hf", moe_fused_bf16=root / "moe_fused_bf16",
                    moe_fp8=root / "moe_fp8", moe_text=root / "moe_text", dense=root / "dense",
                    square_image=root / "refs" / "square_384x384.png", wide_image=root / "refs" / "wide_300x200.png")


# ------------------------------------------------------------------------ FP8 block quantization (ceil-div blocks)

def _expand_blocks(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    full = scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return full[: shape[0], : shape[1]]


def quantise_fp8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 weight, scale_inv [ceil(out/128), ceil(in/128)]) with scale = block absmax / 448."""
    rows, cols = weight.shape
    block_rows, block_cols = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = F.pad(weight.abs().float(), (0, block_cols * FP8_BLOCK - cols, 0, block_rows * FP8_BLOCK - rows))
    absmax = padded.view(block_rows, FP8_BLOCK, block_cols, FP8_BLOCK).amax(dim=(1, 3))
    # Round the scale to its stored dtype first, so dequantizing with the stored scale is what we quantized against.
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax)).to(scale_dtype)
    quantized = (weight.float() / _expand_blocks(scale, weight.shape)).clamp(-FP8_MAX, FP8_MAX)
    return quantized.to(torch.float8_e4m3fn), scale


def dequantise_fp8(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return quantized.float() * _expand_blocks(scale_inv, quantized.shape)


# ---------------------------------------------------------------- models

def _prepare_weights(model: torch.nn.Module, seed: int) -> None:
    """Make the random init test something: noisy 1-D params, decisive routers, bf16-exact values."""
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn(param.shape, generator=noise) * 0.1)
            if name.endswith("mlp.gate.weight"):
                param.mul_(3.0)
            param.copy_(param.to(torch.bfloat16).float())


def _finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    _prepare_weights(model, seed)
    return model.float().eval()


def _moe_vl_model() -> torch.nn.Module:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    config = Qwen3_5MoeConfig(text_config={**TEXT_DIMS, **MOE_DIMS}, vision_config=VISION_DIMS, **TOKEN_IDS)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    return _finish(Qwen3_5MoeForConditionalGeneration(config), seed=101)


def _dense_vl_model() -> torch.nn.Module:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    config = Qwen3_5Config(text_config={**TEXT_DIMS, **DENSE_DIMS}, vision_config=VISION_DIMS, **TOKEN_IDS)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    return _finish(Qwen3_5ForConditionalGeneration(config), seed=102)


def _moe_text_model(vl_model: torch.nn.Module) -> torch.nn.Module:
    """The text-only class holding exactly the VL model's language model."""
    from transformers import Qwen3_5MoeForCausalLM
    config = copy.deepcopy(vl_model.config.text_config)
    config._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(config)
    prefix = "model.language_model."
    weights = {("model." + k[len(prefix):] if k.startswith(prefix) else k): v
               for k, v in vl_model.state_dict().items() if k.startswith(prefix) or k == "lm_head.weight"}
    model.load_state_dict(weights, strict=True)
    return model.float().eval()


def _fp8_state(vl_model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """The official-FP8 tensors of `vl_model`, and a copy of the model holding their dequantized values."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in _official_bf16_state(vl_model).items():
        fused = re.match(r"(.*mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if fused is None:
            tensors[name] = value
            continue
        inter = MOE_DIMS["moe_intermediate_size"]
        for expert, matrix in enumerate(value):
            parts = {"down_proj": matrix} if fused[2] == "down_proj" else \
                {"gate_proj": matrix[:inter], "up_proj": matrix[inter:]}
            for part, weight in parts.items():
                tensors[f"{fused[1]}.{expert}.{part}.weight"] = weight
    dequantized = copy.deepcopy(vl_model)
    params = dict(dequantized.named_parameters())
    for name in list(tensors):
        scale_dtype = torch.bfloat16 if FP8_EXPERT.search(name) else torch.float32 if FP8_OTHER.search(name) else None
        if scale_dtype is None or not name.startswith("model.language_model."):
            continue
        quantized, scale = quantise_fp8(tensors[name], scale_dtype)
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantized, scale
        _set_weight(params, name, dequantise_fp8(quantized, scale))
    return tensors, dequantized


def _set_weight(params: dict[str, torch.nn.Parameter], name: str, weight: torch.Tensor) -> None:
    """Write one official-layout matrix into the transformers model (per-expert names map into the fused tensors)."""
    expert = re.match(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    with torch.no_grad():
        if expert is None:
            params[name].copy_(weight)
        elif expert[3] == "down":
            params[f"{expert[1]}.down_proj"][int(expert[2])].copy_(weight)
        else:
            inter = MOE_DIMS["moe_intermediate_size"]
            rows = slice(0, inter) if expert[3] == "gate" else slice(inter, 2 * inter)
            params[f"{expert[1]}.gate_up_proj"][int(expert[2]), rows].copy_(weight)


# ---------------------------------------------------------------- writers

def _official_bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' in-memory names already are the release names; only dtypes differ."""
    return {name: value.detach().clone().to(torch.float32 if FP32_IN_BF16_RELEASE.search(name) else torch.bfloat16)
            for name, value in model.state_dict().items()}


def _write_sharded(tensors: dict[str, torch.Tensor], folder: Path, shard_names: list[str]) -> None:
    """Split `tensors` (in order) into len(shard_names) files of about equal size, plus the index json."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[dict[str, torch.Tensor]] = [{} for _ in shard_names]
    written = 0
    for name, tensor in tensors.items():
        shards[min(len(shards) - 1, written * len(shards) // total)][name] = tensor.contiguous()
        written += tensor.numel() * tensor.element_size()
    weight_map = {}
    for shard, file_name in zip(shards, shard_names):
        save_file(shard, folder / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_extras(folder: Path, vision: bool) -> None:
    build_tiny_tokenizer().save(str(folder / "tokenizer.json"))
    if vision:
        (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))


def _write_like(source: Path, folder: Path, tensors: dict[str, torch.Tensor], shard_names: list[str],
                **config_changes) -> None:
    """A release-style folder: source's config (with changes), generation config and extras, plus `tensors`."""
    folder.mkdir()
    config = {**json.loads((source / "config.json").read_text()), **config_changes}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(source / "generation_config.json", folder)
    _write_extras(folder, vision=True)
    _write_sharded(tensors, folder, shard_names)


def _save_transformers(model: torch.nn.Module, folder: Path, vision: bool) -> None:
    model.save_pretrained(folder)
    _write_extras(folder, vision)


def _fp8_quantization_config() -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": ["lm_head", "model.visual", "model.language_model.embed_tokens", "mlp.gate",
                                       "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                                       "linear_attn.conv1d", "linear_attn.A_log", "linear_attn.dt_bias",
                                       "linear_attn.norm", "input_layernorm", "post_attention_layernorm",
                                       "self_attn.q_norm", "self_attn.k_norm", "model.language_model.norm"]}


# ---------------------------------------------------------------- inputs

def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic picture with gradients, noise and a few shapes (so resizing and patches are non-trivial)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    red = 255 * x / (width - 1)
    green = 255 * y / (height - 1)
    blue = 128 + 100 * np.sin(x / 17.0) * np.cos(y / 23.0)
    pixels = np.stack([red, green, blue], axis=-1) + rng.normal(0, 12, (height, width, 3))
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width * 3 // 4)), int(rng.integers(0, height * 3 // 4))
        x1, y1 = x0 + int(rng.integers(10, width // 3)), y0 + int(rng.integers(10, height // 3))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    return image


def _image_processor():
    from transformers import Qwen2VLImageProcessorPil
    keys = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return Qwen2VLImageProcessorPil(**{k: PREPROCESSOR[k] for k in keys})


def _image_inputs(images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """Processor output and the chat prompt with each image's pad tokens expanded (grid h * w / 4 per image)."""
    processed = _image_processor()(images=images, return_tensors="pt")
    encode = build_tiny_tokenizer().encode
    ids = encode(PROMPT_HEAD, add_special_tokens=False).ids
    for t, h, w in processed["image_grid_thw"].tolist():
        ids += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
    ids += encode(PROMPT_TAIL, add_special_tokens=False).ids
    return {"input_ids": torch.tensor([ids]), "pixel_values": processed["pixel_values"].float(),
            "image_grid_thw": processed["image_grid_thw"]}


# ---------------------------------------------------------------- references

def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]


def _forward_refs(model: torch.nn.Module, group: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    routers = _routers(model)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(routers)  # (router logits, top-k ids) per layer

    def hook(index: int):
        return lambda module, args, output: captured.__setitem__(index, (output[0], output[2]))

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers)]
    extra = {"mm_token_type_ids": (inputs["input_ids"] == IMAGE_PAD).int()} if "pixel_values" in inputs else {}
    try:
        with torch.no_grad():
            out = model(**inputs, **extra, output_hidden_states=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    refs = {f"{group}.{k}": v for k, v in inputs.items()}
    refs[f"{group}.logits"] = out.logits.float()
    refs[f"{group}.hidden_states"] = torch.stack(out.hidden_states).float()
    if routers:
        for layer, (logits, top_ids) in enumerate(captured):
            refs[f"{group}.router_topk_L{layer}"] = top_ids.long()
            top = logits.float().topk(top_ids.shape[-1] + 1, dim=-1).values
            refs[f"{group}.router_gap_L{layer}"] = (top[:, :-1] - top[:, 1:]).amin(dim=-1)
        refs[f"{group}.router_min_gap"] = torch.stack(
            [refs[f"{group}.router_gap_L{layer}"].min() for layer in range(len(captured))]).min().reshape(1)
    return refs


def _vision_refs(model: torch.nn.Module, group: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mm_types = (inputs["input_ids"] == IMAGE_PAD).int()
    with torch.no_grad():
        position_ids, rope_deltas = model.model.get_rope_index(inputs["input_ids"], mm_types, inputs["image_grid_thw"])
        embeds = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return {f"{group}.position_ids": position_ids, f"{group}.rope_deltas": rope_deltas.reshape(1, 1),
            f"{group}.image_embeds": torch.cat(embeds).float()}


def _generate_refs(model: torch.nn.Module, group: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=GEN_TOKENS, pad_token_id=ENDOFTEXT,
                              return_dict_in_generate=True, output_scores=True)
    extra = {"mm_token_type_ids": (inputs["input_ids"] == IMAGE_PAD).int()} if "pixel_values" in inputs else {}
    # generate() fills an unset eos from the model's own generation config, so clear it there to get all 32 tokens.
    own_config = model.generation_config
    model.generation_config = copy.deepcopy(own_config)
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(**inputs, **extra, generation_config=config)
    finally:
        model.generation_config = own_config
    prompt_len = inputs["input_ids"].shape[1]
    return {f"{group}.prompt_ids": inputs["input_ids"], f"{group}.output_ids": out.sequences[:, prompt_len:],
            f"{group}.step_logits": torch.cat(out.scores).float()}


def _all_refs(model: torch.nn.Module, images: list[Image.Image] | None) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, ENDOFTEXT, (2, 80), generator=torch.Generator().manual_seed(7))
    refs = _forward_refs(model, "text", {"input_ids": ids})
    text_prompt = torch.tensor([build_tiny_tokenizer().encode(TEXT_PROMPT, add_special_tokens=False).ids])
    refs |= _generate_refs(model, "gen_text", {"input_ids": text_prompt})
    if images is not None:
        square, wide = images
        for group, group_images in (("image_a", [square]), ("image_b", [wide]), ("image_ab", [square, wide])):
            inputs = _image_inputs(group_images)
            refs |= _forward_refs(model, group, inputs) | _vision_refs(model, group, inputs)
        refs |= _generate_refs(model, "gen_image", _image_inputs([square]))
    return {k: v.contiguous() for k, v in refs.items()}


# ---------------------------------------------------------------- the build

def _build_all(root: Path) -> None:
    fx = _fixtures_at(root)
    (root / "refs").mkdir()
    # Seed 13: every router choice on these prompts has a logit margin > 1e-4, also after FP8 (other seeds give margins near 1e-5).
    synthetic_image(384, 384, seed=13).save(fx.square_image)
    synthetic_image(300, 200, seed=12).save(fx.wide_image)
    images = [Image.open(fx.square_image).convert("RGB"), Image.open(fx.wide_image).convert("RGB")]

    moe = _moe_vl_model()
    _save_transformers(moe, fx.moe_hf, vision=True)
    save_file(_all_refs(moe, images), fx.refs_file(fx.moe_hf))
    _write_like(fx.moe_hf, fx.moe_fused_bf16, _official_bf16_state(moe),
                [f"model.safetensors-0000{i}-of-00003.safetensors" for i in (1, 2, 3)], dtype="bfloat16")

    fp8_tensors, dequantized = _fp8_state(moe)
    _write_like(fx.moe_hf, fx.moe_fp8, fp8_tensors, [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)],
                dtype="bfloat16", quantization_config=_fp8_quantization_config())
    save_file(_all_refs(dequantized, images), fx.refs_file(fx.moe_fp8))

    text = _moe_text_model(moe)
    _save_transformers(text, fx.moe_text, vision=False)
    save_file(_all_refs(text, None), fx.refs_file(fx.moe_text))

    dense = _dense_vl_model()
    _save_transformers(dense, fx.dense, vision=True)
    save_file(_all_refs(dense, images), fx.refs_file(fx.dense))
