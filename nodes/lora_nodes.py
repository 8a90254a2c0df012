"""A3B LoRA: a LoRA adapter on the model wire, beside the base weights, for the nodes that use the model."""
from __future__ import annotations

from typing import Any

from . import comfy_bridge as bridge
from .comfy_bridge import io
from .model_folders import list_lora_adapters, resolve_lora
from .wires import ModelWire

CATEGORY = "A3B"


class A3BLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BLoRA",
            display_name="A3B LoRA",
            category=CATEGORY,
            description="Puts a LoRA adapter (PEFT format) on an A3B model for the nodes after it. The base weights "
                        "are not changed and the model is not loaded again: the Loader's own wire still runs the "
                        "base model. Chain several LoRA nodes to combine adapters.",
            inputs=[
                ModelWire.Input("model", tooltip="The model from A3B Model Loader, or from another A3B LoRA to add "
                                                 "this adapter to its adapters."),
                io.Combo.Input("lora", options=list_lora_adapters(bridge.lora_roots()),
                               tooltip="A LoRA adapter trained on this model, as PEFT saves it: a folder with "
                                       "adapter_config.json and adapter_model.safetensors, or such a .safetensors "
                                       "file with its adapter_config.json beside it, in ComfyUI/models/loras or "
                                       "models/LLM. Press 'Refresh' after adding one."),
                io.Float.Input("strength", default=1.0, min=-4.0, max=4.0, step=0.05,
                               tooltip="How strongly the adapter acts: 1 as trained, 0 = off (the base model's "
                                       "answers exactly), negative inverts its effect."),
            ],
            outputs=[ModelWire.Output(display_name="model", tooltip="The model with this adapter (and those before "
                                                                   "it), for Image Encode, Generate or another LoRA.")],
        )

    @classmethod
    def execute(cls, model: Any, lora: str, strength: float) -> io.NodeOutput:
        return io.NodeOutput(model.with_lora(resolve_lora(lora, bridge.lora_roots()), strength))
