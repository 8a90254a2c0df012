"""One measurement of one system, in its own process (so peak RSS is that system's alone).

    python bench/worker.py ours --model DIR --dtype bfloat16 --format int4 --prefill 512 --decode 128
    python bench/worker.py ours --model DIR --dtype bfloat16 --format int8 --dense-format int8
    python bench/worker.py ours --model DIR --dtype bfloat16 --lora-rank 16
    python bench/worker.py transformers --model DIR --dtype float32 --prefill 512 --decode 128
    python bench/worker.py image-ttft [--model DIR]
    python bench/worker.py video-ttft [--model DIR]
    python bench/worker.py profile --model DIR --dtype bfloat16 --format auto --decode 16
    python bench/worker.py bandwidth

Prints one line `RESULT {json}` (load_s, prefill_tok_s, ttft_s, decode_tok_s, weight_bytes_per_token,
peak_rss_bytes; active_params for `ours`; bandwidth_bytes_s for `bandwidth`); `profile` prints torch.profiler's tables instead.
Prefill: one greedy call on a `--prefill`-token prompt, timed to its first token. Decode: a 1-token prompt and
`--decode`+1 new tokens, so exactly `--decode` single-token forward passes are timed, as llama-bench's tg test does
from an empty context. Each system is warmed up first (a 16-token prompt, 4 new tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: a3b_core

from bench.roofline import active_params, measure_bandwidth, torch_bytes_per_token  # noqa: E402

IMAGE_TEXT_TOKENS = 32
VIDEO_FRAMES = 16


def peak_rss_bytes() -> int:
    """The process's peak resident set (VmHWM) so far."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def prompt_ids(length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A fixed random prompt that avoids the control ids 0-2 (unk, bos, eos)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator)


def report(values: dict) -> None:
    print("RESULT " + json.dumps(values | {"peak_rss_bytes": peak_rss_bytes()}), flush=True)


# ------------------------------------------------------------------------------------------------- our engine
def load_ours(args):
    from a3b_core import load_model

    loras = [(bench_adapter(args.model, args.lora_rank), 1.0)] if args.lora_rank else []
    started = time.perf_counter()
    model = load_model(args.model, preset="cpu", compute_dtype=args.dtype, weight_format=args.format,
                       dense_format=args.dense_format, loras=loras)
    return model, time.perf_counter() - started


# every projection PEFT's target_modules="all-linear" adapts in the bench model (its router is no nn.Linear)
ADAPTED = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "linear_attn": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
           "mlp": ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                   "shared_expert_gate")}


def bench_adapter(model_dir: Path, rank: int) -> Path:
    """A rank-`rank` LoRA adapter in PEFT's format on every projection of the bench model (seeded factors), written
    once beside the checkpoint; each module's shape is read from the checkpoint's headers."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = model_dir.parent / f"{model_dir.name}-lora{rank}"
    if (folder / "adapter_config.json").is_file():
        return folder
    generator = torch.Generator().manual_seed(rank)
    factors, targets = {}, set()
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                module = name.removesuffix(".weight")
                mixer, _, leaf = module.partition(".layers.")[2].partition(".")[2].partition(".")
                if leaf not in ADAPTED.get(mixer, ()):
                    continue
                out, inp = f.get_slice(name).get_shape()
                factors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) \
                    / inp ** 0.5
                factors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, rank, generator=generator) \
                    * 0.02
                targets.add(leaf.rpartition(".")[2])
    staging = folder.with_name(folder.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    save_file(factors, staging / "adapter_model.safetensors")
    (staging / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                             "target_modules": sorted(targets)}))
    staging.rename(folder)
    return folder


def greedy(model, ids: torch.Tensor, new_tokens: int) -> dict:
    result = model.generate(ids, max_new_tokens=new_tokens, temperature=0)
    if result.stats["new_tokens"] != new_tokens:
        raise RuntimeError(f"greedy decoding stopped after {result.stats['new_tokens']} of {new_tokens} tokens "
                           f"({result.stop_reason}); the prompt seed must avoid the end token")
    return result.stats


def run_ours(args) -> None:
    model, load_s = load_ours(args)
    cfg = model.config.text
    prompt = prompt_ids(args.prefill, cfg.vocab_size)
    greedy(model, prompt[:16], 4)  # warm-up: first-call allocations and kernel selection
    prefill = greedy(model, prompt, 1)
    decode = greedy(model, prompt[:1], args.decode + 1)
    report(dict(load_s=load_s, prefill_tok_s=prefill["prefill_tok_s"], ttft_s=prefill["ttft_s"],
                decode_tok_s=decode["decode_tok_s"],
                weight_bytes_per_token=torch_bytes_per_token(model.text, cfg.num_experts_per_tok, cfg.num_experts,
                                                             cfg.vocab_size),
                active_params=active_params(model.family.text_model, cfg)))


def run_profile(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    model, _ = load_ours(args)
    prompt = prompt_ids(16, model.config.text.vocab_size)
    greedy(model, prompt, 4)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        greedy(model, prompt[:1], args.decode + 1)
    print(f"our engine, compute {args.dtype}, experts {args.format}, dense {args.dense_format}: {args.decode} decode "
          "steps (+1 prefill token)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print("by input shape:")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.top))


def load_vision_model(args):
    """`--model` (a vision-language model folder), else the embedded demo model, with every weight exact."""
    from a3b_core import load_model

    return load_model(args.model or "a3b-demo", preset="cpu", compute_dtype=args.dtype)


def run_image_ttft(args) -> None:
    """Time to first token for one 384x384 image and 32 text tokens, image encoding included (what a ComfyUI caption
    run waits for)."""
    from PIL import Image, ImageDraw

    model = load_vision_model(args)
    image = Image.new("RGB", (384, 384), (20, 60, 230))
    ImageDraw.Draw(image).ellipse((100, 100, 260, 260), fill=(220, 20, 20))
    seconds, text_tokens, image_tokens = first_token_seconds(model, lambda: model.encode_images([image]))
    report(dict(image_ttft_s=seconds, text_tokens=text_tokens, image_tokens=image_tokens))


def run_video_ttft(args) -> None:
    """Time to first token for a 16-frame 384x384 clip (2 s at 8 frames per second, all 16 frames sampled: 8 frame
    groups, of 36 tokens on the demo model's 32-pixel patches, 144 on 16-pixel ones) and 32 text tokens, video
    encoding included."""
    model = load_vision_model(args)
    y, x = torch.meshgrid(torch.arange(384), torch.arange(384), indexing="ij")
    frames = torch.full((VIDEO_FRAMES, 384, 384, 3), 230, dtype=torch.uint8)
    for index in range(VIDEO_FRAMES):  # a red disc crossing the frame
        frames[index][(x - 60 - 16 * index) ** 2 + (y - 192) ** 2 <= 50 ** 2] = torch.tensor([220, 20, 20],
                                                                                            dtype=torch.uint8)
    rate = VIDEO_FRAMES / 2
    seconds, text_tokens, video_tokens = first_token_seconds(
        model, lambda: model.encode_video(frames, frame_rate=rate, fps=rate, max_frames=VIDEO_FRAMES))
    report(dict(video_ttft_s=seconds, text_tokens=text_tokens, video_tokens=video_tokens, frames=VIDEO_FRAMES))


def first_token_seconds(model, encode) -> tuple[float, int, int]:
    """Seconds from encoding (`encode()`: images or a clip) to the first token of a prompt of IMAGE_TEXT_TOKENS text
    tokens around them, after one warm-up run; and the prompt's text and vision token counts."""
    media = encode()
    words = ["Describe", "the", "image."]
    while True:  # the template's tokens (a video's timestamps among them) plus the user text: IMAGE_TEXT_TOKENS
        prompt = model.build_prompt(user=" ".join(words), images=media)
        text_tokens = len(prompt.input_ids) - sum(media.token_counts)
        if text_tokens >= IMAGE_TEXT_TOKENS:
            break
        words.append("please")
    model.generate(prompt, max_new_tokens=1, temperature=0)  # warm-up
    started = time.perf_counter()
    prompt = model.build_prompt(user=" ".join(words), images=encode())
    model.generate(prompt, max_new_tokens=1, temperature=0)
    return time.perf_counter() - started, text_tokens, sum(prompt.images.token_counts)


# ------------------------------------------------------------------------------------------------- transformers
class FirstCallClock:
    """A logits processor that notes when generate() first asks for logits processing: the end of the prefill."""

    def __init__(self):
        self.first: float | None = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def hf_greedy(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of one greedy generate() with the KV cache."""
    from transformers import LogitsProcessorList

    clock = FirstCallClock()
    started = time.perf_counter()
    out = model.generate(ids[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    finished = time.perf_counter()
    if out.shape[1] - ids.numel() != new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.numel()} of {new_tokens} tokens")
    return clock.first - started, finished - clock.first


def run_transformers(args) -> None:
    from transformers import Qwen3_5MoeForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    started = time.perf_counter()
    model = Qwen3_5MoeForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="eager").eval()
    load_s = time.perf_counter() - started
    cfg = model.config
    prompt = prompt_ids(args.prefill, cfg.vocab_size)
    with torch.inference_mode():
        hf_greedy(model, prompt[:16], 4)
        ttft_s, _ = hf_greedy(model, prompt, 1)
        _, decode_s = hf_greedy(model, prompt[:1], args.decode + 1)
    report(dict(load_s=load_s, prefill_tok_s=args.prefill / ttft_s, ttft_s=ttft_s,
                decode_tok_s=args.decode / decode_s,
                weight_bytes_per_token=torch_bytes_per_token(model, cfg.num_experts_per_tok, cfg.num_experts,
                                                             cfg.vocab_size)))


def run_bandwidth(args) -> None:
    report(dict(bandwidth_bytes_s=measure_bandwidth(args.threads)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("system", choices=["ours", "transformers", "image-ttft", "video-ttft", "profile",
                                           "bandwidth"])
    parser.add_argument("--model", type=Path, help="the model folder (image-ttft, video-ttft: default the demo model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--format", default="auto", help="our routed-expert format: auto|fp32|bf16|fp8|int8|int4")
    parser.add_argument("--dense-format", default="auto", help="our dense matrices' format: auto|int8|int4")
    parser.add_argument("--lora-rank", type=int, default=0, help="ours: a LoRA of this rank on every projection")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="profile: rows per table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"ours": run_ours, "transformers": run_transformers, "image-ttft": run_image_ttft,
     "video-ttft": run_video_ttft, "profile": run_profile, "bandwidth": run_bandwidth}[args.system](args)


if __name__ == "__main__":
    main()
