"""The pack as a ComfyUI V3 extension."""
from __future__ import annotations

from . import comfy_bridge as bridge
from .caption_nodes import A3BCaptionFolder, A3BSaveCaptions
from .comfy_bridge import ComfyExtension, io
from .lora_nodes import A3BLoRA
from .model_nodes import A3BModelLoader
from .remote_nodes import A3BRemoteModel
from .text_nodes import A3BGenerate, A3BImageEncode, A3BPrompt
from .video_nodes import A3BVideoEncode


class A3BExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [A3BModelLoader, A3BLoRA, A3BRemoteModel, A3BImageEncode, A3BVideoEncode, A3BPrompt, A3BGenerate,
                A3BSaveCaptions, A3BCaptionFolder]


async def comfy_entrypoint() -> A3BExtension:
    # ComfyUI 0.3.75 does not call ComfyExtension.on_load, so the folder is registered here, before the Loader's
    # model list is first asked for.
    bridge.register_llm_folder()
    return A3BExtension()
