"""LoRA adapters on a loaded model: each adapted weight an adapter names found in the model and checked against its
shape, then its side path (formats/lora.py) attached to the module that computes that weight, and every change undone
when the adapters change, so the base weights are never touched.

Where a side path goes:
- a Linear in any format (and a vision-tower Linear): the module's side path, which a forward hook adds to its
  output (formats/lora.attach_side_paths);
- a projection fused with its neighbours into one product (kernels/cpu_linear.FusedLinear): a side path on that part
  of the fused product's output;
- a layer's routed experts (PEFT's target_parameters on gate_up_proj / down_proj): the store is wrapped
  (AdaptedExperts), so each chosen expert's products take their side paths;
- the embedding table (PEFT's lora_embedding_A/B): a side path of the looked-up rows;
- whole modules an adapter replaces (modules_to_save; the embedding weights PEFT saves beside a LoRA on them): a new
  module in the compute dtype takes the place of lm_head or embed_tokens.
A Qwen3.5 layer's fused decoding steps on the CPU (a MoE block's or a decoder layer's whole step in one numba call,
runtime/step_kernels.py) are built again with the side paths of the projections they compute; an adapter on the
routed experts leaves that layer to the separate kernels.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import AdapterError
from ..formats.lora import AdaptedExperts, EmbeddingLowRank, ExpertLowRank, LowRank, attach_side_paths
from ..models.checkpoint_layout import TEXT_PREFIXES
from ..release.adapters import Adapter, Factors, adapter_files, read_adapter
from .step_kernels import refit_step_kernels

LoraRequest = Sequence[tuple[str | os.PathLike, float]]  # (adapter folder or .safetensors file, strength)
KEPT_ADAPTERS = 8  # adapters kept once read (a few MB to a few hundred each)
REPLACEABLE = ("lm_head", "embed_tokens")  # the modules an adapter may replace whole (modules_to_save)
Pair = tuple[torch.Tensor, torch.Tensor]  # (a, b with the scale and strength in it)


@dataclass
class SidePaths:
    """What a set of adapters attaches, gathered over the adapters: factor pairs by the module that computes them
    (a fused product: by part index), by expert store and stack, for the embedding table; replacement modules by
    name; and the names of the text model's adapted modules, whose layers' fused steps are built again."""
    linear: dict[nn.Module, list[Pair]] = field(default_factory=dict)
    fused: dict[nn.Module, dict[int, list[Pair]]] = field(default_factory=dict)
    experts: dict[tuple[str, nn.Module], dict[str, list[Pair]]] = field(default_factory=dict)
    embedding: dict[nn.Module, list[Pair]] = field(default_factory=dict)
    replaced: dict[str, nn.Module] = field(default_factory=dict)
    adapted: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Target:
    """Where a weight an adapter names is computed: a module of one tree, and its part of a fused product."""
    tree: str
    name: str  # the module's name in its tree (a fused part: the projection's own name)
    module: nn.Module
    part: int | None = None


class ModelAdapters:
    """The adapters on one loaded model (`text`, `vision` trees): `set` replaces them, `active` lists them."""

    def __init__(self, text: nn.Module, vision: nn.Module | None, vision_prefixes: tuple[str, ...],
                 dtype: torch.dtype, model_name: str):
        self.trees = {"text": text, "vision": vision}
        self.vision_prefixes, self.dtype, self.model_name = vision_prefixes, dtype, model_name
        self.active: list[tuple[Path, float]] = []
        self.undo: list[Callable[[], None]] = []
        # the last KEPT_ADAPTERS adapters read, by (weights file, size, mtime): switching between wires reads nothing
        self.read: dict[tuple, Adapter] = {}

    def set(self, loras: LoraRequest) -> None:
        """Puts exactly these adapters (with their strengths) on the model, replacing those on it; [] leaves the
        base model. On an error (an adapter that cannot be read or does not fit) the model keeps the adapters it
        had."""
        wanted: list[tuple[Path, float]] = []
        for path, strength in loras:
            strength = float(strength)
            if not math.isfinite(strength):
                raise AdapterError(f"{path}: LoRA strength {strength} is not a finite number; use for example 1.0 "
                                   "(0 switches the adapter off, negative values invert it).")
            wanted.append((adapter_files(path)[1].resolve(), strength))
        if wanted == self.active:
            return
        previous = self.active
        self.clear()  # the adapters are found in the base model, without the side paths and replacements now on
        try:
            self.attach(self.gathered(wanted))
        except BaseException:
            self.clear()
            self.attach(self.gathered(previous))  # checked when they were put on
            self.active = previous
            raise
        self.active = wanted

    def gathered(self, loras: list[tuple[Path, float]]) -> SidePaths:
        sides = SidePaths()
        for path, strength in loras:
            if strength != 0:
                self.gather(self.adapter(path), strength, sides)
        return sides

    def adapter(self, weights: Path) -> Adapter:
        stat = weights.stat()
        key = (weights, stat.st_size, stat.st_mtime_ns)
        adapter = self.read.pop(key, None) or read_adapter(weights)
        # an older version of the file, and the adapters used longest ago, are dropped
        self.read = {k: v for k, v in self.read.items() if k[0] != weights}
        self.read[key] = adapter
        for old in list(self.read)[:-KEPT_ADAPTERS]:
            del self.read[old]
        return adapter

    def clear(self) -> None:
        """Takes every side path and replacement off: the base model as loaded."""
        while self.undo:
            self.undo.pop()()
        self.active = []

    def release(self) -> None:
        """Takes the adapters off and lets go of the model's modules and the adapters read."""
        self.clear()
        self.trees, self.read = {"text": None, "vision": None}, {}

    # ------------------------------------------------------------------------------------------- finding weights
    def locate(self, name: str) -> tuple[str, str]:
        """(tree, module name in it) of a module PEFT named in the transformers model."""
        if self.trees["vision"] is not None:
            for prefix in self.vision_prefixes:
                if name.startswith(prefix):
                    return "vision", name[len(prefix):]
        prefix = next(p for p in TEXT_PREFIXES if name.startswith(p))  # the last prefix is ""
        return "text", name[len(prefix):]

    def missing(self, adapter: Adapter, name: str) -> AdapterError:
        made_for = f" (it was made for {adapter.config.base_model})" if adapter.config.base_model else ""
        return AdapterError(f"{adapter.path}: adapts '{name}', which {self.model_name} does not have{made_for}. The "
                            "adapter belongs to another model: use one trained on this model.")

    def find(self, adapter: Adapter, name: str, sides: SidePaths) -> Target:
        """The module computing the weight PEFT calls `name` (a replacement the adapters bring, if any)."""
        tree_name, rel = self.locate(name)
        tree = self.trees[tree_name]
        if tree_name == "text" and rel in sides.replaced:
            return Target(tree_name, rel, sides.replaced[rel])
        try:
            return Target(tree_name, rel, tree.get_submodule(rel))
        except AttributeError:
            pass
        parts = rel.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # a projection fused into its owner's one product
            try:
                owner = tree.get_submodule(".".join(parts[:cut]))
            except AttributeError:
                continue
            part = ".".join(parts[cut:])
            if getattr(owner, "fused_projection", None) is not None and part in owner.input_projections:
                return Target(tree_name, rel, owner.fused_projection, owner.input_projections.index(part))
        raise self.missing(adapter, name)

    # ------------------------------------------------------------------------------------------- gathering
    def gather(self, adapter: Adapter, strength: float, sides: SidePaths) -> None:
        """Adds one adapter's side paths (at `strength`) to `sides`, each checked against the model's shapes."""
        for name, weight in adapter.replaced.items():
            tree_name, rel = self.locate(name)
            if tree_name != "text" or rel not in REPLACEABLE:
                raise AdapterError(f"{adapter.path}: replaces the whole module '{name}' (modules_to_save); only "
                                   f"{' and '.join(REPLACEABLE)} can be replaced. Use an adapter that keeps the rest "
                                   "as LoRA factors.")
            sides.replaced[rel] = self.replacement(adapter, name, rel, weight)
        for name, factors in adapter.factors.items():
            target = self.find(adapter, name, sides)
            if target.tree == "text":
                sides.adapted.add(target.name)
            if not hasattr(target.module, "gate_up"):
                module, part = target.module, target.part
                shape = (module.sizes[part], module.weight.shape[1]) if part is not None else matrix_shape(module)
                if shape is None or len(factors) != 1:
                    raise AdapterError(f"{adapter.path}: has a LoRA on '{name}', which is not one matrix in "
                                       f"{self.model_name} ({type(module).__name__}). The adapter belongs to another "
                                       "model: use one trained on this model.")
                a, b = self.checked(adapter, name, factors[0], shape, 1)
                pair = (a, b * (adapter.config.scale(name, a.shape[0]) * strength))
                if part is None:
                    sides.linear.setdefault(module, []).append(pair)
                else:
                    sides.fused.setdefault(module, {}).setdefault(part, []).append(pair)
            else:
                stacks = sides.experts.setdefault((target.name, target.module), {})
                for stack, pair in self.expert_pairs(adapter, name, target.module, factors, strength):
                    stacks.setdefault(stack, []).append(pair)
        for name, factor in adapter.embedding_factors.items():
            target = self.find(adapter, name, sides)
            if not isinstance(target.module, nn.Embedding):
                raise self.missing(adapter, name)
            vocab, hidden = target.module.weight.shape
            if factor.a.shape[1] != vocab or factor.b.shape[0] != hidden:
                raise self.shape_error(adapter, name, factor, (hidden, vocab))
            pair = (factor.a, factor.b * (adapter.config.scale(name, factor.a.shape[0]) * strength))
            sides.embedding.setdefault(target.module, []).append(pair)

    def expert_pairs(self, adapter: Adapter, name: str, store: nn.Module, factors: list[Factors],
                     strength: float) -> list[tuple[str, Pair]]:
        """("gate_up" / "down", (a [E, r, in], b [E, out, r])) for each stack an adapter's factors adapt, told apart
        by their shapes (gate_up_proj reads the hidden size, down_proj the expert size, which never agree)."""
        stacks = {"gate_up": tuple(store.gate_up_proj.shape), "down": tuple(store.down_proj.shape)}
        pairs = []
        for factor in factors:
            fitting = [k for k, (_, out, inp) in stacks.items()
                       if factor.a.shape[1] == inp and factor.b.shape[0] == out]
            if not fitting:
                raise self.shape_error(adapter, name, factor, stacks["gate_up"][1:])
            stack = fitting[0]
            experts, out, inp = stacks[stack]
            a, b = self.checked(adapter, name, factor, (out, inp), experts)
            r = a.shape[0] // experts
            scale = adapter.config.scale(f"{name}.{stack}_proj", r) * strength
            pairs.append((stack, (a.reshape(experts, r, inp), b.reshape(out, r, experts).permute(2, 0, 1) * scale)))
        return pairs

    def checked(self, adapter: Adapter, name: str, factor: Factors, shape: tuple[int, int],
                experts: int) -> Pair:
        """A pair whose product is a matrix of `shape` [out, in] (for each of `experts` experts)."""
        out, inp = shape
        if factor.a.shape[1] != inp or factor.b.shape[0] != out or factor.a.shape[0] % experts:
            raise self.shape_error(adapter, name, factor, shape)
        return factor.a, factor.b

    def shape_error(self, adapter: Adapter, name: str, factor: Factors, shape: tuple[int, ...]) -> AdapterError:
        made_for = f" (it was made for {adapter.config.base_model})" if adapter.config.base_model else ""
        return AdapterError(f"{adapter.path}: the LoRA on '{name}' maps {factor.a.shape[1]} inputs to "
                            f"{factor.b.shape[0]} outputs (A {tuple(factor.a.shape)}, B {tuple(factor.b.shape)}), but "
                            f"{self.model_name}'s matrix there is {list(shape)} [out, in]{made_for}. The adapter "
                            "belongs to another model or size: use one trained on this model.")

    def replacement(self, adapter: Adapter, name: str, rel: str, weight: torch.Tensor) -> nn.Module:
        """The module that takes the place of lm_head / embed_tokens, holding the adapter's weight."""
        base = self.trees["text"].get_submodule(rel)
        shape = (base.num_embeddings, base.embedding_dim) if isinstance(base, nn.Embedding) else matrix_shape(base)
        if tuple(weight.shape) != shape:
            raise AdapterError(f"{adapter.path}: replaces '{name}' with a {list(weight.shape)} weight, but "
                               f"{self.model_name}'s is {list(shape)}. The adapter belongs to another model (or "
                               "resized the vocabulary, which this pack does not load).")
        weight = weight.to(module_device(base), self.dtype)
        if isinstance(base, nn.Embedding):
            return nn.Embedding.from_pretrained(weight, freeze=True)
        module = nn.Linear(shape[1], shape[0], bias=False, device="meta")
        module.weight = nn.Parameter(weight, requires_grad=False)
        return module

    # ------------------------------------------------------------------------------------------- attaching
    def attach(self, sides: SidePaths) -> None:
        """Attaches gathered side paths and replacements; each change leaves its undo in `self.undo`."""
        text = self.trees["text"]
        for rel, module in sides.replaced.items():
            self.swap(text, rel, module)
        for module, pairs in sides.linear.items():
            self.undo.append(attach_side_paths(module, {None: self.low_rank(LowRank, pairs, module)}))
        for fused, parts in sides.fused.items():
            self.undo.append(attach_side_paths(fused, {part: self.low_rank(LowRank, pairs, fused)
                                                       for part, pairs in parts.items()}))
        for embedding, pairs in sides.embedding.items():
            self.undo.append(attach_side_paths(embedding, {None: self.low_rank(EmbeddingLowRank, pairs, embedding)}))
        for (rel, store), stacks in sides.experts.items():
            gate_up, down = (self.expert_low_rank(stacks.get(which), store) for which in ("gate_up", "down"))
            self.swap(text, rel, AdaptedExperts(store, gate_up, down))
        verdicts: dict = {}  # each kind of layer step checked once with its side paths
        for index in sorted({int(rel.split(".")[1]) for rel in sides.adapted if rel.startswith("layers.")}):
            self.refit(text.layers[index], verdicts)

    def swap(self, tree: nn.Module, rel: str, module: nn.Module) -> None:
        parent_name, _, leaf = rel.rpartition(".")
        parent = tree.get_submodule(parent_name)
        base = getattr(parent, leaf)
        setattr(parent, leaf, module)
        self.undo.append(lambda: setattr(parent, leaf, base))

    def refit(self, layer: nn.Module, verdicts: dict) -> None:
        """Builds the fused decoding steps of an adapted decoder layer again with its side paths (where the layer
        has them: a Qwen3.5 layer on the CPU with the numba kernels); the layer's own steps come back with the
        undo."""
        if getattr(layer, "step_kernel", None) is None and getattr(layer.mlp, "step_kernel", None) is None:
            return
        kernels = (layer.step_kernel, layer.mlp.step_kernel)

        def restore() -> None:
            layer.step_kernel, layer.mlp.step_kernel = kernels
        self.undo.append(restore)
        refit_step_kernels(layer, verdicts)

    def low_rank(self, kind: type[LowRank], pairs: list[Pair], module: nn.Module) -> LowRank:
        """One side path of all adapters' pairs on a module, in the compute dtype on the module's device."""
        device = module_device(module)
        return kind(torch.cat([a for a, _ in pairs]).to(device, self.dtype),
                    torch.cat([b for _, b in pairs], dim=1).to(device, self.dtype))

    def expert_low_rank(self, pairs: list[Pair] | None, store: nn.Module) -> ExpertLowRank | None:
        if pairs is None:
            return None
        return ExpertLowRank(torch.cat([a for a, _ in pairs], dim=1).to(store.device, self.dtype),
                             torch.cat([b for _, b in pairs], dim=2).to(store.device, self.dtype))


def module_device(module: nn.Module) -> torch.device:
    """Where a module's weights are (its first parameter or buffer)."""
    return next(iter([*module.parameters(), *module.buffers()])).device


def matrix_shape(module: nn.Module) -> tuple[int, int] | None:
    """[out, in] of a Linear in any of the model's formats (each offers in_features / out_features), else None."""
    if isinstance(module, nn.Embedding) or not hasattr(module, "in_features"):
        return None
    return module.out_features, module.in_features
