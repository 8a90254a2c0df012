"""Block-quantized GGUF files made from the converter's F32 fixtures (tests/tiny_gguf.py), as llama.cpp's quantizer
would lay them out: each matrix rewritten in a chosen block type, everything else (metadata, vectors) copied.

gguf-py quantizes the 32-element types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) from the matrix; the types it cannot
quantize (the K types, IQ4_NL, IQ4_XS) are written as random blocks whose fp16 scales are set so the matrix keeps the
source's spread. Either way
the file's weights are what gguf-py's dequantization says, which is the oracle the tests hold the engine to.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from a3b_core.kernels.gguf_blocks import half_fields, random_blocks, reference_dequantize
from a3b_core.kernels.gguf_types import BLOCK_TYPES, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

QUANTIZED_BY_GGUF_PY = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)  # type ids
Chooser = Callable[[str, tuple[int, ...]], "str | None"]  # (GGUF tensor name, torch shape) -> block type or None


def random_scaled_blocks(kind: str, values: np.ndarray, seed: int) -> np.ndarray:
    """Random valid blocks of a type for a float matrix [.., cols], scaled to the matrix's standard deviation."""
    type_id = int(GGMLQuantizationType[kind])
    _, elems, nbytes = BLOCK_TYPES[type_id]
    rows = values.reshape(-1, values.shape[-1])
    blocks = random_blocks(type_id, rows.shape[0], rows.shape[1], np.random.default_rng(seed))
    spread = reference_dequantize(type_id, blocks, rows.shape[1]).std()
    factor = rows.std() / max(float(spread), 1e-12)
    per_block = blocks.reshape(rows.shape[0], -1, nbytes)
    for at in half_fields(type_id):
        scales = per_block[..., at:at + 2].copy().view(np.float16)
        per_block[..., at:at + 2] = (scales.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    return blocks.reshape(*values.shape[:-1], -1)


def requantize(source: Path, out: Path, choose: Chooser, seed: int = 0) -> None:
    """`source` (an F32/F16 GGUF) written to `out` with each tensor `choose` names a block type for in that type."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for n, tensor in enumerate(reader.tensors):
        values = np.asarray(tensor.data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
        kind = choose(tensor.name, values.shape)
        if kind is None:
            writer.add_tensor(tensor.name, np.asarray(tensor.data))
            continue
        qtype = GGMLQuantizationType[kind]
        data = quants.quantize(values, qtype) if qtype in QUANTIZED_BY_GGUF_PY else random_scaled_blocks(kind, values, seed + n)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
