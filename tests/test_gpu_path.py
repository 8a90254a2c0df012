"""The GPU path without a GPU: models placed on a stand-in CUDA device (tests/fake_cuda.py) under every kind of plan.

Each case loads a model with device="cuda", checks that every weight sits on the device and in the format the plan
names, that the bytes on the GPU are those the plan counts, then runs what users run: a long prefill (in chunks,
too), greedy and sampled generation, a left-padded batch, the int8 KV cache, images and per-image batches. A CPU
tensor meeting a CUDA one raises, as on a real GPU. Reading GPU values on the host is counted: one read per MoE layer
and step (the routing the CPU needs) plus one per step (the sampled tokens), no more.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from a3b_core import load_model
from a3b_core.formats.kernel_stores import KERNEL_FORMATS, KernelExperts, kernels_enabled
from a3b_core.formats.fp8 import Fp8Linear, quantize_fp8
from a3b_core.formats.stores import QuantizedExperts
from a3b_core.runtime.loader import DEMO_MODELS
from a3b_core.formats.table import FLOAT_FORMATS
from a3b_core.runtime.placement import CUDA_CONTEXT_BYTES, plan_for_folder
from tests.fake_cuda import FakeCuda
from tests.tiny_gguf import build_gguf_fixtures
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

HEART = Path(__file__).parent.parent / "workflows" / "inputs" / "a3b_pixel_art" / "a3b_pixel_heart.png"
NOT_WEIGHTS = ("cuda_context", "workspace", "kv_cache", "deltanet_state")
MiB = 1 << 20


@dataclass(frozen=True)
class Case:
    folder: str  # a fixtures attribute, "demo", "demo_fp8", "tied", a Qwen3-VL fixture or a GGUF (see `folders`)
    preset: str
    weight_format: str = "auto"
    gpu_expert_layers: int | None = None  # with preset auto: free VRAM for exactly this many expert layers

    def __str__(self) -> str:
        layers = "" if self.gpu_expert_layers is None else f"-{self.gpu_expert_layers}layers"
        return f"{self.folder}-{self.preset}-{self.weight_format}{layers}"


CASES = [
    Case("demo", "8gb"),  # int8 experts in RAM, dense parts and vision tower on the GPU
    Case("demo_fp8", "8gb", "fp8"),  # the released FP8 experts in RAM
    Case("moe_fused_bf16", "8gb", "bf16"),
    Case("moe_fused_bf16", "8gb", "int4"),
    Case("moe_fused_bf16", "12gb"),  # every expert layer on the GPU in bf16
    Case("moe_fp8", "12gb"),  # every expert layer on the GPU in FP8
    Case("moe_fused_bf16", "auto", gpu_expert_layers=2),  # two bf16 layers on the GPU, two int8 ones in RAM
    Case("moe_fp8", "auto", gpu_expert_layers=2),  # two FP8 layers on the GPU, two int8 ones in RAM
    Case("dense", "8gb"),
    Case("tied", "12gb"),  # lm_head is embed_tokens
    Case("qwen3_vl_bf16", "8gb"),  # Qwen3-VL: transposed fused experts in RAM as int8, DeepStack images
    Case("qwen3_vl_bf16", "auto", gpu_expert_layers=2),
    Case("qwen3_vl_fp8", "12gb"),
    Case("qwen3_vl_dense", "8gb"),
    Case("gguf_q8_0", "8gb"),  # llama.cpp's Q8_0 file: its experts in RAM in their blocks, dense parts dequantized
    Case("gguf_q8_0", "auto", gpu_expert_layers=2),  # two layers' experts dequantized onto the GPU
]


@pytest.fixture(scope="module")
def folders(fixtures, tmp_path_factory) -> dict[str, Path]:
    vl, ggufs = build_qwen3_vl_fixtures(), build_gguf_fixtures()
    tied = tmp_path_factory.mktemp("tied") / "dense_tied"
    shutil.copytree(fixtures.dense, tied)
    tensors = load_file(tied / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tied / "model.safetensors")
    config = json.loads((tied / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    return {"demo": DEMO_MODELS["a3b-demo"], "demo_fp8": DEMO_MODELS["a3b-demo-fp8"], "tied": tied,
            **{name: getattr(fixtures, name) for name in ("moe_fused_bf16", "moe_fp8", "dense")},
            "qwen3_vl_bf16": vl.moe_bf16, "qwen3_vl_fp8": vl.moe_fp8, "qwen3_vl_dense": vl.dense,
            **({"gguf_q8_0": ggufs.moe_q8_0} if ggufs is not None else {})}


def free_vram_for(folder: Path, layers: int) -> int:
    """Free VRAM for which the auto preset puts exactly `layers` expert layers on the GPU."""
    everything = plan_for_folder(folder, "auto", has_cuda=True, gpu_free=8 << 30)
    experts = next(p for p in everything.parts if p.name == "routed_experts_gpu")
    per_layer = experts.bytes // len(everything.gpu_expert_layers)
    embed = sum(p.bytes for p in everything.parts if p.name == "embed_tokens" and p.device == "cuda")
    return everything.gpu_bytes - experts.bytes - embed + layers * per_layer + per_layer // 2


def load_on_fake_cuda(case: Case, folder: Path, monkeypatch) -> tuple[object, FakeCuda]:
    if case.gpu_expert_layers is not None:  # what the stand-in GPU's driver reports as free
        free = free_vram_for(folder, case.gpu_expert_layers)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    fake = FakeCuda()
    with fake:
        model = load_model(folder, preset=case.preset, device="cuda", weight_format=case.weight_format)
    return model, fake


def expected_device(plan, name: str) -> str:
    if name.startswith("embed_tokens."):
        return plan.embed_device
    if ".mlp.experts." in name:
        return "cuda" if int(name.split(".")[1]) in plan.gpu_expert_layers else "cpu"
    return plan.dense_device


def assert_placed_as_planned(model) -> None:
    plan = model.plan
    tensors = [*model.text.named_parameters(remove_duplicate=False), *model.text.named_buffers()]
    misplaced = [(name, str(t.device)) for name, t in tensors if t.device.type != expected_device(plan, name)]
    if model.vision is not None:
        misplaced += [(f"vision.{name}", str(t.device)) for name, t in
                      [*model.vision.named_parameters(), *model.vision.named_buffers()]
                      if t.device.type != plan.vision_device]
    assert not misplaced, f"not where the plan puts them: {misplaced[:5]}"
    for index, layer in enumerate(model.text.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        fmt = plan.expert_format_gpu if index in plan.gpu_expert_layers else plan.expert_format_cpu
        if fmt in FLOAT_FORMATS:
            assert experts.gate_up_proj.dtype == FLOAT_FORMATS[fmt], (index, fmt)
        else:
            assert isinstance(experts, (QuantizedExperts, KernelExperts)) and experts.fmt == fmt, (index, fmt)
            assert isinstance(experts, KernelExperts) == (experts.device.type == "cpu" and kernels_enabled()
                                                          and fmt in KERNEL_FORMATS)
    mixers = model.text.layers[-1].self_attn
    assert isinstance(mixers.o_proj, Fp8Linear) == (plan.dense_format == "fp8")
    if model.config.text.tie_word_embeddings and "lm_head" not in [p.name for p in plan.parts]:
        assert model.text.lm_head.weight is model.text.embed_tokens.weight


def planned_weight_bytes(plan) -> int:
    return sum(p.bytes for p in plan.parts if p.device == "cuda" and p.name not in NOT_WEIGHTS)


def moe_layers(model) -> int:
    return sum(hasattr(layer.mlp, "experts") for layer in model.text.layers)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_plan_runs_on_a_stand_in_gpu(case, folders, monkeypatch):
    if case.folder not in folders:
        pytest.skip("llama.cpp's converter could not be downloaded, so no GGUF files can be made")
    folder = folders[case.folder]
    model, fake = load_on_fake_cuda(case, folder, monkeypatch)
    plan = model.plan
    assert plan.dense_device == "cuda" and model.device.type == "cuda"
    if case.gpu_expert_layers is not None:
        assert plan.gpu_expert_layers == tuple(range(case.gpu_expert_layers))
    assert_placed_as_planned(model)
    assert 0 < fake.memory.live <= planned_weight_bytes(plan)
    vocab = model.config.text.vocab_size
    ids = torch.arange(80) * 7 % min(vocab, 400)  # longer than one 64-token DeltaNet chunk
    steps_reads = moe_layers(model) + 1
    with fake:
        fake.memory.reset_peak()
        assert model.logits(ids[None]).shape == (1, 80, vocab)
        cache = model.new_cache(1, 96)
        positions, _ = model.positions(ids[None], None)
        model.prefill(ids[None], None, cache, None, positions, chunk=32)  # chunks continue the cache
        assert cache.length == 80
        reads = fake.host_reads
        assert len(model.generate(ids.tolist(), max_new_tokens=5, temperature=0).token_ids) == 5
        assert fake.host_reads - reads <= 5 * steps_reads
        model.generate(ids.tolist(), max_new_tokens=3, temperature=0.7, top_k=0, seed=1)
        model.generate(ids.tolist(), max_new_tokens=3, temperature=0.7, seed=1, kv_dtype="int8")
        model.generate_batch([ids[:50].tolist(), ids.tolist()], max_new_tokens=3, temperature=0.7,
                             repetition_penalty=1.1)
        if model.vision is not None:
            images = model.encode_images([HEART] * 2, size=64)
            assert all(e.device.type == "cpu" for e in images.embeds)  # kept in RAM until a prompt uses them
            prompts = [model.build_prompt("Describe [[IMG]].", images=images[i]) for i in range(2)]
            model.generate_batch(prompts, max_new_tokens=2, temperature=0)
            model.generate(model.build_prompt("Compare [[IMG]] and [[IMG]].", images=images), max_new_tokens=2)
    assert fake.memory.peak <= plan.gpu_bytes - CUDA_CONTEXT_BYTES


def test_gpu_expert_layers_never_touch_the_cpu_formats_cache(folders, monkeypatch, tmp_path):
    """FP8 experts on the GPU are kept as released; only the int8 layers in RAM are converted and cached, each in
    the int8 cache, and a plan with other GPU layers reuses them."""
    monkeypatch.setenv("A3B_CACHE_DIR", str(tmp_path))
    load_on_fake_cuda(Case("moe_fp8", "auto", gpu_expert_layers=2), folders["moe_fp8"], monkeypatch)
    cached = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors"))
    assert [p.split("/")[-1] for p in cached] == ["layer2.safetensors", "layer3.safetensors"]
    assert all("-int8-" in p for p in cached)
    stamps = {p: (tmp_path / p).stat().st_mtime_ns for p in cached}
    model, _ = load_on_fake_cuda(Case("moe_fp8", "auto", gpu_expert_layers=1), folders["moe_fp8"], monkeypatch)
    assert model.plan.gpu_expert_layers == (0,)
    assert {p: (tmp_path / p).stat().st_mtime_ns for p in cached} == stamps  # layers 2-3 read, not converted again
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3  # layer 1 joined them


def test_a_float32_model_on_the_gpu_holds_what_its_plan_counts(folders, monkeypatch):
    fake = FakeCuda()
    with fake:
        model = load_model(folders["moe_fused_bf16"], preset="12gb", device="cuda", compute_dtype="float32")
    assert model.plan.dense_format == "fp32" and model.plan.kv_dtype == "fp32"
    assert_placed_as_planned(model)
    assert fake.memory.live <= planned_weight_bytes(model.plan)


def test_fp8_dense_layers_compute_on_the_gpu():
    q, scale = quantize_fp8(torch.randn(256, 384))
    layer = Fp8Linear(q, scale, (128, 128))
    fake = FakeCuda()
    with fake:
        layer.to("cuda")
        out = layer(torch.randn(3, 384).to("cuda", torch.bfloat16))
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16 and out.shape == (3, 256)


def test_int4_experts_are_refused_on_the_gpu(folders, monkeypatch):
    from a3b_core.release.safetensors import Checkpoint
    from a3b_core.models import load_config
    from a3b_core.errors import PlacementError
    from a3b_core.models.checkpoint_layout import load_quantized_experts

    folder = folders["moe_fused_bf16"]
    config = load_config(folder)
    with pytest.raises(PlacementError, match="int4.*CPU"):
        load_quantized_experts(Checkpoint(folder), "model.language_model.layers.0.mlp.experts.", config.text, "int4",
                               torch.device("cuda"), None)
