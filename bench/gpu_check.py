"""GPU check of the VRAM plans: a random checkpoint with the real Qwen3.5-35B-A3B shapes in the official FP8 layout,
loaded under each preset with torch's allocator capped at the preset less the CUDA context reserve, then an 8k-token
prompt and 64 generated tokens.

    python bench/gpu_check.py [--dir /tmp/a3b-35b-fp8] [--presets 8gb,24gb] [--prompt-tokens 8192] [--tokens 64]
                              [--small]

Prints one table: per preset the plan's GPU total, the cap, peak VRAM while loading and while generating, time to
first token, prefill and decode tokens/s, peak RSS; exits 1 if a peak passes its cap. `--small` writes a tiny model
of the same layout instead (seconds, runs on a CPU too) to check the script itself. Needs a CUDA GPU for the real
check and ~35 GB of disk. bench/gpu_checks.sh runs it after tests/test_offload.py.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from a3b_core import load_model  # noqa: E402
from a3b_core.runtime.placement import CUDA_CONTEXT_BYTES, GiB, PRESETS

REAL_TEXT = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
                 num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 full_attention_interval=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                 eos_token_id=248044, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                       "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                       "mrope_interleaved": True})
SMALL_TEXT = {**REAL_TEXT, "vocab_size": 4096, "eos_token_id": 4095, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
              "linear_value_head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
              "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
              "rope_parameters": {**REAL_TEXT["rope_parameters"], "mrope_section": [3, 3, 2]}}
SHARD_BYTES = 2 << 30


def fp8_random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 values (exponent field kept below the NaN/large range), fast: no float conversion."""
    raw = torch.randint(0, 0x50, shape, dtype=torch.uint8, generator=gen)
    raw |= torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7
    return raw.view(torch.float8_e4m3fn)


def text_tensors(cfg: dict):
    """(name, shape, fp8?) for every tensor of the language model in the official FP8 release layout."""
    h, e, i, s = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, hd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    p = "model.language_model."
    yield "lm_head.weight", (cfg["vocab_size"], h), False
    yield p + "embed_tokens.weight", (cfg["vocab_size"], h), False
    yield p + "norm.weight", (h,), False
    for layer in range(cfg["num_hidden_layers"]):
        q = f"{p}layers.{layer}."
        yield q + "input_layernorm.weight", (h,), False
        yield q + "post_attention_layernorm.weight", (h,), False
        if (layer + 1) % cfg["full_attention_interval"]:
            a = q + "linear_attn."
            yield a + "in_proj_qkv.weight", (2 * nk * dk + nv * dv, h), True
            yield a + "in_proj_z.weight", (nv * dv, h), True
            yield a + "in_proj_b.weight", (nv, h), False
            yield a + "in_proj_a.weight", (nv, h), False
            yield a + "conv1d.weight", (2 * nk * dk + nv * dv, 1, 4), False
            yield a + "dt_bias", (nv,), False
            yield a + "A_log", (nv,), False
            yield a + "norm.weight", (dv,), False
            yield a + "out_proj.weight", (h, nv * dv), True
        else:
            a = q + "self_attn."
            yield a + "q_proj.weight", (nh * hd * 2, h), True
            yield a + "k_proj.weight", (nkv * hd, h), True
            yield a + "v_proj.weight", (nkv * hd, h), True
            yield a + "o_proj.weight", (h, nh * hd), True
            yield a + "q_norm.weight", (hd,), False
            yield a + "k_norm.weight", (hd,), False
        m = q + "mlp."
        yield m + "gate.weight", (e, h), False
        yield m + "shared_expert_gate.weight", (1, h), False
        for name, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
            yield f"{m}shared_expert.{name}.weight", shape, True
        for j in range(e):
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                yield f"{m}experts.{j}.{name}.weight", shape, True


def write_checkpoint(folder: Path, cfg: dict) -> None:
    if (folder / "model.safetensors.index.json").is_file():
        print(f"reusing {folder}")
        return
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    names: list[str] = []

    def flush() -> None:
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shard, folder / name)
        weight_map.update({k: name for k in shard})
        names.append(name)
        shard.clear()

    size = 0
    for name, shape, fp8 in text_tensors(cfg):
        if fp8:
            shard[name] = fp8_random(shape, gen)
            scale = (-(-shape[0] // 128), -(-shape[1] // 128))
            shard[name + "_scale_inv"] = torch.full(scale, 2e-4, dtype=torch.bfloat16)
        elif len(shape) == 1:
            shard[name] = torch.randn(shape, generator=gen) * 0.1
        else:
            shard[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += shard[name].numel() * shard[name].element_size()
        if size > SHARD_BYTES:
            flush()
            size = 0
    flush()
    total = len(names)
    renamed = {n: f"model.safetensors-{k + 1:05d}-of-{total:05d}.safetensors" for k, n in enumerate(names)}
    for old, new in renamed.items():
        (folder / old).rename(folder / new)
    index = {"metadata": {}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"model_type": "qwen3_5_moe", "text_config": cfg, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    (folder / "config.json").write_text(json.dumps(config))


def check_preset(folder: Path, cfg: dict, preset: str, weight_format: str, prompt_tokens: int, tokens: int) -> dict:
    """One preset: load and generate under the cap; the row of the table."""
    cuda = torch.cuda.is_available()
    cap = PRESETS[preset].vram_gib * GiB - CUDA_CONTEXT_BYTES if preset in PRESETS else None
    if cuda:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total) if cap else 1.0)
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = load_model(folder, preset=preset if cuda else "cpu", weight_format=weight_format)
    load_s = time.perf_counter() - started
    load_peak = torch.cuda.max_memory_allocated() if cuda else 0
    print(model.plan)
    prompt = torch.randint(0, cfg["vocab_size"] - 1, (prompt_tokens,), generator=torch.Generator().manual_seed(1))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = model.generate(prompt, max_new_tokens=tokens, temperature=0)
    run_peak = torch.cuda.max_memory_allocated() if cuda else 0
    row = {"preset": preset, "plan GPU": model.plan.gpu_bytes, "cap": cap or 0, "load peak": load_peak,
           "run peak": run_peak, "load s": load_s, "TTFT s": result.stats["ttft_s"],
           "prefill tok/s": result.stats["prefill_tok_s"], "decode tok/s": result.stats["decode_tok_s"],
           "peak RSS": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    model.release()
    return row


def print_table(rows: list[dict]) -> None:
    def cell(key: str, value) -> str:
        if key in ("plan GPU", "cap", "load peak", "run peak", "peak RSS"):
            return f"{value / GiB:.2f} GiB"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(cell(k, v) for k, v in row.items()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/a3b-35b-fp8"))
    parser.add_argument("--presets", default="8gb,24gb", help="comma-separated presets to check")
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="a tiny model of the same layout (checks the script)")
    args = parser.parse_args()
    cfg = SMALL_TEXT if args.small else REAL_TEXT
    folder = args.dir.with_name(args.dir.name + "-small") if args.small else args.dir
    if not torch.cuda.is_available() and not args.small:
        sys.exit("no CUDA device: the real check needs a GPU (use --small to check the script on a CPU)")
    started = time.perf_counter()
    write_checkpoint(folder, cfg)
    print(f"checkpoint ready in {time.perf_counter() - started:.0f} s: {folder}")
    rows = [check_preset(folder, cfg, preset, args.weight_format, args.prompt_tokens, args.tokens)
            for preset in args.presets.split(",")]
    print_table(rows)
    over = [row["preset"] for row in rows if row["cap"] and max(row["load peak"], row["run peak"]) > row["cap"]]
    if over:
        sys.exit(f"VRAM over the cap in: {', '.join(over)}")


if __name__ == "__main__":
    main()
