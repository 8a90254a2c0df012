"""A3B Model Loader."""
from __future__ import annotations

import torch

from a3b_core.runtime.options import (CHAT_TEMPLATES, DENSE_FORMATS, KV_FORMATS, PRESET_NAMES, WEIGHT_FORMATS,
                                      LoadOptions)

from . import comfy_bridge as bridge
from .comfy_bridge import io
from .model_folders import DEMO_MODEL, loader_choices, mmproj_choices, resolve_mmproj, resolve_model
from .model_handle import A3BModelHandle
from .wires import ModelWire

CATEGORY = "A3B"


def device_choices() -> list[str]:
    """'auto' (ComfyUI's device), each CUDA GPU torch sees, and the CPU."""
    return ["auto", *(f"cuda:{index}" for index in range(torch.cuda.device_count())), "cpu"]


class A3BModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BModelLoader",
            display_name="A3B Model Loader",
            category=CATEGORY,
            description="Loads a Qwen3.5/3.6 or Qwen3-VL model (A3B or dense) from models/LLM with the pack's own "
                        "engine, placed to fit the chosen VRAM preset, and shows the placement plan.",
            inputs=[
                io.Combo.Input("model", options=loader_choices(bridge.llm_roots()), default=DEMO_MODEL,
                               tooltip="A model folder in ComfyUI/models/LLM (config.json, tokenizer.json and "
                                       "*.safetensors, as released), a .gguf model file there (F32/F16/BF16; a "
                                       "split set is listed by its first part and needs all its parts beside it; "
                                       "mmproj files are not listed), or a small built-in demo model: 'a3b-demo' "
                                       "(BF16) or 'a3b-demo-fp8' (the official FP8 layout)."),
                io.Combo.Input("vram_preset", options=list(PRESET_NAMES), default="auto",
                               tooltip="GPU memory the model may use. 'auto' measures the free VRAM (other models "
                                       "are unloaded first); a size keeps within that budget, putting experts in "
                                       "system RAM when needed; 'cpu' runs everything on the CPU."),
                io.Combo.Input("weight_format", options=list(WEIGHT_FORMATS), default="auto",
                               tooltip="How the routed experts kept in system RAM are held. 'auto': int8 (int4 when "
                                       "RAM is short; a quantized GGUF's own blocks); fp8 keeps the official FP8 "
                                       "release's experts as released, gguf a GGUF file's Q4_K/Q8_0/... blocks; "
                                       "int8/int4 trade some accuracy for less memory; bf16/fp32 are exact."),
                io.Combo.Input("kv_cache", options=list(KV_FORMATS), default="auto",
                               tooltip="Format of the attention cache. 'auto': the compute dtype (bf16). int8 halves "
                                       "its memory for long contexts."),
                io.Int.Input("max_context", default=0, min=0, max=262144, step=1024,
                             tooltip="Longest prompt + answer in tokens the cache is sized for. 0 = the engine's "
                                     "default for the chosen preset."),
                io.Boolean.Input("keep_loaded", default=True,
                                 tooltip="On: the model stays in memory between runs (ComfyUI still unloads it when "
                                         "another model needs the memory). Off: freed after every generation."),
                # last, and optional: workflows saved before they existed keep their widget values in place
                io.Combo.Input("device", options=device_choices(), default="auto", optional=True,
                               tooltip="Where the model runs. 'auto': ComfyUI's own device (its --cpu and "
                                       "--cuda-device settings hold); or one of the GPUs torch sees; or the CPU."),
                io.Combo.Input("chat_template", options=list(CHAT_TEMPLATES), default="auto", optional=True,
                               tooltip="How prompts are written for the model. 'auto': the model folder's own chat "
                                       "template (chat_template.jinja or tokenizer_config.json), as fine-tunes edit "
                                       "it, rendered in a sandbox; the built-in Qwen3.5 template when the folder has "
                                       "none. 'built-in': always the built-in one. The plan shows which is in use."),
                io.Combo.Input("dense_format", options=list(DENSE_FORMATS), default="auto", optional=True,
                               tooltip="How the dense matrices (attention and DeltaNet projections, shared experts, "
                                       "lm_head) are held when the CPU computes them (preset 'cpu' or device 'cpu'). "
                                       "'auto': the compute dtype (bf16), exact; for a quantized GGUF, "
                                       "the file's own blocks (Q4_K, Q8_0, ...) as stored. int8 holds them in about half the "
                                       "memory of bf16 (about 1.8 GB less for the 35B), int4 in about a quarter "
                                       "(about 2.6 GB less), at a small (int8) or clear (int4) accuracy cost; routers "
                                       "and embeddings stay bf16. Measured on a 2-core CPU with numba (int8 / int4 "
                                       "experts alike): int8 decodes ~1.5x and int4 ~1.3x as fast as bf16, prefill "
                                       "~1.1-1.2x. Not for dense parts on a GPU."),
                io.Combo.Input("mmproj", options=mmproj_choices(bridge.llm_roots()), default="auto", optional=True,
                               tooltip="The vision tower of a GGUF model: llama.cpp keeps it in a separate "
                                       "mmproj-*.gguf file. 'auto': the mmproj file beside the model (text only if "
                                       "there is none; with several there, pick one here). 'none': text only. Or one "
                                       "of the mmproj files in models/LLM. Model folders (safetensors) hold their "
                                       "own vision tower: leave 'auto'."),
            ],
            outputs=[ModelWire.Output(display_name="model", tooltip="The loaded model, for Image Encode and "
                                                                   "Generate.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model: str, vram_preset: str, weight_format: str, kv_cache: str, max_context: int,
                keep_loaded: bool, device: str = "auto", chat_template: str = "auto",
                dense_format: str = "auto", mmproj: str = "auto") -> io.NodeOutput:
        path = resolve_model(model, bridge.llm_roots())
        options = LoadOptions(preset=vram_preset, weight_format=weight_format, dense_format=dense_format,
                              kv_cache=kv_cache, max_context=max_context or None, device=device,
                              chat_template=chat_template, mmproj=resolve_mmproj(mmproj, bridge.llm_roots()))
        handle = A3BModelHandle(path, options, keep_loaded, loader_node=cls.hidden.unique_id)
        progress = bridge.Progress(1)
        handle.acquire(progress=lambda done, total: progress.set(done, total))
        return io.NodeOutput(handle, ui={"a3b_plan": [handle.plan_summary], "a3b_plan_table": [handle.plan_table]})
