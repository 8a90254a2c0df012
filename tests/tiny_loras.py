"""Tiny PEFT LoRA adapters for the tiny checkpoints, plus fp32 reference logits from peft (the LoRA oracle).

`build_lora_fixtures()` builds everything once into `$A3B_TEST_CACHE/lora-<key>` (default under /tmp/a3b-test-cache),
keyed by the source of this file, the cache keys of tiny_models.py and tiny_qwen3_vl.py (whose checkpoints the
adapters are made for) and the transformers, torch and peft versions; like tiny_models, a build goes to a temporary
folder that is renamed into place.

Every adapter is `get_peft_model(base, LoraConfig(..., init_lora_weights=False))` on the transformers model loaded
from the fixture folder (fp32, eager attention), so the base weights are exactly what the engine loads; A and B are
random (seeded), then every lora_B is rescaled twice towards a mean |logit change| of 0.03 on the adapter's own prompt
(not the peak: a small change can flip an MoE router choice, so the peak is far from linear in B). The largest change
is then 0.3-1.7 (checked to be in 0.1-2). Every MoE router choice with an adapter on, on every reference prompt, keeps
a logit margin > 1e-4 (checked), so a 1e-4 comparison never hinges on a near tie.
Each folder is what `PeftModel.save_pretrained` writes: adapter_config.json + adapter_model.safetensors, keys
`base_model.model.<module>.lora_{A,B}.weight`, A [r, in], B [out, r]. What PEFT writes besides:
- target_parameters on the fused experts nest one ParamWrapper in another, named by module only: the first listed
  parameter (gate_up_proj) is `mlp.experts.base_layer.lora_{A,B}.weight`, the second (down_proj)
  `mlp.experts.lora_{A,B}.weight`. A is [E*r, in] expert-major (rows e*r..e*r+r-1 are expert e), B is [out, r*E]
  with the expert index fastest (column k*E + e is rank k of expert e); delta_e = scaling * B_e @ A_e, [out, in]
  as transformers holds the parameter ([E, out, in]); scaling is alpha/r, or alpha/sqrt(r) with rslora.
- targeting lm_head also saves the unchanged base matrix as `lm_head.base_layer.weight` (PEFT takes lm_head for an
  embedding layer and sets save_embedding_layers).
- modules_to_save=["lm_head"] saves the whole replacement as `base_model.model.lm_head.weight`.
- rank_pattern / alpha_pattern are only in adapter_config.json; the tensor shapes show the per-module rank.
Adapters (Qwen3.5 MoE VL = tiny_models' moe_hf unless said):
- moe_all       every text projection: self_attn q/k/v/o_proj, linear_attn in_proj_qkv/z/a/b and out_proj,
                shared_expert gate/up/down_proj, lm_head; and target_parameters mlp.experts.gate_up_proj and
                mlp.experts.down_proj; r=4, alpha=8, use_rslora (scaling alpha/sqrt(r)).
- moe_vision    the vision tower only: blocks' attn.qkv, attn.proj, mlp.linear_fc1/2 and merger.linear_fc1/2 (a regex,
                so patch_embed.proj is left alone); r=8, alpha=16. Text-only prompts are unchanged by it.
- moe_second    q_proj, v_proj, shared_expert down_proj; r=2, alpha=4; meant to be active together with moe_all.
- moe_patterns  q_proj, o_proj, in_proj_qkv, out_proj, shared_expert down_proj in layers 0 and 3 only
                (layers_to_transform=[0, 3], layers_pattern="layers"); r=4, alpha=8, rank_pattern {"q_proj": 8},
                alpha_pattern {"o_proj": 32}.
- moe_save      q_proj (r=4, alpha=8) and modules_to_save=["lm_head"]: a whole lm_head, perturbed by N(0, 0.01).
- dense_mlp     on tiny_models' dense (Qwen3_5ForConditionalGeneration): the dense MLP's gate/up/down_proj, q_proj,
                in_proj_qkv; r=4, alpha=8.
- vl_all        on tiny_qwen3_vl's moe_hf (Qwen3VLMoeForConditionalGeneration): self_attn q/k/v/o_proj, the whole
                vision tower's attn.qkv, attn.proj, mlp.linear_fc1/2, merger and deepstack_merger_list linear_fc1/2,
                and target_parameters mlp.experts.gate_up_proj / down_proj (Qwen3VLMoeTextExperts); r=4, alpha=8,
                use_rslora.
- text_only     on tiny_models' moe_text (Qwen3_5MoeForCausalLM, modules `model.layers.*`): q_proj, out_proj; r=4,
                alpha=8.

References, `LoraFixtures.refs()` = `refs.safetensors`, fp32 logits by peft with eager attention:
- text.input_ids [2, 80]: the fixtures' text prompt (tiny_models' refs text.input_ids, ids < 503).
- image_a.input_ids [1, T]: the fixtures' image_a prompt (one 384x384 image, `square_image` of either fixture set,
  144 image tokens), identical for Qwen3.5 and Qwen3-VL.
- base.{moe,dense,moe_text,vl_moe}.text.logits [2, 80, 512]: each base without any adapter (checked equal to the
  fixtures' own text.logits); base.{moe,vl_moe}.image_a.logits [1, T, 512].
- {adapter}.text.logits [2, 80, 512] for every adapter; {adapter}.image_a.logits [1, T, 512] for moe_vision, vl_all.
- moe_all@0.5.text.logits: moe_all at strength 0.5, i.e. every LoRA layer's scaling (Linear and the experts'
  ParamWrapper) set to half by `set_scale("default", 0.5)`; checked equal to halving every lora_B instead.
- moe_all+moe_second.text.logits: both adapters active at once (`base_model.set_adapter([...])`); checked equal to
  merging moe_all into the base and then moe_second into that (base + delta1 + delta2 as weights).
Every adapter's references are checked against a fresh base + `PeftModel.from_pretrained(folder)`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests import tiny_models as tm
from tests import tiny_qwen3_vl as tv

TARGET_MEAN = 0.03  # mean |logit change| an adapter is scaled to on its own prompt
PEAK_RANGE = (0.1, 2.0)  # what the self-check accepts of the largest |logit change|
ROUTER_MARGIN = 1e-4  # every router choice with an adapter on keeps at least this logit margin (as tiny_models')
HALF = 0.5

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE_VISION = r"model\.visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])|merger\.linear_fc[12])"
VL_TARGETS = (r"model\.(language_model\.layers\.\d+\.self_attn\.[qkvo]_proj"
              r"|visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])"
              r"|(merger|deepstack_merger_list\.\d+)\.linear_fc[12]))")


@dataclass(frozen=True)
class AdapterSpec:
    base: str  # a key of the bases: moe, dense, moe_text, vl_moe
    seed: int  # for A and B
    config: dict = field(default_factory=dict)  # LoraConfig arguments besides init_lora_weights
    vision: bool = False  # touches the vision tower: also an image_a reference, and scaled on it


ADAPTERS: dict[str, AdapterSpec] = {
    "moe_all": AdapterSpec("moe", 1000, dict(
        r=4, lora_alpha=8, use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                        "out_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
        target_parameters=EXPERT_PARAMETERS)),
    "moe_vision": AdapterSpec("moe", 1001, dict(r=8, lora_alpha=16, target_modules=MOE_VISION), vision=True),
    "moe_second": AdapterSpec("moe", 1002, dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])),
    "moe_patterns": AdapterSpec("moe", 3003, dict(  # 1003: a router margin of 8e-5
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "in_proj_qkv", "out_proj", "down_proj"],
        rank_pattern={"q_proj": 8}, alpha_pattern={"o_proj": 32}, layers_to_transform=[0, 3],
        layers_pattern="layers")),
    "moe_save": AdapterSpec("moe", 1004, dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                              modules_to_save=["lm_head"])),
    "dense_mlp": AdapterSpec("dense", 1005, dict(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj", "in_proj_qkv"])),
    "vl_all": AdapterSpec("vl_moe", 1006, dict(r=4, lora_alpha=8, use_rslora=True, target_modules=VL_TARGETS,
                                         target_parameters=EXPERT_PARAMETERS), vision=True),
    "text_only": AdapterSpec("moe_text", 1007, dict(r=4, lora_alpha=8, target_modules=["q_proj", "out_proj"])),
}


@dataclass(frozen=True)
class LoraFixtures:
    root: Path
    moe_all: Path
    moe_vision: Path
    moe_second: Path
    moe_patterns: Path
    moe_save: Path
    dense_mlp: Path
    vl_all: Path
    text_only: Path

    def refs(self) -> dict[str, torch.Tensor]:
        """Reference tensors, named as in the module docstring."""
        return load_file(self.root / "refs.safetensors")


def cache_key() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update((tm.cache_key() + tv.cache_key()).encode())
    digest.update(version("transformers").encode() + version("torch").encode() + version("peft").encode())
    return digest.hexdigest()[:16]


def build_lora_fixtures() -> LoraFixtures:
    """Build the adapters and references unless they are cached; safe to call from several processes."""
    fixtures, vl_fixtures = tm.build_fixtures(), tv.build_qwen3_vl_fixtures()  # outside our lock: they take their own
    root = Path(os.environ.get("A3B_TEST_CACHE", "/tmp/a3b-test-cache")) / f"lora-{cache_key()}"
    tm.build_once(root, lambda staging: _build_all(staging, fixtures, vl_fixtures))
    return _fixtures_at(root)


def _fixtures_at(root: Path) -> LoraFixtures:
    return LoraFixtures(root=root, **{name: root / name for name in ADAPTERS})


# ---------------------------------------------------------------- models and forwards

class _Bases:
    """The base checkpoints by short name, their fixture references and the prompts."""

    def __init__(self, fixtures: tm.Fixtures, vl_fixtures: tv.VlFixtures) -> None:
        self.folders = {"moe": fixtures.moe_hf, "dense": fixtures.dense, "moe_text": fixtures.moe_text,
                        "vl_moe": vl_fixtures.moe_hf}
        self.fixture_refs = {"moe": fixtures.refs(fixtures.moe_hf), "dense": fixtures.refs(fixtures.dense),
                             "moe_text": fixtures.refs(fixtures.moe_text),
                             "vl_moe": vl_fixtures.refs(vl_fixtures.moe_hf)}

    def load(self, base: str) -> torch.nn.Module:
        from transformers import (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                                  Qwen3_5MoeForConditionalGeneration, Qwen3VLMoeForConditionalGeneration)
        model_class = {"moe": Qwen3_5MoeForConditionalGeneration, "dense": Qwen3_5ForConditionalGeneration,
                       "moe_text": Qwen3_5MoeForCausalLM, "vl_moe": Qwen3VLMoeForConditionalGeneration}[base]
        model = model_class.from_pretrained(self.folders[base], torch_dtype=torch.float32, attn_implementation="eager")
        return model.eval()

    def inputs(self, base: str, group: str) -> dict[str, torch.Tensor]:
        """The fixtures' own model inputs of `group` (text: input_ids; image_a: also pixel_values, image_grid_thw)."""
        keys = ["input_ids"] if group == "text" else ["input_ids", "pixel_values", "image_grid_thw"]
        return {key: self.fixture_refs[base][f"{group}.{key}"] for key in keys}


def _logits(model: torch.nn.Module, bases: _Bases, base: str, group: str, check_routers: bool = False) -> torch.Tensor:
    """The logits of `group`; with check_routers, also that no MoE router choice is within ROUTER_MARGIN of a tie."""
    refs = tm._forward_refs(model, group, bases.inputs(base, group))
    if check_routers and f"{group}.router_min_gap" in refs:
        assert refs[f"{group}.router_min_gap"].item() > ROUTER_MARGIN, (base, group, refs[f"{group}.router_min_gap"])
    return refs[f"{group}.logits"]


def _groups(spec: AdapterSpec) -> list[str]:
    return ["text", "image_a"] if spec.vision else ["text"]


def _peak(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.lora import LoraLayer
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def _scale_lora_b(model: torch.nn.Module, factor: float) -> None:
    with torch.no_grad():
        for layer in _lora_layers(model):
            for linear in layer.lora_B.values():
                linear.weight.mul_(factor)


def _calibrate(model: torch.nn.Module, bases: _Bases, spec: AdapterSpec, base_logits: dict[str, torch.Tensor]) -> None:
    """Rescale every lora_B so the mean |logit change| on the adapter's own prompt is about TARGET_MEAN. (Not the
    peak: a small change can flip an MoE router choice, so the peak is far from linear in B; the mean nearly is.)"""
    group = _groups(spec)[-1]
    for _ in range(2):
        change = (_logits(model, bases, spec.base, group) - base_logits[group]).abs().mean().item()
        _scale_lora_b(model, TARGET_MEAN / change)


def _perturb_saved_lm_head(model: torch.nn.Module) -> None:
    """modules_to_save copies lm_head unchanged; make the saved copy differ from the base."""
    wrapper = model.base_model.model.lm_head
    noise = torch.Generator().manual_seed(55)
    with torch.no_grad():
        weight = wrapper.modules_to_save["default"].weight
        weight.add_(torch.randn(weight.shape, generator=noise) * 0.01)


# ---------------------------------------------------------------- the build

def _build_all(root: Path, fixtures: tm.Fixtures, vl_fixtures: tv.VlFixtures) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    bases = _Bases(fixtures, vl_fixtures)
    refs: dict[str, torch.Tensor] = {"text.input_ids": bases.fixture_refs["moe"]["text.input_ids"],
                                     "image_a.input_ids": bases.fixture_refs["moe"]["image_a.input_ids"]}
    for base in ("dense", "moe_text", "vl_moe"):
        assert torch.equal(bases.fixture_refs[base]["text.input_ids"], refs["text.input_ids"]), base
    assert torch.equal(bases.fixture_refs["vl_moe"]["image_a.input_ids"], refs["image_a.input_ids"])

    base_logits: dict[str, dict[str, torch.Tensor]] = {}
    for base in bases.folders:
        model = bases.load(base)
        groups = ["text", "image_a"] if base in ("moe", "vl_moe") else ["text"]
        base_logits[base] = {group: _logits(model, bases, base, group) for group in groups}
        for group, logits in base_logits[base].items():
            torch.testing.assert_close(logits, bases.fixture_refs[base][f"{group}.logits"], atol=1e-5, rtol=0)
            refs[f"base.{base}.{group}.logits"] = logits

    for name, spec in ADAPTERS.items():
        torch.manual_seed(spec.seed)
        model = get_peft_model(bases.load(spec.base), LoraConfig(init_lora_weights=False, **spec.config)).eval()
        _calibrate(model, bases, spec, base_logits[spec.base])
        if name == "moe_save":
            _perturb_saved_lm_head(model)
        model.save_pretrained(root / name)
        for group in _groups(spec):
            logits = _logits(model, bases, spec.base, group, check_routers=True)
            peak = _peak(logits, base_logits[spec.base][group])
            if name == "moe_vision" and group == "text":
                assert peak == 0, "a vision-only adapter changed a text-only prompt"
            else:
                assert PEAK_RANGE[0] <= peak <= PEAK_RANGE[1], (name, group, peak)
            refs[f"{name}.{group}.logits"] = logits
        reloaded = PeftModel.from_pretrained(bases.load(spec.base), root / name).eval()
        for group in _groups(spec):
            torch.testing.assert_close(_logits(reloaded, bases, spec.base, group), refs[f"{name}.{group}.logits"],
                                       atol=1e-6, rtol=0)

    refs["moe_all@0.5.text.logits"] = _half_strength_logits(bases, root / "moe_all")
    refs["moe_all+moe_second.text.logits"] = _pair_logits(bases, root / "moe_all", root / "moe_second",
                                                          [refs["moe_all.text.logits"], refs["moe_second.text.logits"]])
    save_file({k: v.contiguous() for k, v in refs.items()}, root / "refs.safetensors")


def _half_strength_logits(bases: _Bases, folder: Path) -> torch.Tensor:
    """The adapter at strength HALF via peft's set_scale; checked equal to halving every lora_B."""
    from peft import PeftModel
    from peft.tuners.lora import Linear, ParamWrapper
    model = PeftModel.from_pretrained(bases.load("moe"), folder).eval()
    full = _logits(model, bases, "moe", "text")
    layers = _lora_layers(model)
    assert {Linear, ParamWrapper} <= {type(layer) for layer in layers}
    for layer in layers:
        layer.set_scale("default", HALF)
        expected = HALF * layer.lora_alpha["default"] / layer.r["default"] ** 0.5  # moe_all uses rslora
        assert abs(layer.scaling["default"] - expected) < 1e-12, (layer, layer.scaling)
    half = _logits(model, bases, "moe", "text", check_routers=True)

    by_weights = PeftModel.from_pretrained(bases.load("moe"), folder).eval()
    _scale_lora_b(by_weights, HALF)
    torch.testing.assert_close(_logits(by_weights, bases, "moe", "text"), half, atol=1e-5, rtol=0)
    assert _peak(half, full) > 0.05
    return half


def _pair_logits(bases: _Bases, first: Path, second: Path, alone: list[torch.Tensor]) -> torch.Tensor:
    """Both adapters active at once; checked equal to both merged into the base weights one after the other."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(bases.load("moe"), first, adapter_name="first").eval()
    model.load_adapter(second, adapter_name="second")
    model.base_model.set_adapter(["first", "second"])
    assert all(set(layer.active_adapters) == {"first", "second"} for layer in _lora_layers(model))
    both = _logits(model, bases, "moe", "text", check_routers=True)

    merged = PeftModel.from_pretrained(bases.load("moe"), first).merge_and_unload()
    merged = PeftModel.from_pretrained(merged, second).merge_and_unload().eval()
    torch.testing.assert_close(_logits(merged, bases, "moe", "text"), both, atol=1e-4, rtol=0)  # merging rounds
    for logits in alone:
        assert _peak(both, logits) > 0.05
    return both
