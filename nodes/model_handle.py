"""What travels on an A3B_MODEL wire: the engine model, how to load it again, its entry in ComfyUI's manager, and
the LoRA adapters to run it with."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import a3b_core
from a3b_core.runtime.options import LoadOptions
from a3b_core.runtime.placement import PRESETS, GiB

from . import comfy_bridge as bridge

Loras = tuple[tuple[str, float], ...]  # (adapter folder or .safetensors file, strength), as set_loras takes them
_UNLOAD_EVERYTHING = 1e30  # "auto" plans against all the memory the device has, so other models make room first


def preset_budget_bytes(preset: str) -> float:
    """Device memory to free before loading under `preset` (ComfyUI unloads other models until that much is free)."""
    if preset == "cpu":
        return 0
    if preset == "auto":
        return _UNLOAD_EVERYTHING
    return PRESETS[preset].vram_gib * GiB


class A3BModelHandle:
    """A loaded (or reloadable) A3B model as the Loader hands it to the other nodes.

    ComfyUI may unload the model between runs (another model needs the VRAM, or the user pressed "Unload models");
    `acquire` then loads it again with the same settings, so a cached Loader output never dangles.
    """

    loras: Loras = ()  # a Loader's wire runs the base model

    def __init__(self, path: str, options: LoadOptions, keep_loaded: bool, loader_node: str | None = None):
        """`options.device` "auto" means ComfyUI's own device."""
        self.path = path
        self.loader_node = loader_node  # the Loader node that made this handle, where the plan is shown
        self.options = options
        self.keep_loaded = keep_loaded
        self.plan_table = ""
        self.plan_summary = ""
        self._model: Any = None
        self._residency: Any = None  # made at the first load, on the device the model's weights are on

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def acquire(self, progress: Callable[[int, int], None] | None = None) -> Any:
        """The engine model, loaded if needed, marked as in use in ComfyUI's model manager, with this wire's LoRA
        adapters on it (none: the base model exactly)."""
        return self.acquire_with(self.loras, progress)

    def acquire_with(self, loras: Loras, progress: Callable[[int, int], None] | None = None) -> Any:
        """As `acquire`, with exactly `loras` on the model (the adapters of every wire are set as it is used)."""
        if self._model is None:
            self._load(progress)
        if self._residency is not None:
            bridge.keep_resident(self._residency)
        self._model.set_loras(loras)
        # Shown on the Loader even when ComfyUI served the Loader from its cache (cached nodes send no output).
        bridge.send_event("a3b.plan", {"node": self.loader_node, "summary": self.plan_summary,
                                       "table": self.plan_table})
        return self._model

    def _load(self, progress: Callable[[int, int], None] | None) -> None:
        device = bridge.engine_device() if self.options.device == "auto" else torch.device(self.options.device)
        if self.options.preset != "cpu":
            bridge.free_device_memory(preset_budget_bytes(self.options.preset), device)
        before = bridge.device_bytes_in_use(device)
        model = a3b_core.load_model(self.path, progress=progress, **(self.options.as_kwargs() | {"device": device}))
        self._model = model
        template = f"chat template: {model.chat_template_in_use}"
        self.plan_table = f"{model.plan}\n{template}"
        self.plan_summary = f"{model.plan.summary()}; {template}"
        if bridge.Residency is not None:
            self._residency = self._residency or bridge.Residency(self.release, model.device)
            self._residency.mark_loaded(bridge.device_bytes_in_use(model.device) - before)
        bridge.log.info("A3B model loaded from %s on %s: %s", self.path, model.device, self.plan_summary)

    def release(self) -> None:
        """Frees the engine's weights and caches now; the next `acquire` loads the model again."""
        if self._model is None:
            return
        model, self._model = self._model, None
        model.release()
        if self._residency is not None:
            self._residency.mark_unloaded()
        bridge.log.info("A3B model released: %s", self.path)

    def finished_run(self) -> None:
        """Called after each generation: frees the memory unless the user asked to keep the model loaded."""
        if not self.keep_loaded:
            self.release()

    def with_lora(self, path: str, strength: float) -> AdaptedHandle:
        """A wire running this handle's loaded model with one more adapter (the A3B LoRA node's output)."""
        return AdaptedHandle(self, self.loras + ((path, strength),))


class AdaptedHandle:
    """What the A3B LoRA node puts on the wire: the base handle's model with LoRA adapters on it. Loading, release
    and the entry in ComfyUI's model manager stay the base handle's, so every LoRA wire of one Loader shares its one
    loaded model."""

    def __init__(self, base: A3BModelHandle, loras: Loras):
        self.base = base
        self.loras = loras

    def acquire(self, progress: Callable[[int, int], None] | None = None) -> Any:
        return self.base.acquire_with(self.loras, progress)

    def finished_run(self) -> None:
        self.base.finished_run()

    def with_lora(self, path: str, strength: float) -> AdaptedHandle:
        """Another adapter after this wire's (the LoRA node chained)."""
        return AdaptedHandle(self.base, self.loras + ((path, strength),))
