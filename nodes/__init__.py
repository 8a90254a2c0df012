"""ComfyUI adapters around a3b_core.

Only `comfy_bridge` touches ComfyUI; the plain modules (model_folders, captions, image_batch, prompt_spec,
live_text) import without it, so their logic is unit-tested outside ComfyUI.
"""
