"""A3B Remote Model: a model behind an OpenAI-compatible server, used by the same Image Encode and Generate nodes."""
from __future__ import annotations

from a3b_core.services.openai_client import RemoteModel

from .comfy_bridge import io
from .remote_handle import RemoteModelHandle
from .wires import ModelWire

CATEGORY = "A3B"


class A3BRemoteModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BRemoteModel",
            display_name="A3B Remote Model",
            category=CATEGORY,
            description="A model served over an OpenAI-compatible API (python -m a3b_core serve, vLLM, SGLang, "
                        "llama-server), for the same Image Encode, Prompt and Generate nodes. Images and prompts are "
                        "sent to that server.",
            inputs=[
                io.String.Input("base_url", default="http://127.0.0.1:8000/v1",
                                tooltip="The server's OpenAI API address, usually ending in /v1. Images and prompts "
                                        "go to this address: use only servers you trust."),
                io.String.Input("model", default="",
                                tooltip="The model name the server lists (GET /v1/models), e.g. "
                                        "Qwen/Qwen3.5-35B-A3B. Empty: the server's only model."),
                io.String.Input("api_key_env", default="",
                                tooltip="Name of an environment variable starting with A3B_ (e.g. A3B_API_KEY) that "
                                        "holds the server's API key, set where ComfyUI runs. The key itself is never "
                                        "saved in the workflow. Empty: the server needs no key."),
                io.Int.Input("timeout", default=600, min=1, max=86400,
                             tooltip="Seconds to wait for the server to connect, and for each piece of the answer, "
                                     "before giving up."),
            ],
            outputs=[ModelWire.Output(display_name="model", tooltip="The remote model, for A3B Image Encode and "
                                                                   "A3B Generate.")],
        )

    @classmethod
    def execute(cls, base_url: str, model: str, api_key_env: str, timeout: int) -> io.NodeOutput:
        remote = RemoteModel(base_url, model, api_key_env, timeout)
        # asks the server now, so a wrong address, key or model name fails here with the server's own answer
        remote = RemoteModel(base_url, remote.resolve_model(), api_key_env, timeout)
        return io.NodeOutput(RemoteModelHandle(remote))
