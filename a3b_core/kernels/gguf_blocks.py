"""GGUF block types' products and dequantization (placeholder: gguf-py's reference dequantization)."""
from __future__ import annotations

import numpy as np
import torch


def dequantize_blocks(type_id: int, blocks: np.ndarray, cols: int) -> np.ndarray:
    import gguf
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(type_id))


def blocks_product(type_id: int, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    w = torch.from_numpy(dequantize_blocks(type_id, blocks, x.shape[1]))
    return (torch.from_numpy(x) @ w.T).numpy()
