"""Which model folders and GGUF files the loader and which LoRA adapters the LoRA node offer, and turning a chosen
name back into a path that stays inside their folders."""
from __future__ import annotations

from pathlib import Path

from a3b_core.errors import AdapterError, ConfigError
from a3b_core.release.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from a3b_core.release.gguf_split import is_first_part, is_split_part
from a3b_core.runtime.loader import DEMO_MODELS

DEMO_MODEL = "a3b-demo"  # the loader's default; the embedded demo models' names, which load_model resolves itself
_MAX_DEPTH = 2  # models/LLM/<name> or models/LLM/<org>/<name> (models/loras/... alike)
MMPROJ_PREFIX = "mmproj"  # llama.cpp's vision projector files (mmproj-*.gguf), found beside the model, not models


def subfolders(base: Path) -> list[Path]:
    """The folders below `base`, down to _MAX_DEPTH levels (none when `base` is not a folder)."""
    found: list[Path] = []
    frontier = [base] if base.is_dir() else []
    for _ in range(_MAX_DEPTH):
        frontier = [child for folder in frontier for child in sorted(folder.iterdir()) if child.is_dir()]
        found += frontier
    return found


def list_model_folders(roots: list[str]) -> list[str]:
    """Names (relative to their root, '/'-separated) of the folders under `roots` that hold a config.json."""
    return sorted({folder.relative_to(Path(root)).as_posix() for root in roots for folder in subfolders(Path(root))
                   if (folder / "config.json").is_file()})


def is_model_gguf(path: Path) -> bool:
    """A .gguf file that is a model: not a vision projector (by its name), and of a split set only the first part,
    which stands for the whole set."""
    name = path.name.lower()
    return (name.endswith(".gguf") and not name.startswith(MMPROJ_PREFIX) and path.is_file()
            and (not is_split_part(path) or is_first_part(path)))


def list_model_ggufs(roots: list[str]) -> list[str]:
    """Names (relative to their root, '/'-separated) of the model GGUF files in `roots` and their subfolders."""
    return sorted({file.relative_to(Path(root)).as_posix() for root in roots
                   for folder in [Path(root), *subfolders(Path(root))] if folder.is_dir()
                   for file in sorted(folder.iterdir()) if is_model_gguf(file)})


def list_lora_adapters(roots: list[str]) -> list[str]:
    """Names (relative to their root, '/'-separated) of the LoRA adapters in `roots` and their subfolders: a folder
    holding adapter_config.json and adapter_model.safetensors, and each .safetensors file with an adapter_config.json
    beside it (adapter_model.safetensors in such a folder is the folder itself)."""
    names: set[str] = set()
    for root in roots:
        base = Path(root)
        for folder in [base, *subfolders(base)]:
            if not (folder / ADAPTER_CONFIG).is_file():
                continue
            whole = folder != base and (folder / ADAPTER_WEIGHTS).is_file()
            if whole:
                names.add(folder.relative_to(base).as_posix())
            names.update(file.relative_to(base).as_posix() for file in folder.glob("*.safetensors")
                         if file.is_file() and not (whole and file.name == ADAPTER_WEIGHTS))
    return sorted(names)


def loader_choices(roots: list[str]) -> list[str]:
    return list(DEMO_MODELS) + sorted(list_model_folders(roots) + list_model_ggufs(roots))


def resolve_model(name: str, roots: list[str]) -> str:
    """The path (or the demo name) for a loader choice (a model folder or GGUF file); never a path outside the
    registered LLM folders."""
    if name in DEMO_MODELS:
        return name
    candidate = Path(name)
    if candidate.is_absolute() or ".." in candidate.parts or not name.strip():
        raise ConfigError(f"model {name!r} is not a folder name under models/LLM. Pick a model from the loader's "
                          "list; absolute paths and '..' are not accepted.")
    for root in roots:
        # Lexically inside the root (no '..', not absolute); a symlinked model folder the user placed there is fine.
        path = Path(root) / candidate
        if (path / "config.json").is_file() or is_model_gguf(path):
            return str(path)
    searched = ", ".join(roots) or "(no LLM folder is registered)"
    raise ConfigError(f"model {name!r} was not found (a folder with config.json, or a model .gguf file) in: "
                      f"{searched}. Put the model folder (config.json, tokenizer.json and the *.safetensors files) "
                      "or the .gguf file (a split set: all its parts) into models/LLM/ and press 'Refresh' in "
                      "ComfyUI, or pick another model.")


def resolve_lora(name: str, roots: list[str]) -> str:
    """The path of a LoRA node choice: only an adapter list_lora_adapters finds in one of `roots`, so never a path
    outside them."""
    for root in roots:
        if name in list_lora_adapters([root]):
            return str(Path(root) / name)
    searched = ", ".join(roots) or "(no loras or LLM folder is registered)"
    raise AdapterError(f"LoRA adapter {name!r} was not found in: {searched}. Put the adapter (a folder with "
                       f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, or such a .safetensors file with its {ADAPTER_CONFIG} "
                       "beside it) into models/loras/ and press 'Refresh' in ComfyUI, or pick another adapter.")


MMPROJ_AUTO, MMPROJ_NONE = "auto", "none"  # the loader's mmproj choices besides the files found


def list_mmproj_files(roots: list[str]) -> list[str]:
    """Names (relative to their root, '/'-separated) of the GGUF vision projectors (mmproj*.gguf) in `roots` and
    their subfolders."""
    return sorted({file.relative_to(Path(root)).as_posix() for root in roots
                   for folder in [Path(root), *subfolders(Path(root))] for file in folder.glob("*")
                   if file.is_file() and file.suffix.lower() == ".gguf" and file.name.lower().startswith("mmproj")})


def mmproj_choices(roots: list[str]) -> list[str]:
    return [MMPROJ_AUTO, MMPROJ_NONE, *list_mmproj_files(roots)]


def resolve_mmproj(name: str, roots: list[str]) -> str:
    """load_model's mmproj for a loader choice: auto, none, or the path of a listed mmproj file (so never a path
    outside the registered LLM folders)."""
    if name in (MMPROJ_AUTO, MMPROJ_NONE):
        return name
    for root in roots:
        if name in list_mmproj_files([root]):
            return str(Path(root) / name)
    searched = ", ".join(roots) or "(no LLM folder is registered)"
    raise ConfigError(f"mmproj {name!r} was not found in: {searched}. Put the mmproj-*.gguf file beside the GGUF "
                      "model in models/LLM/ and press 'Refresh' in ComfyUI, or pick 'auto' or 'none'.")
