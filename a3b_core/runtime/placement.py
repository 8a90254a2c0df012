"""VRAM presets -> a placement plan: what lives on the GPU and what in RAM, in which format, and how long a context.

The plan comes from config.json and the safetensors headers alone (names, shapes, dtypes): no weight is read.
A preset "Ngb" is N GiB of VRAM for the model. From it we reserve the CUDA context and an activation workspace
(CUDA_CONTEXT_BYTES + GPU_WORKSPACE_BYTES = 1 GiB), then place, in this order: the dense parts (mixers, shared
experts, routers, norms, lm_head) and the cache, which must fit; the vision tower, if it fits; then as many
whole layers of routed experts as fit; and embed_tokens (a row lookup, fine on the CPU) only once everything else
is on the GPU. Dense parts are held in the compute format (bf16, fp16 or fp32); an FP8 checkpoint's dense parts stay
FP8 on the GPU only when the compute format would not leave room for the cache at the full context; on the CPU,
dense_format int8 / int4 holds their matrices quantized (formats/dense.py says which), counted here at that size
(a GPU's dense parts are refused in int8 / int4: torch's weight-only kernels for them are the CPU's), and auto keeps a
GGUF's block-quantized dense matrices in their blocks (unless the compute format is fp32). Routed experts
left over live in RAM and are computed by the CPU; RAM must hold them (weight format auto: int8, or int4 when RAM is
short), whatever else is in RAM, and CPU_WORKSPACE_BYTES. "auto" plans for the free VRAM (torch.cuda.mem_get_info)
and MemAvailable; a plan without a GPU budget (preset cpu, or no accelerator) keeps everything in RAM.

Bytes per format (vectors such as norms and biases, and the DeltaNet conv kernels, are always kept in fp32):
- bf16 / fp16 2 B/weight, fp32 4 B/weight; fp8 1 B/weight plus the checkpoint's block scales (held in fp32), and
  only where the checkpoint stores FP8;
- int8: 1 B/weight + one bf16 scale per output row (counted as one per 128 weights, ~0.51x of bf16);
- int4: 0.5 B/weight + an fp32 scale and minimum per 128 weights (~0.28x of bf16).
KV cache: attention layers (Qwen3.5: its full-attention layers; Qwen3-VL: all) x 2 x KV heads x head_dim per token, in
a float format or int8 with one fp32 scale per token and head; stored in another format than the compute one, plus one
layer's keys and values in the compute format as scratch. Qwen3.5's DeltaNet state: conv history and recurrent state in
fp32, per sequence.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PlacementError
from ..formats.dense import is_quantised_dense
from ..formats.table import (BF16, DENSE_FORMATS, FLOAT_FORMATS, FP8, FP32, GGUF, INT4, INT8, KV_FORMATS,
                            WEIGHT_FORMATS, format_named)
from ..models import family_for
from ..release.config import ModelConfig
from ..release.gguf_file import BlockType
from ..release.safetensors import FP8_DTYPES
from ..release.weights import stays_fp32
from .gguf_source import model_headers
from .options import PRESET_NAMES

MiB, GiB = 1 << 20, 1 << 30
CUDA_CONTEXT_BYTES = 512 * MiB  # driver context, cuBLAS handles, allocator slack
GPU_WORKSPACE_BYTES = 512 * MiB  # activations of a prefill chunk and of one large image in the vision tower
CPU_WORKSPACE_BYTES = 1 * GiB  # CPU activations and one layer's buffers while experts are converted at load


@dataclass(frozen=True)
class Preset:
    vram_gib: int
    max_context: int  # default context
    gpu_experts: bool  # may spare VRAM hold routed experts?


PRESETS = {
    # 8 GB cards: all routed experts in RAM (llama.cpp's --cpu-moe); the spare ~2-3 GiB stays free for the desktop
    # and ComfyUI's other models, since a few of 40 expert layers would speed decoding by under 10%.
    "8gb": Preset(8, 32768, False),
    "12gb": Preset(12, 65536, True),
    "16gb": Preset(16, 65536, True),
    "24gb": Preset(24, 131072, True),
    "48gb": Preset(48, 262144, True),
}
CPU_CONTEXT = 32768
MIN_CONTEXT = 4096  # an automatically chosen context is never halved below this
DENSE_GROUPS = ("lm_head", "mixers", "shared_experts", "routers", "mlp", "norms", "other")

TensorSpec = tuple[tuple[int, ...], "torch.dtype | BlockType"]  # shape, dtype (a GGUF block type for blocks)
Tensors = Mapping[str, TensorSpec]


@dataclass(frozen=True)
class PlanPart:
    name: str
    device: str  # "cuda" | "cpu"
    format: str  # a weight format (formats/table.py); "-" for reserved workspace
    bytes: int


@dataclass(frozen=True)
class Plan:
    preset: str
    gpu_budget: int
    cpu_budget: int
    parts: tuple[PlanPart, ...]
    expert_format_cpu: str  # format of CPU-resident routed experts ("none" for a dense model)
    expert_format_gpu: str  # format of GPU-resident routed experts ("none" for a dense model)
    gpu_expert_layers: tuple[int, ...]  # text layers whose routed experts live on the GPU (whole layers)
    dense_device: str
    dense_format: str  # mixers, shared experts, routers, norms, lm_head
    embed_device: str
    vision_device: str  # "cuda" | "cpu" | "none"
    kv_dtype: str
    max_context: int
    notes: tuple[str, ...]

    def _total(self, device: str) -> int:
        return sum(p.bytes for p in self.parts if p.device == device)

    @property
    def gpu_bytes(self) -> int:
        return self._total("cuda")

    @property
    def cpu_bytes(self) -> int:
        return self._total("cpu")

    @property
    def workspace_bytes(self) -> int:
        """The activation workspace on the dense device: what one prefill chunk may use."""
        return sum(p.bytes for p in self.parts if p.name == ("workspace" if self.dense_device == "cuda"
                                                                 else "cpu_workspace"))

    @property
    def cache_bytes(self) -> int:
        """What the plan holds for generation state: the KV cache and a family's recurrent state (a part named
        "<kind>_state", such as Qwen3.5's deltanet_state)."""
        return sum(p.bytes for p in self.parts if p.name == "kv_cache" or p.name.endswith("_state"))

    @property
    def headroom(self) -> int:
        """VRAM left unused by the plan (0 for a cpu plan)."""
        return self.gpu_budget - self.gpu_bytes

    @property
    def cpu_headroom(self) -> int:
        return self.cpu_budget - self.cpu_bytes

    def summary(self) -> str:
        """One line, e.g. for a node's status text."""
        where = [f"{len(self.gpu_expert_layers)} layers on GPU ({self.expert_format_gpu})"] if self.gpu_expert_layers \
            else []
        where += [f"{'the rest' if where else 'all'} on CPU ({self.expert_format_cpu})"] \
            if self.expert_format_cpu != "none" else []
        experts = f"experts {', '.join(where)}" if where else "no routed experts"
        gpu = f"GPU {format_bytes(self.gpu_bytes)} of {format_bytes(self.gpu_budget)}" if self.gpu_budget else "no GPU"
        return (f"{self.preset}: {gpu}, RAM {format_bytes(self.cpu_bytes)}; dense {self.dense_format} on "
                f"{self.dense_device}, {experts}; KV {self.kv_dtype}, context {self.max_context}")

    def __str__(self) -> str:
        rows = [(p.name, p.device, p.format, format_bytes(p.bytes)) for p in self.parts]
        widths = [max(len(r[i]) for r in rows + [("part", "device", "format", "bytes")]) for i in range(4)]
        line = "{:<%d}  {:<%d}  {:<%d}  {:>%d}" % tuple(widths)
        out = [f"A3B placement plan, preset {self.preset}", line.format("part", "device", "format", "bytes"),
               line.format(*("-" * w for w in widths))]
        out += [line.format(*r) for r in rows]
        if self.gpu_budget:
            out.append(f"GPU total {format_bytes(self.gpu_bytes)} of {format_bytes(self.gpu_budget)} "
                       f"(headroom {format_bytes(self.headroom)})")
        out.append(f"RAM total {format_bytes(self.cpu_bytes)} of {format_bytes(self.cpu_budget)} available "
                   f"(headroom {format_bytes(self.cpu_headroom)})")
        out.append(f"KV cache {self.kv_dtype}, max context {self.max_context} tokens")
        return "\n".join(out + ["notes:"] + [f"  - {n}" for n in self.notes])

    def to_json(self) -> dict:
        return {"preset": self.preset, "gpu_budget": self.gpu_budget, "cpu_budget": self.cpu_budget,
                "gpu_bytes": self.gpu_bytes, "cpu_bytes": self.cpu_bytes, "headroom": self.headroom,
                "cpu_headroom": self.cpu_headroom, "max_context": self.max_context, "kv_dtype": self.kv_dtype,
                "expert_format_cpu": self.expert_format_cpu, "expert_format_gpu": self.expert_format_gpu,
                "gpu_expert_layers": list(self.gpu_expert_layers), "dense_device": self.dense_device,
                "dense_format": self.dense_format, "embed_device": self.embed_device,
                "vision_device": self.vision_device,
                "parts": [{"name": p.name, "device": p.device, "format": p.format, "bytes": p.bytes}
                          for p in self.parts],
                "notes": list(self.notes)}


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def layer_ranges(layers: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> '0-2, 5'."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


# --------------------------------------------------------------------------------------------- the inventory
def _is_scale(name: str) -> bool:
    return name.endswith(("_scale_inv", "_scale"))


def tensor_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype, fmt: str) -> int:
    """Bytes one checkpoint tensor takes once loaded in `fmt` (FP8 scales only count while kept as fp8)."""
    numel = math.prod(shape)
    if _is_scale(name):
        return format_named(fmt).scale_bytes(numel)
    if stays_fp32(name, shape):
        return numel * 4
    return format_named(fmt).tensor_bytes(numel, dtype)


class Inventory:
    """The checkpoint's tensors grouped the way the planner places them, with their bytes per format."""

    def __init__(self, tensors: Tensors, classify: Callable[[str], tuple[str, int | None]]):
        """`classify`: the family's tensor name -> (group, text layer or None)."""
        self.groups: dict[str, dict[str, TensorSpec]] = {}
        experts: dict[int, dict[str, TensorSpec]] = {}
        for name, (shape, dtype) in tensors.items():
            group, layer = classify(name)
            target = experts.setdefault(layer, {}) if group == "experts" else self.groups.setdefault(group, {})
            target[name] = (tuple(shape), dtype)
        self.expert_layers = dict(sorted(experts.items()))
        self.experts_fp8 = any(d in FP8_DTYPES for layer in experts.values() for _, d in layer.values())
        expert_types = {d for layer in experts.values() for _, d in layer.values()}
        # the block types of a quantized GGUF's experts, when every expert tensor is in one
        self.expert_blocks = sorted({name for d in expert_types for name in str(d).split("+")}) \
            if expert_types and all(isinstance(d, BlockType) for d in expert_types) else []
        self.dense_fp8 = any(d in FP8_DTYPES for g in DENSE_GROUPS for _, d in self.groups.get(g, {}).values())
        # the block types of a GGUF's dense matrices that dense.py would quantize, kept in their blocks on the CPU
        self.dense_blocks = sorted({str(d) for g in DENSE_GROUPS for name, (shape, d) in self.groups.get(g, {}).items()
                                    if isinstance(d, BlockType) and is_quantised_dense(name, shape)})
        self._layer_bytes: dict[tuple[int, str], int] = {}

    def bytes(self, group: str, fmt: str) -> int:
        return _bytes(self.groups.get(group, {}), fmt)

    def layer_bytes(self, layer: int, fmt: str) -> int:
        """The routed experts of one text layer in `fmt` (memoized: plans are retried with other budgets)."""
        if (layer, fmt) not in self._layer_bytes:
            self._layer_bytes[layer, fmt] = _bytes(self.expert_layers[layer], fmt)
        return self._layer_bytes[layer, fmt]

    def label(self, group: str, fmt: str) -> str:
        """The format a group is reported in: vectors-only groups are fp32; fp8 only if something is fp8."""
        tensors = self.groups.get(group, {}).values()
        if all(len(shape) <= 1 for shape, _ in tensors):
            return FP32
        return BF16 if format_named(fmt).as_released and not any(d in FP8_DTYPES for _, d in tensors) else fmt


def _bytes(tensors: Mapping[str, TensorSpec], fmt: str) -> int:
    return sum(tensor_bytes(name, shape, dtype, fmt) for name, (shape, dtype) in tensors.items())


# --------------------------------------------------------------------------------------------- planning
class _NoFit(Exception):
    """A budget is too small; `memory` is "VRAM" or "RAM"."""

    def __init__(self, memory: str, need: int, budget: int, detail: str):
        have = f"the budget is {format_bytes(budget)}" if memory == "VRAM" else f"{format_bytes(budget)} is available"
        super().__init__(f"{detail} need {format_bytes(need)} of {memory}, but {have}")
        self.memory, self.need, self.budget = memory, need, budget


class _Planner:
    def __init__(self, config: ModelConfig, inv: Inventory, weight_format: str, kv_cache: str,
                 max_context: int | None, compute_format: str = BF16, dense_format: str = "auto"):
        self.config, self.inv, self.family = config, inv, family_for(config.model_type)
        self.weight_format, self.kv_cache, self.max_context = weight_format, kv_cache, max_context
        self.dense_format = dense_format
        self.compute_format = compute_format
        self.layers = tuple(inv.expert_layers)
        self.gpu_expert_format = FP8 if inv.experts_fp8 else compute_format
        self.tied = "lm_head" not in inv.groups and config.text.tie_word_embeddings

    def context_for(self, vram: int) -> int:
        """The context to plan for: the user's, else that of the largest preset within `vram` (0: a cpu plan)."""
        fitting = [p.max_context for p in PRESETS.values() if p.vram_gib * GiB <= vram]
        default = CPU_CONTEXT if not vram else max(fitting, default=PRESETS["8gb"].max_context)
        return min(self.max_context or default, self.config.text.max_position_embeddings)

    def _cache_choices(self, context: int, gpu: bool) -> Iterator[tuple[int, str]]:
        """(context, kv dtype) pairs to try, best first: bf16, then int8, then (if not user-set) shorter contexts."""
        kvs = [self.kv_cache] if self.kv_cache != "auto" else [self.compute_format, INT8] if gpu \
            else [self.compute_format]
        while True:
            yield from ((context, kv) for kv in kvs)
            if self.max_context is not None or context // 2 < MIN_CONTEXT:
                return
            context //= 2

    def but(self, **changes: object) -> "_Planner":
        """The same planner with some options changed."""
        options = {"weight_format": self.weight_format, "kv_cache": self.kv_cache, "max_context": self.max_context,
                   "compute_format": self.compute_format, "dense_format": self.dense_format}
        return _Planner(self.config, self.inv, **{**options, **changes})

    def plan(self, preset: str, gpu_budget: int, cpu_budget: int, gpu_experts: bool, notes: list[str]) -> Plan:
        """gpu_budget 0 plans for the CPU alone. Raises _NoFit when VRAM or RAM is too small."""
        inv, gpu, notes, compute = self.inv, gpu_budget > 0, list(notes), self.compute_format
        dense_dev = "cuda" if gpu else "cpu"
        dense_fmt = self._gpu_dense_format(gpu_budget) if gpu else self._cpu_dense_format()
        parts = self._dense_parts(dense_dev, dense_fmt)
        notes.append(f"dense parts (mixers, shared experts, routers, norms, lm_head) on the "
                     f"{'GPU' if gpu else 'CPU'} in {dense_fmt}"
                     + (f" as the checkpoint stores them ({compute} where it is not fp8), dequantized per use: "
                        f"{compute} would not leave room for the cache" if dense_fmt == FP8 else "")
                     + (f": their matrices kept in the GGUF file's blocks ({', '.join(self.inv.dense_blocks)}) and "
                        f"computed from them (routers, gates, embeddings and norms in {compute})"
                        if dense_fmt == GGUF else "")
                     + (f" (weight-only, as asked; routers, gates and embeddings stay {compute})"
                        if format_named(dense_fmt).converted else ""))
        embed = inv.bytes("embed_tokens", compute)
        if gpu:
            notes.append(f"reserved on the GPU: {format_bytes(CUDA_CONTEXT_BYTES)} CUDA context and "
                         f"{format_bytes(GPU_WORKSPACE_BYTES)} activation workspace")
        cache, max_context = self._cache_parts(parts, dense_dev, gpu_budget, self.context_for(gpu_budget), notes)
        parts += cache

        def free_vram() -> int:
            return gpu_budget - sum(p.bytes for p in parts if p.device == "cuda")

        vision_dev = "none"
        if "vision" in inv.groups:
            vision = inv.bytes("vision", compute)
            vision_dev = "cuda" if gpu and vision <= free_vram() else "cpu"
            parts.append(PlanPart("vision", vision_dev, compute, vision))
            if gpu and vision_dev == "cpu":
                notes.append("vision tower in RAM, computed by the CPU: it did not fit in VRAM after the dense parts "
                             "and the cache")

        gpu_layers: list[int] = []
        room = free_vram()
        for layer in self.layers if gpu and gpu_experts else ():
            size = self.inv.layer_bytes(layer, self.gpu_expert_format)
            if size > room:
                break
            gpu_layers.append(layer)
            room -= size
        if gpu_layers:
            parts.append(PlanPart("routed_experts_gpu", "cuda", self.gpu_expert_format,
                                  sum(self.inv.layer_bytes(layer, self.gpu_expert_format) for layer in gpu_layers)))
        cpu_layers = [layer for layer in self.layers if layer not in gpu_layers]

        embed_dev = dense_dev
        if "embed_tokens" in inv.groups and not self.tied:
            # a lookup of one row per token: on the GPU only once everything else is there and it still fits
            embed_dev = "cuda" if gpu and not cpu_layers and embed <= free_vram() else "cpu"
            parts.insert(0, PlanPart("embed_tokens", embed_dev, compute, embed))
            if gpu and embed_dev == "cpu":
                notes.append("embed_tokens in RAM: one row is looked up per token, so it needs no GPU")
        parts.append(PlanPart("cpu_workspace", "cpu", "-", CPU_WORKSPACE_BYTES))

        cpu_format = self._cpu_expert_format(parts, cpu_layers, cpu_budget, notes) if cpu_layers else "none"
        if cpu_layers:
            parts.append(PlanPart("routed_experts_cpu", "cpu", cpu_format,
                                  sum(self.inv.layer_bytes(layer, cpu_format) for layer in cpu_layers)))
        if self.layers:
            notes.append(self._expert_note(gpu, gpu_experts, gpu_layers, cpu_layers, cpu_format))
        if "mtp" in inv.groups:
            notes.append(f"mtp.* ({len(inv.groups['mtp'])} tensors, {format_bytes(inv.bytes('mtp', BF16))}) is not "
                         "loaded: multi-token prediction is not used")
        return Plan(preset=preset, gpu_budget=gpu_budget, cpu_budget=cpu_budget,
                    parts=tuple(sorted(parts, key=lambda p: p.device != "cuda")), expert_format_cpu=cpu_format,
                    expert_format_gpu=self.gpu_expert_format if self.layers else "none",
                    gpu_expert_layers=tuple(gpu_layers), dense_device=dense_dev, dense_format=dense_fmt,
                    embed_device=embed_dev, vision_device=vision_dev, kv_dtype=cache[0].format,
                    max_context=max_context, notes=tuple(notes))

    def _dense_parts(self, device: str, fmt: str) -> list[PlanPart]:
        """The dense groups in `fmt`, a tied embedding with them (it is lm_head), and on a GPU its fixed reserves."""
        parts = [self._dense_part(g, device, fmt) for g in DENSE_GROUPS if g in self.inv.groups]
        if self.tied:  # lm_head is embed_tokens: one tensor, where lm_head goes
            parts.insert(0, PlanPart("embed_tokens+lm_head (tied)", device, self.compute_format,
                                     self.inv.bytes("embed_tokens", self.compute_format)))
        if device == "cuda":
            parts += [PlanPart("cuda_context", "cuda", "-", CUDA_CONTEXT_BYTES),
                      PlanPart("workspace", "cuda", "-", GPU_WORKSPACE_BYTES)]
        return parts

    def _dense_part(self, group: str, device: str, fmt: str) -> PlanPart:
        """One dense group in `fmt`; in int8 / int4 only the matrices is_quantised_dense names are, in gguf those of
        them the file stores in blocks; the rest stay in the compute format."""
        inv = self.inv
        if not (format_named(fmt).converted or fmt == GGUF):
            return PlanPart(group, device, inv.label(group, fmt), inv.bytes(group, fmt))
        tensors = inv.groups[group]
        quantized = {name for name, (shape, dtype) in tensors.items() if is_quantised_dense(name, shape)
                     and (fmt != GGUF or isinstance(dtype, BlockType))}
        size = sum(tensor_bytes(name, shape, dtype, fmt if name in quantized else self.compute_format)
                   for name, (shape, dtype) in tensors.items())
        return PlanPart(group, device, fmt if quantized else inv.label(group, self.compute_format), size)

    def _cpu_dense_format(self) -> str:
        """dense_format as asked; auto: the compute format, or a GGUF's blocks where the file stores its dense
        matrices in blocks and the compute format is not fp32 (the reference mode keeps every weight exact)."""
        if self.dense_format != "auto":
            return self.dense_format
        return GGUF if self.inv.dense_blocks and self.compute_format != FP32 else self.compute_format

    def _gpu_dense_format(self, gpu_budget: int) -> str:
        """The compute format, unless the checkpoint stores dense parts in FP8 and, in the compute format, they would
        not leave room for the first cache choice at the full context (and the vision tower): then FP8 as stored,
        dequantized per use, which costs time on every token."""
        if not self.inv.dense_fp8:
            return self.compute_format
        context, kv = next(self._cache_choices(self.context_for(gpu_budget), True))
        need = (sum(p.bytes for p in self._dense_parts("cuda", self.compute_format))
                + self.family.kv_bytes(self.config, context, kv, self.compute_format)
                + self.family.state_bytes(self.config)
                + self.inv.bytes("vision", self.compute_format))
        return self.compute_format if need <= gpu_budget else FP8

    def _cache_parts(self, parts: list[PlanPart], device: str, gpu_budget: int, context: int,
                     notes: list[str]) -> tuple[list[PlanPart], int]:
        """The KV cache part, the family's recurrent state part if it has one, and the context: on the GPU, the first
        choice that fits."""
        state = self.family.state_bytes(self.config)
        choices = list(self._cache_choices(context, device == "cuda"))
        if device == "cuda":
            fixed = sum(p.bytes for p in parts if p.device == "cuda") + state
            fitting = [(c, kv) for c, kv in choices
                       if fixed + self.family.kv_bytes(self.config, c, kv, self.compute_format) <= gpu_budget]
            if not fitting:
                c, kv = choices[-1]
                raise _NoFit("VRAM", fixed + self.family.kv_bytes(self.config, c, kv, self.compute_format), gpu_budget,
                             f"the dense parts, the CUDA reserve and the cache for {c} tokens in {kv}")
        else:
            fitting = choices
        tokens, kv = fitting[0]
        if (tokens, kv) != choices[0]:
            notes.append(f"the cache for {context} tokens in {choices[0][1]} does not fit in VRAM: using "
                         f"{tokens} tokens in {kv}")
        name = self.family.state_part
        notes.append(f"KV cache in {kv} for {tokens} tokens (one sequence)"
                     + (f"; the {name.replace('_', ' ')} is {format_bytes(state)} at any length" if name else ""))
        parts = [PlanPart("kv_cache", device, kv, self.family.kv_bytes(self.config, tokens, kv, self.compute_format))]
        return parts + ([PlanPart(name, device, FP32, state)] if name else []), tokens

    def _cpu_expert_format(self, parts: list[PlanPart], cpu_layers: list[int], cpu_budget: int,
                           notes: list[str]) -> str:
        """The format of the CPU-resident experts (auto: int8, or int4 when RAM is short); _NoFit if RAM is short."""
        rest = sum(p.bytes for p in parts if p.device == "cpu")

        def need(fmt: str) -> int:
            return rest + sum(self.inv.layer_bytes(layer, fmt) for layer in cpu_layers)

        fmt = self.weight_format
        if fmt != "auto":
            notes.append(f"CPU experts in {fmt}, as asked")
        elif self.compute_format == FP32:
            fmt = FP32
            notes.append("CPU experts in fp32: compute_dtype float32 keeps every weight exact (the reference mode)")
        elif self.inv.expert_blocks:
            fmt = GGUF
            notes.append(f"CPU experts kept in the GGUF file's blocks ({', '.join(self.inv.expert_blocks)}) and "
                         "computed from them: no conversion, no accuracy lost")
        elif need(INT8) <= cpu_budget:
            fmt = INT8
            notes.append("CPU experts in int8 (weight-only, one scale per row, ~0.5x of bf16): faster than bf16 on the "
                         "CPU at a small accuracy cost" + ("; the fp8 experts are converted once at load, since "
                                                           "dequantizing fp8 per use is slow on CPUs"
                                                           if self.inv.experts_fp8 else ""))
        else:
            fmt = INT4
            notes.append(f"CPU experts in int4 (groups of 128, ~0.28x of bf16) because int8 would need "
                         f"{format_bytes(need(INT8))} of RAM and {format_bytes(cpu_budget)} is available; int4 "
                         "costs some accuracy")
        if need(fmt) > cpu_budget:
            raise _NoFit("RAM", need(fmt), cpu_budget,
                         f"the parts in RAM ({len(cpu_layers)} layers of routed experts in {fmt} and the rest)")
        return fmt

    def _expert_note(self, gpu: bool, gpu_experts: bool, gpu_layers: list[int], cpu_layers: list[int],
                     cpu_format: str) -> str:
        total = len(self.layers)
        if not cpu_layers:
            return f"routed experts: all {total} layers on the GPU in {self.gpu_expert_format}"
        where = (f"layers {layer_ranges(gpu_layers)} on the GPU in {self.gpu_expert_format}, the other "
                 f"{len(cpu_layers)}" if gpu_layers else f"all {total} layers")
        note = f"routed experts: {where} in RAM, computed by the CPU in {cpu_format}"
        if gpu and not gpu_experts:
            note += " (this preset keeps them all off the GPU, like llama.cpp's --cpu-moe; spare VRAM stays free)"
        elif gpu:
            one_more = self.inv.layer_bytes(cpu_layers[0], self.gpu_expert_format)
            note += f" (one more layer on the GPU needs {format_bytes(one_more)})"
        if cpu_format == FP8:
            note += "; fp8 is dequantized per use, which is slow on most CPUs"
        return note


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (free RAM including reclaimable caches), else the OS's free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_choice(what: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlacementError(f"{what} {value!r} is not supported; use one of: {', '.join(choices)}.")


def make_plan(config: ModelConfig, tensors: Tensors, preset: str = "auto", weight_format: str = "auto",
              kv_cache: str = "auto", max_context: int | None = None, gpu_free: int | None = None,
              cpu_free: int | None = None, has_cuda: bool | None = None, compute_format: str = BF16,
              dense_format: str = "auto") -> Plan:
    """Plans where every part of the model lives. gpu_free / cpu_free (bytes) and has_cuda default to this machine's
    (torch.cuda.mem_get_info, /proc/meminfo MemAvailable, torch.cuda.is_available)."""
    _check_choice("preset", preset, PRESET_NAMES)
    _check_choice("weight_format", weight_format, WEIGHT_FORMATS)
    _check_choice("dense_format", dense_format, DENSE_FORMATS)
    _check_choice("kv_cache", kv_cache, KV_FORMATS)
    _check_choice("compute format", compute_format, tuple(FLOAT_FORMATS))
    limit = config.text.max_position_embeddings
    if max_context is not None and not (isinstance(max_context, int) and 1 <= max_context <= limit):
        raise PlacementError(f"max_context {max_context!r} is out of range: expected 1 to {limit} (the model's "
                             "max_position_embeddings), or leave it unset for the preset's default.")
    inv = Inventory(tensors, family_for(config.model_type).classify)
    if weight_format == GGUF and not inv.expert_blocks:
        raise PlacementError("weight_format gguf keeps a GGUF file's block-quantized experts (Q4_K, Q8_0, ...), but "
                             "this checkpoint does not store its experts so; use int8, int4 or bf16 (or auto).")
    if weight_format == FP8 and inv.expert_layers and not inv.experts_fp8:
        raise PlacementError("weight_format fp8 keeps the checkpoint's FP8 experts, but this checkpoint stores "
                             "them unquantized; use int8, int4 or bf16 (or auto), or load the model's FP8 release.")
    planner = _Planner(config, inv, weight_format, kv_cache, max_context, compute_format, dense_format)
    has_cuda = torch.cuda.is_available() if has_cuda is None else has_cuda
    if dense_format != "auto" and preset != "cpu" and has_cuda:
        raise PlacementError(f"dense_format {dense_format!r} is for dense parts computed by the CPU (torch's "
                             f"weight-only {dense_format} kernels are CPU kernels), but preset {preset} on a CUDA "
                             "device puts the dense parts on the GPU. Leave dense_format auto there (the compute "
                             "dtype, or FP8 as released when VRAM is short), or pick preset cpu (or device cpu) to "
                             f"compute everything on the CPU with {dense_format} dense matrices.")
    cpu_budget = available_ram() if cpu_free is None else cpu_free
    notes: list[str] = []
    if preset == "cpu" or not has_cuda:
        if preset != "cpu":
            notes.append(f"no CUDA device: preset {preset} is planned as cpu (everything in RAM)")
        name, gpu_budget, gpu_experts = "cpu", 0, False
    elif preset == "auto":
        if gpu_free is None and not torch.cuda.is_available():
            raise PlacementError("preset auto with has_cuda=True on a machine without CUDA needs gpu_free (the free "
                                 "VRAM to plan for, in bytes).")
        name, gpu_experts = "auto", True
        gpu_budget = torch.cuda.mem_get_info()[0] if gpu_free is None else gpu_free
        notes.append(f"auto: {format_bytes(gpu_budget)} of VRAM free, {format_bytes(cpu_budget)} of RAM available")
    else:
        name, gpu_budget, gpu_experts = preset, PRESETS[preset].vram_gib * GiB, PRESETS[preset].gpu_experts
        free = gpu_free if gpu_free is not None else torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
        if free is not None and free < gpu_budget:
            notes.append(f"warning: only {format_bytes(free)} of VRAM is free but preset {preset} plans for "
                         f"{format_bytes(gpu_budget)}; free VRAM (unload other models) or pick a smaller preset")
    try:
        return planner.plan(name, gpu_budget, cpu_budget, gpu_experts, notes)
    except _NoFit as short:
        where = f"preset {preset}" + (" (planned as cpu: no CUDA device)" if name != preset else "")
        tips = _fixes(planner, short, name, gpu_budget, cpu_budget, gpu_experts, has_cuda)
        raise PlacementError(f"{where}: {short}. To fix: {'; '.join(tips)}.") from None


def _fixes(planner: _Planner, short: _NoFit, preset: str, gpu_budget: int, cpu_budget: int, gpu_experts: bool,
           has_cuda: bool) -> list[str]:
    """What would fit instead of a budget that is too small: the smallest preset, a context, a format."""

    def fits(vram: int, experts_on_gpu: bool = gpu_experts, **changes) -> bool:
        try:
            planner.but(**changes).plan(preset, vram, cpu_budget, experts_on_gpu, [])
        except _NoFit:
            return False
        return True

    tips = []
    if has_cuda:
        bigger = [name for name, p in PRESETS.items()
                  if p.vram_gib * GiB > gpu_budget and fits(p.vram_gib * GiB, p.gpu_experts)]
        tips += [f"the smallest preset that fits is {bigger[0]}"] if bigger else []
    if short.memory == "VRAM":
        if planner.max_context is not None:
            powers = (1 << k for k in range(planner.max_context.bit_length() - 1, 9, -1))
            shorter = next((c for c in powers if c < planner.max_context and fits(gpu_budget, max_context=c)), None)
            tips += [f"max_context {shorter} fits"] if shorter else []
        if planner.kv_cache != INT8 and fits(gpu_budget, kv_cache=INT8):
            tips.append("kv_cache int8 fits")
        tips.append("preset cpu runs everything from RAM" if fits(0, False)
                    else "preset cpu does not fit in RAM either")
    else:
        if planner.weight_format not in ("auto", INT4) and fits(gpu_budget, weight_format=INT4):
            tips.append("weight_format int4 fits")
        tips.append("free RAM by closing other programs")
    return tips


def plan_for_folder(folder: str | Path, preset: str = "auto", mmproj: str | Path = "auto", **kw) -> Plan:
    """Plans a model folder from its config.json and safetensors headers (a .gguf file from its header, and its
    mmproj's as load_model finds it); no tensor data is read."""
    config, ckpt = model_headers(Path(folder), mmproj)
    return make_plan(config, {name: (info.shape, info.dtype) for name, info in ckpt.infos.items()}, preset, **kw)
