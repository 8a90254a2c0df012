"""The pack's own wire types. Each carries a small Python object: A3BModelHandle, the engine's EncodedImages, a
PromptSpec."""
from .comfy_bridge import io

ModelWire = io.Custom("A3B_MODEL")
ImagesWire = io.Custom("A3B_IMAGES")
PromptWire = io.Custom("A3B_PROMPT")
