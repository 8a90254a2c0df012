"""Block-quantized GGUF files made from the converter's F32 fixtures (tests/tiny_gguf.py), as llama.cpp's quantizer
would lay them out: each matrix rewritten in a chosen block type, everything else (metadata, vectors) copied.

gguf-py quantizes the 32-element types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) from the matrix; the K types it cannot
quantize are written as random blocks whose fp16 scales are set so the matrix keeps the source's spread. Either way
the file's weights are what gguf-py's dequantization says, which is the oracle the tests hold the engine to.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

# byte offsets of the fp16 scale fields (d, dmin) in one block of each K type
K_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
Chooser = Callable[[str, tuple[int, ...]], "str | None"]  # (GGUF tensor name, torch shape) -> block type or None


def random_k_blocks(kind: str, values: np.ndarray, seed: int) -> np.ndarray:
    """Random valid blocks of a K type for a float matrix [.., cols], scaled to the matrix's standard deviation."""
    qtype = GGMLQuantizationType[kind]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    rows = values.reshape(-1, values.shape[-1])
    blocks = rng.integers(0, 256, size=(rows.shape[0], rows.shape[1] // block, nbytes), dtype=np.uint8)
    fields = K_SCALE_FIELDS[kind]
    for offset in fields:
        blocks[..., offset:offset + 2] = rng.uniform(0.5, 1.0, blocks.shape[:2]).astype(np.float16)[..., None] \
            .view(np.uint8).reshape(*blocks.shape[:2], 2)
    spread = quants.dequantize(blocks.reshape(rows.shape[0], -1), qtype).std()
    factor = rows.std() / max(float(spread), 1e-12)
    for offset in fields:
        scales = blocks[..., offset:offset + 2].copy().view(np.float16)
        blocks[..., offset:offset + 2] = (scales.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
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
        data = random_k_blocks(kind, values, seed + n) if kind in K_SCALE_FIELDS else quants.quantize(values, qtype)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
