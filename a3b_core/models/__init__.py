"""Model families: each folder here is one (its config, modules, checkpoint layout and sizes), found by config.json's
model_type. The engine, the planner and the generation loop use a family only through `Family` (family.py); a new
family is a new folder, one entry in FAMILIES and its built-in chat template (prompting/built_in_templates.py)."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..release.config import ModelConfig, StoredLayers, read_config
from . import qwen3_5, qwen3_vl
from .family import Family

FAMILIES = (qwen3_5.FAMILY, qwen3_vl.FAMILY)


def family_for(model_type: object, where: str = "config.json") -> Family:
    """The family whose model_type this is; a ConfigError naming the supported ones otherwise."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(t for family in FAMILIES for t in family.model_types)
    raise ConfigError(f"{where}: model_type {model_type!r} is not supported. This pack runs these model types: "
                      f"{', '.join(supported)}; pick such a model folder.")


def family_of(raw: object, where: str = "config.json") -> Family:
    """The family of a config.json's object (its model_type), checked to be an object first."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level. Use the config.json that came with "
                          "the model.")
    return family_for(raw.get("model_type"), where)


def parse_config(raw: object, where: str = "config.json", stored: StoredLayers | None = None) -> ModelConfig:
    """config.json's object -> ModelConfig, parsed by the family its model_type names; with `stored`, the layer
    counts must match what the weights hold."""
    return family_of(raw, where).parse_config(raw, where, stored)


def load_config(folder: str | Path, stored: StoredLayers | None = None) -> ModelConfig:
    """A model folder's config.json, parsed by its family."""
    return parse_config(read_config(folder), str(Path(folder) / "config.json"), stored)
