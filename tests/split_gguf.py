"""Split sets written from a GGUF file as llama.cpp's gguf-split writes them: parts PREFIX-00001-of-0000N.gguf, the
first with all the metadata plus the split keys, the others with only the split keys (split.no, split.count,
split.tensors.count) and their tensors. Written with gguf-py's reader and writer; the tensors are copied byte for
byte."""
from __future__ import annotations

from pathlib import Path

import gguf

READER_ONLY = ("GGUF.",)  # the reader's own entries for the header fields, not metadata
ARCHITECTURE = "general.architecture"  # GGUFWriter adds it itself


def tensor_groups(source: Path, count: int) -> list[list[str]]:
    """The file's tensor names in order, cut into `count` runs of about equal length (as --split-max-tensors does)."""
    names = [t.name for t in gguf.GGUFReader(source).tensors]
    per_part = -(-len(names) // count)
    return [names[i:i + per_part] for i in range(0, len(names), per_part)]


def write_split_set(source: Path, prefix: Path, groups: list[list[str]],
                    tensors_count: int | None = None) -> list[Path]:
    """Writes the tensors of `source` into one part per group (a name may be given twice, to make a broken set);
    split.tensors.count is `tensors_count`, by default every tensor written. Returns the parts in order."""
    reader = gguf.GGUFReader(source)
    tensors = {t.name: t for t in reader.tensors}
    architecture = reader.fields[ARCHITECTURE].contents()
    total = sum(map(len, groups)) if tensors_count is None else tensors_count
    parts = [prefix.with_name(f"{prefix.name}-{i + 1:05d}-of-{len(groups):05d}.gguf") for i in range(len(groups))]
    for index, (part, group) in enumerate(zip(parts, groups)):
        writer = gguf.GGUFWriter(part, architecture)
        if index == 0:
            for key, field in reader.fields.items():
                if key.startswith(READER_ONLY) or key == ARCHITECTURE:
                    continue
                sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type)
        else:
            writer.kv_data[0].pop(ARCHITECTURE)  # gguf-split's later parts hold only the split keys
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, index)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, len(groups))
        writer.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, total)
        for name in group:
            writer.add_tensor(name, tensors[name].data, raw_dtype=tensors[name].tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return parts
