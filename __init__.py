"""ComfyUI entry point of the A3B node pack: the V3 extension in nodes/ and the JS extension in web/."""
import os
import sys

# a3b_core is imported by its own name (it is also used without ComfyUI); appended, so nothing of ComfyUI's is shadowed.
_PACK_DIR = os.path.dirname(os.path.abspath(__file__))
if _PACK_DIR not in sys.path:
    sys.path.append(_PACK_DIR)

WEB_DIRECTORY = "./web"

# ComfyUI imports this file as a package. pytest may import it as a plain module when the checkout's folder name is
# not a Python identifier; then there is nothing to register.
if __package__:
    from .nodes import comfy_bridge

    if comfy_bridge.IN_COMFYUI:
        from .nodes.extension import comfy_entrypoint  # noqa: F401
