"""A GGUF model split by llama.cpp's gguf-split: parts named NAME-00001-of-00003.gguf, NAME-00002-of-00003.gguf, ...
in one folder, each a GGUF file with the keys split.no (0-based), split.count and split.tensors.count (the whole
set's tensors). The first part holds all of the model's metadata, the others only the split keys and their tensors.

Any part names the whole set; before it is read as one model, the set is checked to be complete, in order, and of
one split (no part of another set, no tensor twice).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .gguf_file import TensorRecord

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
ARCHITECTURE = "general.architecture"
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS, ARCHITECTURE)  # what check_split_set reads of each part
# gguf-split's file names: PREFIX-%05d-of-%05d.gguf, numbered from 1
PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.gguf)$", re.IGNORECASE)
REFETCH = "Download every part of the set again into one folder, keeping the names gguf-split gave them."


def is_split_part(path: Path) -> bool:
    """Whether the name of `path` is a gguf-split part's."""
    return PART_NAME.match(path.name) is not None


def is_first_part(path: Path) -> bool:
    """Whether `path` is named as the first part of a split set (the one that names the set in lists)."""
    match = PART_NAME.match(path.name)
    return match is not None and int(match["no"]) == 1


def split_parts(path: Path) -> list[Path]:
    """Every part of the split set that `path` is named as a part of, in order ([path] for a file not named as a
    part); refuses a set with a part missing from the folder."""
    match = PART_NAME.match(path.name)
    if match is None:
        return [path]
    number, count = int(match["no"]), int(match["count"])
    if not 1 <= number <= count:
        raise CheckpointError(f"{path}: the name says part {number} of {count}, which no split set has. Keep the "
                              "names gguf-split gave the parts (NAME-00001-of-00003.gguf ...).")
    parts = [path.with_name(f"{match['prefix']}-{i:05d}-of-{match['count']}{match['suffix']}")
             for i in range(1, count + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise CheckpointError(f"{path}: this GGUF is split into {count} parts, and {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}. {REFETCH}")
    return parts


def check_split_set(parts: list[Path], keys: list[dict[str, Any]], records: list[list[TensorRecord]]) -> None:
    """Checks that the parts (in order) form one split set: each part's split.no / split.count is its place in
    `parts`, all name the same split.tensors.count and architecture (where a part has one), no tensor is in two
    parts, and the set holds split.tensors.count tensors. `keys` is each part's SPLIT_KEYS, None where absent."""
    first = keys[0]
    if len(parts) == 1 and first[SPLIT_COUNT] in (None, 1):
        return  # one file (gguf-split's single part, if so named, is one too)
    if len(parts) == 1:
        raise CheckpointError(f"{parts[0]}: its metadata says it is part {_number(first[SPLIT_NO])} of a GGUF split "
                              f"into {first[SPLIT_COUNT]} parts, but its name is not a part's "
                              f"(NAME-00001-of-0000N.gguf ...), so the other parts cannot be found. {REFETCH}")
    total = first[SPLIT_TENSORS]
    for index, (part, found) in enumerate(zip(parts, keys)):
        if (found[SPLIT_NO], found[SPLIT_COUNT]) != (index, len(parts)):
            said = ("has no split.no / split.count keys, so it is not a gguf-split part"
                    if found[SPLIT_NO] is None or found[SPLIT_COUNT] is None else
                    f"is part {_number(found[SPLIT_NO])} of {found[SPLIT_COUNT]} by its metadata")
            raise CheckpointError(f"{part}: named part {index + 1} of {len(parts)}, the file {said}: it belongs to "
                                  f"another set or was renamed. {REFETCH}")
        if found[SPLIT_TENSORS] != total:
            raise CheckpointError(f"{part}: split.tensors.count is {found[SPLIT_TENSORS]}, but the first part "
                                  f"{parts[0].name} says {total}: this part belongs to another split set. {REFETCH}")
        if index and found[ARCHITECTURE] not in (None, first[ARCHITECTURE]):
            raise CheckpointError(f"{part}: general.architecture is {found[ARCHITECTURE]!r}, but the first part "
                                  f"{parts[0].name} says {first[ARCHITECTURE]!r}: this part belongs to another "
                                  f"model. {REFETCH}")
    where: dict[str, Path] = {}
    for part, part_records in zip(parts, records):
        for record in part_records:
            if record.name in where:
                raise CheckpointError(f"{part}: tensor '{record.name}' is also in {where[record.name].name}; each "
                                      f"tensor of a split set is in one part only, so the parts come from different "
                                      f"splits. {REFETCH}")
            where[record.name] = part
    if len(where) != total:
        raise CheckpointError(f"{parts[0]}: the {len(parts)} parts hold {len(where)} tensors, but split.tensors.count "
                              f"says {total}: a part is incomplete or of another set. {REFETCH}")


def _number(split_no: Any) -> Any:
    """split.no (0-based) as the 1-based part number of the file names."""
    return split_no + 1 if isinstance(split_no, int) else split_no
