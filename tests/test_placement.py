"""Placement planner: presets on the real Qwen3.5-35B-A3B header inventories (BF16 and FP8), errors, and the CLI."""
import json
import math
import struct
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from a3b_core.__main__ import main
from a3b_core.errors import PlacementError
from a3b_core.models import parse_config
from a3b_core.models.checkpoint_layout import classify, expert_layout
from a3b_core.models.qwen3_5.sizes import kv_bytes
from a3b_core.release.safetensors import DTYPES
from a3b_core.runtime.placement import CPU_WORKSPACE_BYTES, GiB, PRESETS, Plan, make_plan, plan_for_folder, tensor_bytes

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
RAM = 64 * GiB  # a typical desktop for the 35B model
GPU_PRESETS = tuple(PRESETS)


@cache
def real_config():
    return parse_config(json.loads((DATA / "qwen3_5_35b_a3b.config.json").read_text()))


@cache
def inventory(kind: str) -> dict:
    """name -> (shape, dtype); an entry [name, shape, dtype, n] stands for n tensors with '{j}' = 0..n-1."""
    out = {}
    entries = json.loads((DATA / f"qwen3_5_35b_a3b_{kind}.inventory.json").read_text())["tensors"]
    for name, shape, dtype, *repeat in entries:
        for j in range(repeat[0]) if repeat else [None]:
            out[name.replace("{j}", str(j))] = (tuple(shape), DTYPES[dtype])
    return out


def plan(kind: str, preset: str, **kw) -> Plan:
    kw.setdefault("cpu_free", RAM)
    kw.setdefault("has_cuda", True)
    return make_plan(real_config(), inventory(kind), preset, **kw)


def part(p: Plan, name: str):
    found = [x for x in p.parts if x.name == name]
    return found[0] if found else None


# ----------------------------------------------------------------------------------------------- the inventories
def test_inventories_match_the_published_checkpoint():
    bf16, fp8 = inventory("bf16"), inventory("fp8")
    params = lambda inv: sum(math.prod(s) for n, (s, _) in inv.items() if not n.endswith("_scale_inv"))
    assert len(bf16) == 1811 and params(bf16) == 35_951_822_704
    assert params(fp8) == 35_951_822_704
    quantized = [n for n, (_, d) in fp8.items() if d == torch.float8_e4m3fn]
    assert sum(".experts." in n for n in quantized) == 30720 and sum(".experts." not in n for n in quantized) == 250
    assert all(n + "_scale_inv" in fp8 for n in quantized)
    assert fp8["model.language_model.layers.3.self_attn.q_proj.weight_scale_inv"][0] == (64, 16)
    assert classify("model.language_model.layers.7.mlp.experts.gate_up_proj") == ("experts", 7)
    assert classify("mtp.layers.0.mlp.experts.3.up_proj.weight") == ("mtp", None)
    assert expert_layout(real_config(), bf16) == "fused [E, 2I, H]"
    assert expert_layout(real_config(), fp8) == "per-expert fp8 (block scales)"


def test_weight_format_sizes_relative_to_bf16():
    shape = (256, 1024, 2048)
    bf16 = tensor_bytes("w", shape, torch.bfloat16, "bf16")
    assert tensor_bytes("w", shape, torch.bfloat16, "int8") / bf16 == pytest.approx(0.5, abs=0.01)
    assert tensor_bytes("w", shape, torch.bfloat16, "int4") / bf16 == pytest.approx(0.281, abs=0.005)  # 0.5 B + 8 B per 128 weights
    assert tensor_bytes("w_scale_inv", (4, 16), torch.bfloat16, "int8") == 0  # scales go with dequantization
    assert tensor_bytes("norm", (2048,), torch.bfloat16, "bf16") == 2048 * 4  # vectors are kept in fp32


# ----------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_preset_fits_its_budget_with_cache_and_workspace(kind, preset):
    p = plan(kind, preset)
    assert p.gpu_budget == PRESETS[preset].vram_gib * GiB and p.preset == preset
    assert 0 < p.gpu_bytes <= p.gpu_budget and p.cpu_bytes <= p.cpu_budget
    for name in ("kv_cache", "deltanet_state", "cuda_context", "workspace", "lm_head", "mixers"):
        assert part(p, name).device == "cuda", name
    assert part(p, "kv_cache").bytes == kv_bytes(real_config(), p.max_context, p.kv_dtype)
    assert p.max_context == PRESETS[preset].max_context and p.kv_dtype == "bf16"
    # KV of the 10 full-attention layers: 10 x 2 x 2 KV heads x 256 x 2 bytes = 20 KiB per token (+1 B mask)
    assert part(p, "kv_cache").bytes == p.max_context * (20 * 1024 + 1)
    assert set(p.gpu_expert_layers) | {*range(40)} == {*range(40)}
    on_cpu = [layer for layer in range(40) if layer not in p.gpu_expert_layers]
    cpu_experts = part(p, "routed_experts_cpu")
    assert (cpu_experts is None) == (not on_cpu)
    assert p.dense_format == "bf16"  # bf16 dense parts leave room for the full context in every preset
    assert p.expert_format_gpu == ("fp8" if kind == "fp8" else "bf16")


def test_fp8_dense_parts_stay_fp8_only_when_bf16_leaves_no_room_for_the_cache():
    roomy = plan("fp8", "auto", gpu_free=8 * GiB, max_context=32768)
    tight = plan("fp8", "auto", gpu_free=5 * GiB, max_context=32768)
    assert roomy.dense_format == "bf16" and part(roomy, "mixers").format == "bf16"
    assert tight.dense_format == "fp8" and part(tight, "mixers").format == "fp8"
    assert part(tight, "mixers").bytes < 0.55 * part(roomy, "mixers").bytes
    assert tight.max_context == roomy.max_context == 32768 and tight.gpu_bytes <= 5 * GiB
    assert any("dequantized per use" in note for note in tight.notes)


def test_a_float32_gpu_plan_counts_float32_dense_parts_and_cache():
    bf16 = plan("bf16", "48gb", cpu_free=256 * GiB)
    fp32 = plan("bf16", "48gb", compute_format="fp32", cpu_free=256 * GiB)
    assert fp32.dense_format == "fp32" and fp32.kv_dtype == "fp32" and fp32.expert_format_gpu == "fp32"
    assert part(fp32, "mixers").bytes > 1.99 * part(bf16, "mixers").bytes  # matrices doubled, vectors fp32 in both
    assert part(fp32, "kv_cache").bytes == kv_bytes(real_config(), fp32.max_context, "fp32", "fp32")
    assert fp32.gpu_bytes <= fp32.gpu_budget


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_8gb_keeps_every_routed_expert_in_ram(kind):
    p = plan(kind, "8gb")
    assert p.gpu_expert_layers == () and part(p, "routed_experts_gpu") is None
    assert part(p, "routed_experts_cpu").device == "cpu" and p.expert_format_cpu == "int8"
    assert p.dense_device == "cuda" and p.embed_device == "cpu" and p.vision_device == "cuda"
    assert p.gpu_bytes <= 8 * GiB and any("--cpu-moe" in n for n in p.notes)


def test_48gb_puts_everything_on_the_gpu_with_fp8_experts():
    p = plan("fp8", "48gb")
    assert p.gpu_expert_layers == tuple(range(40)) and p.expert_format_gpu == "fp8" and p.dense_format == "bf16"
    assert p.embed_device == p.vision_device == p.dense_device == "cuda"
    assert [x.name for x in p.parts if x.device == "cpu"] == ["cpu_workspace"]
    assert p.cpu_bytes == CPU_WORKSPACE_BYTES and p.expert_format_cpu == "none"
    # the fp8 experts with their block scales: 40 layers x 256 x 3 x 512 x 2048 bytes plus ~4 MB of scales
    assert 30 * GiB < part(p, "routed_experts_gpu").bytes < 30 * GiB + 8 * 2**20


def test_bigger_presets_hold_more_expert_layers():
    counts = [len(plan("bf16", preset).gpu_expert_layers) for preset in GPU_PRESETS]
    assert counts == sorted(counts) and counts[0] == 0 and 0 < counts[-1] < 40
    p = plan("bf16", "24gb")
    assert p.gpu_expert_layers == tuple(range(len(p.gpu_expert_layers)))  # whole layers, from the first
    assert p.headroom < 1.5 * GiB + 1  # another bf16 layer (1.5 GiB) would not have fit


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_cpu_preset_puts_nothing_on_the_gpu(kind):
    p = plan(kind, "cpu")
    assert p.gpu_budget == 0 and p.gpu_bytes == 0 and p.headroom == 0
    assert all(x.device == "cpu" for x in p.parts)
    assert p.dense_device == p.embed_device == p.vision_device == "cpu" and p.gpu_expert_layers == ()
    assert p.dense_format == "bf16" and p.max_context == 32768
    assert "no GPU" in p.summary() and "experts all on CPU (int8)" in p.summary()


def test_without_cuda_every_preset_becomes_cpu():
    p = plan("bf16", "12gb", has_cuda=False)
    assert p.preset == "cpu" and p.gpu_bytes == 0 and any("no CUDA device" in n for n in p.notes)


def test_auto_uses_free_vram_and_ram():
    p = plan("bf16", "auto", gpu_free=20 * GiB, cpu_free=48 * GiB)
    assert p.gpu_budget == 20 * GiB and p.cpu_budget == 48 * GiB and p.gpu_bytes <= 20 * GiB
    assert p.max_context == PRESETS["16gb"].max_context  # the largest preset within the free VRAM
    assert len(p.gpu_expert_layers) > len(plan("bf16", "16gb").gpu_expert_layers)
    assert plan("bf16", "auto", has_cuda=False).preset == "cpu"


def test_auto_shortens_the_cache_to_fit_small_free_vram():
    p = plan("bf16", "auto", gpu_free=int(4.8 * GiB))
    assert p.gpu_bytes <= p.gpu_budget and p.max_context < 32768
    assert any("does not fit in VRAM" in n for n in p.notes) and p.vision_device == "cpu"


def test_named_preset_warns_when_less_vram_is_free():
    p = plan("bf16", "12gb", gpu_free=10 * GiB)
    assert any(n.startswith("warning: only 10.00 GiB of VRAM is free") for n in p.notes)
    assert not any(n.startswith("warning") for n in plan("bf16", "12gb", gpu_free=12 * GiB).notes)


# ----------------------------------------------------------------------------------------------- formats
def test_auto_weight_format_falls_back_to_int4_when_ram_is_short():
    roomy, short = plan("bf16", "8gb"), plan("bf16", "8gb", cpu_free=24 * GiB)
    assert roomy.expert_format_cpu == "int8" and short.expert_format_cpu == "int4"
    assert short.cpu_bytes <= 24 * GiB < roomy.cpu_bytes
    assert any("int4" in n and "because int8 would need" in n for n in short.notes)
    ratio = part(short, "routed_experts_cpu").bytes / part(roomy, "routed_experts_cpu").bytes
    assert ratio == pytest.approx(0.281 / 0.508, abs=0.02)


def test_explicit_weight_formats():
    kept = plan("fp8", "8gb", weight_format="fp8")
    assert kept.expert_format_cpu == "fp8" and 30 * GiB < part(kept, "routed_experts_cpu").bytes < 30.1 * GiB
    assert part(plan("bf16", "cpu", weight_format="bf16", cpu_free=128 * GiB), "routed_experts_cpu").bytes == 60 * GiB
    with pytest.raises(PlacementError, match="stores them unquantized"):
        plan("bf16", "8gb", weight_format="fp8")


def test_int8_kv_cache_halves_the_cache():
    bf16, int8 = plan("bf16", "16gb"), plan("bf16", "16gb", kv_cache="int8")
    assert int8.kv_dtype == "int8"
    # int8 values + an fp32 scale per token and head, plus one layer of bf16 scratch keys/values
    assert part(int8, "kv_cache").bytes / part(bf16, "kv_cache").bytes == pytest.approx(0.6, abs=0.02)
    assert len(int8.gpu_expert_layers) >= len(bf16.gpu_expert_layers)


def test_explicit_max_context_is_kept():
    p = plan("bf16", "24gb", max_context=8192)
    assert p.max_context == 8192 and part(p, "kv_cache").bytes == kv_bytes(real_config(), 8192, "bf16")


# ----------------------------------------------------------------------------------------------- errors
def test_vram_too_small_for_dense_parts_names_the_smallest_preset():
    with pytest.raises(PlacementError, match=r"preset auto: the dense parts.*VRAM.*smallest preset that fits is 8gb"):
        plan("bf16", "auto", gpu_free=3 * GiB)
    with pytest.raises(PlacementError) as err:
        plan("bf16", "8gb", max_context=262144, kv_cache="bf16")
    message = str(err.value)
    assert "smallest preset that fits is 12gb" in message and "max_context 131072 fits" in message
    assert "kv_cache int8 fits" in message
    assert plan("bf16", "8gb", max_context=131072, kv_cache="bf16").max_context == 131072


def test_ram_too_small_for_the_experts_names_what_would_fit():
    with pytest.raises(PlacementError) as err:
        plan("bf16", "8gb", cpu_free=12 * GiB)
    message = str(err.value)
    assert "of RAM" in message and "int4" in message
    suggested = message.split("smallest preset that fits is ")[1].split(";")[0]
    assert plan("bf16", suggested, cpu_free=12 * GiB).cpu_bytes <= 12 * GiB
    with pytest.raises(PlacementError):  # and it is the smallest
        plan("bf16", GPU_PRESETS[GPU_PRESETS.index(suggested) - 1], cpu_free=12 * GiB)
    with pytest.raises(PlacementError, match="weight_format int4 fits"):
        plan("bf16", "8gb", weight_format="int8", cpu_free=24 * GiB)
    with pytest.raises(PlacementError, match="preset cpu: .*need .* of RAM, but 1.00 GiB is available"):
        plan("bf16", "cpu", cpu_free=1 * GiB)
    with pytest.raises(PlacementError, match=r"preset 16gb \(planned as cpu: no CUDA device\): .* of RAM"):
        plan("bf16", "16gb", has_cuda=False, cpu_free=8 * GiB)


@pytest.mark.parametrize("fmt, ratio", [("int8", 0.51), ("int4", 0.28)])
def test_dense_format_counts_the_35b_dense_matrices_quantized(fmt, ratio):
    """A cpu plan of the 35B with dense int8/int4: lm_head, mixers and shared experts shrink to ~0.51x / ~0.28x (their
    fp32 vectors and the kept in_proj_a/b and shared-expert gates stay), routers and embedding as in bf16; the RAM
    total drops by the difference and the summary says so."""
    bf16 = plan("bf16", "cpu", cpu_free=128 * GiB)
    quantized = plan("bf16", "cpu", cpu_free=128 * GiB, dense_format=fmt)
    for name in ("lm_head", "mixers", "shared_experts"):
        assert part(quantized, name).format == fmt
        assert part(quantized, name).bytes / part(bf16, name).bytes == pytest.approx(ratio, abs=0.01), name
    for name in ("routers", "embed_tokens", "norms", "routed_experts_cpu"):
        assert part(quantized, name) == part(bf16, name)
    saved = sum(part(bf16, n).bytes - part(quantized, n).bytes for n in ("lm_head", "mixers", "shared_experts"))
    assert bf16.cpu_bytes - quantized.cpu_bytes == saved > (1.5 if fmt == "int8" else 2.2) * GiB
    assert f"dense {fmt} on cpu" in quantized.summary() and quantized.dense_format == fmt


@pytest.mark.parametrize("preset", ["8gb", "auto"])
def test_dense_format_is_refused_for_dense_parts_on_a_gpu(preset):
    with pytest.raises(PlacementError, match=r"dense_format 'int8' is for dense parts computed by the CPU.*pick "
                                             r"preset cpu"):
        plan("bf16", preset, gpu_free=24 * GiB, dense_format="int8")
    assert plan("bf16", preset, has_cuda=False, dense_format="int8").dense_device == "cpu"  # no GPU: planned as cpu


@pytest.mark.parametrize("bad", [dict(preset="6gb"), dict(weight_format="nf4"), dict(kv_cache="fp8"),
                                 dict(max_context=0), dict(max_context=300_000), dict(dense_format="q8_0")])
def test_bad_options_are_named(bad):
    preset = bad.pop("preset", "8gb")
    with pytest.raises(PlacementError, match="6gb|nf4|fp8|max_context|dense_format 'q8_0'"):
        plan("bf16", preset, **bad)


# ----------------------------------------------------------------------------------------------- report
def test_plan_prints_as_a_table_and_json():
    p = plan("bf16", "16gb")
    text = str(p)
    for x in p.parts:
        assert x.name in text
    assert "GPU total" in text and "headroom" in text and "notes:" in text and "16gb" in p.summary()
    doc = json.loads(json.dumps(p.to_json()))
    assert {"preset", "gpu_bytes", "cpu_bytes", "max_context", "kv_dtype", "parts"} <= set(doc)
    assert doc["gpu_bytes"] == sum(x["bytes"] for x in doc["parts"] if x["device"] == "cuda")
    assert doc["parts"][0].keys() == {"name", "device", "format", "bytes"}


# ----------------------------------------------------------------------------------------------- folders and CLI
def write_header_only_checkpoint(folder: Path, tensors: dict) -> int:
    """A real safetensors file whose data section is a hole (a sparse file): planning it must not read data."""
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        code = next(k for k, v in DTYPES.items() if v == dtype)
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return offset


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("rchar:")).split()[1])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "a3b_core", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def real_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_5_35b_a3b")
    (folder / "config.json").write_text((DATA / "qwen3_5_35b_a3b.config.json").read_text())
    assert write_header_only_checkpoint(folder, inventory("bf16")) > 66 * GiB
    yield folder
    (folder / "model.safetensors").unlink()  # tiny on disk, but 67 GB to any tool that copies it


def test_planning_a_folder_reads_only_headers(real_folder):
    before = bytes_read()
    p = plan_for_folder(real_folder, "12gb", has_cuda=True, cpu_free=RAM)
    assert bytes_read() - before < 2**20  # the 67 GB of weights are never read (the header is ~150 KB)
    assert p == plan("bf16", "12gb")


def test_cli_plan_json_and_inspect_on_the_real_layout(real_folder, capsys):
    out = run_cli("plan", real_folder, "--preset", "8gb", "--vram", "8", "--ram", "64", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc == json.loads(json.dumps(plan("bf16", "8gb", gpu_free=8 * GiB).to_json()))
    assert main(["inspect", str(real_folder)]) == 0
    text = capsys.readouterr().out
    assert "tensors: 1811 in 1 files" in text and "expert layout: fused [E, 2I, H]" in text
    assert "mtp: 785 tensors" in text and "40 layers (10 full attention, 30 DeltaNet)" in text


TINY_CONFIG = {
    "model_type": "qwen3_5_moe",
    "text_config": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "max_position_embeddings": 2048},
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny MoE checkpoint in the official fused BF16 layout (text only)."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    z = lambda *shape: torch.zeros(shape, dtype=torch.bfloat16)
    tensors = {"lm_head.weight": z(64, 32), "model.language_model.embed_tokens.weight": z(64, 32),
               "model.language_model.norm.weight": z(32)}
    for i in range(4):
        p = f"model.language_model.layers.{i}."
        mixer = {"self_attn.q_proj.weight": z(64, 32)} if i == 3 else {"linear_attn.in_proj_qkv.weight": z(64, 32)}
        tensors |= {p + k: v for k, v in {**mixer, "input_layernorm.weight": z(32), "mlp.gate.weight": z(4, 32),
                                          "mlp.shared_expert.up_proj.weight": z(8, 32),
                                          "mlp.experts.gate_up_proj": z(4, 16, 32),
                                          "mlp.experts.down_proj": z(4, 32, 8)}.items()}
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_cli_plan_on_a_tiny_checkpoint(tiny_folder, capsys):
    out = run_cli("plan", tiny_folder, "--preset", "cpu", "--json", "--max-context", "1024")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["preset"] == "cpu" and doc["gpu_bytes"] == 0 and doc["max_context"] == 1024 and doc["kv_dtype"]
    assert {x["name"] for x in doc["parts"]} >= {"embed_tokens", "lm_head", "mixers", "routed_experts_cpu", "kv_cache"}
    assert doc["vision_device"] == "none" and all(x["device"] == "cpu" for x in doc["parts"])
    assert main(["plan", str(tiny_folder), "--preset", "8gb", "--vram", "8"]) == 0
    assert "A3B placement plan, preset 8gb" in capsys.readouterr().out
    assert main(["plan", str(tiny_folder), "--preset", "cpu", "--dense-format", "int8"]) == 0
    assert "on the CPU in int8 (weight-only, as asked" in capsys.readouterr().out
    assert main(["plan", str(tiny_folder), "--max-context", "100000"]) == 2
    assert capsys.readouterr().err.startswith("error: max_context 100000 is out of range")


def test_dense_model_with_tied_embeddings():
    raw = {"model_type": "qwen3_5", "text_config": {**TINY_CONFIG["text_config"], "intermediate_size": 64,
                                                    "tie_word_embeddings": True}}
    z = lambda *shape: (shape, torch.bfloat16)
    tensors = {"model.language_model.embed_tokens.weight": z(64, 32), "model.language_model.norm.weight": z(32),
               "model.language_model.layers.0.mlp.up_proj.weight": z(64, 32),
               "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": z(64, 32)}
    p = make_plan(parse_config(raw), tensors, "12gb", has_cuda=True, cpu_free=RAM)
    assert p.expert_format_cpu == p.expert_format_gpu == "none" and p.gpu_expert_layers == ()
    assert part(p, "mlp").device == "cuda" and part(p, "embed_tokens+lm_head (tied)").device == "cuda"
    assert p.embed_device == "cuda" and expert_layout(parse_config(raw), tensors) == "none (dense MLP)"
    # dense int8 on the CPU: the tied table stays in the compute format (it is the embedding), the rest is int8
    cpu = make_plan(parse_config(raw), tensors, "cpu", cpu_free=RAM, dense_format="int8")
    assert part(cpu, "embed_tokens+lm_head (tied)") == part(make_plan(parse_config(raw), tensors, "cpu", cpu_free=RAM),
                                                            "embed_tokens+lm_head (tied)")
    assert part(cpu, "mlp").format == part(cpu, "mixers").format == "int8"
