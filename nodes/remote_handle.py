"""What travels on an A3B_MODEL wire for a remote model: the calls Image Encode and Generate make on a model handle."""
from __future__ import annotations

from typing import Any

from a3b_core.errors import RemoteError
from a3b_core.services.openai_client import RemoteModel


class RemoteModelHandle:
    """As A3BModelHandle for a local model, but there is nothing to load or free: the server holds the model."""

    def __init__(self, remote: RemoteModel):
        self.remote = remote

    def acquire(self, progress: Any = None) -> RemoteModel:
        return self.remote

    def finished_run(self) -> None:
        pass

    def with_lora(self, path: str, strength: float) -> RemoteModelHandle:
        raise RemoteError("A3B LoRA puts adapters on a model this ComfyUI loads (A3B Model Loader), not on a remote "
                          "server's model. Start the server with the adapter (python -m a3b_core serve MODEL --lora "
                          "PATH[:STRENGTH]) or connect the LoRA node to an A3B Model Loader.")
