"""Which model folders the loader offers, and turning a chosen name back into a path that stays inside them."""
from __future__ import annotations

from pathlib import Path

from a3b_core.errors import ConfigError
from a3b_core.runtime.loader import DEMO_MODELS

DEMO_MODEL = "a3b-demo"  # the loader's default; the embedded demo models' names, which load_model resolves itself
_MAX_DEPTH = 2  # models/LLM/<name> or models/LLM/<org>/<name>


def list_model_folders(roots: list[str]) -> list[str]:
    """Names (relative to their root, '/'-separated) of the folders under `roots` that hold a config.json."""
    names: set[str] = set()
    for root in roots:
        base = Path(root)
        if not base.is_dir():
            continue
        frontier = [base]
        for _ in range(_MAX_DEPTH):
            children = [child for folder in frontier for child in sorted(folder.iterdir()) if child.is_dir()]
            names.update(child.relative_to(base).as_posix() for child in children if (child / "config.json").is_file())
            frontier = children
    return sorted(names)


def loader_choices(roots: list[str]) -> list[str]:
    return list(DEMO_MODELS) + list_model_folders(roots)


def resolve_model(name: str, roots: list[str]) -> str:
    """The path (or the demo name) for a loader choice; never a path outside the registered LLM folders."""
    if name in DEMO_MODELS:
        return name
    candidate = Path(name)
    if candidate.is_absolute() or ".." in candidate.parts or not name.strip():
        raise ConfigError(f"model {name!r} is not a folder name under models/LLM. Pick a model from the loader's "
                          "list; absolute paths and '..' are not accepted.")
    for root in roots:
        # Lexically inside the root (no '..', not absolute); a symlinked model folder the user placed there is fine.
        folder = Path(root) / candidate
        if (folder / "config.json").is_file():
            return str(folder)
    searched = ", ".join(roots) or "(no LLM folder is registered)"
    raise ConfigError(f"model folder {name!r} was not found (or has no config.json) in: {searched}. Put the model "
                      "folder (config.json, tokenizer.json and the *.safetensors files) into models/LLM/ and press "
                      "'Refresh' in ComfyUI, or pick another model.")
