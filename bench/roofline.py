"""The decode roofline: weight bytes one decoded token must read, and the memory bandwidth that bounds it.

Per decoded token a model reads every dense weight once, the routed experts of its top-k choices (on average
top_k / num_experts of each expert tensor) and one row of the token embedding. Dividing those bytes by the measured
bandwidth gives the fastest decode the memory allows; each system's decode speed is quoted as a fraction of it. The same
count in parameters (active_params) puts two model families on one scale.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BANDWIDTH_BYTES = 1 << 30  # 1 GiB: far beyond every cache level


def measure_bandwidth(threads: int, repeats: int = 5) -> float:
    """Best read bandwidth in bytes/s of `threads` threads summing a 1 GiB fp32 array (written first, so the pages
    exist and the timing is reads only)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - started)
        return BANDWIDTH_BYTES / best
    finally:
        torch.set_num_threads(previous)


def tensor_bytes_per_token(tensors: Iterable[tuple[str, int]], top_k: int, num_experts: int, vocab_size: int,
                           is_expert, is_embedding) -> int:
    """Sum over (name, bytes): routed-expert tensors count top_k/num_experts of their bytes, the token embedding
    one row, everything else whole."""
    total = 0.0
    for name, size in tensors:
        if is_embedding(name):
            total += size / vocab_size
        elif is_expert(name):
            total += size * top_k / num_experts
        else:
            total += size
    return round(total)


def torch_bytes_per_token(module: torch.nn.Module, top_k: int, num_experts: int, vocab_size: int) -> int:
    """For our engine and transformers alike: routed experts live under `mlp.experts.`, the embedding is
    `embed_tokens`; the shared expert (`mlp.shared_expert.`) is dense."""
    seen: set[int] = set()  # tied or shared storage counts once
    tensors = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        key = tensor.data_ptr()
        if tensor.device.type == "meta" or key in seen:
            continue
        seen.add(key)
        tensors.append((name, tensor.numel() * tensor.element_size()))
    return tensor_bytes_per_token(tensors, top_k, num_experts, vocab_size,
                                  is_expert=lambda n: ".mlp.experts." in n,
                                  is_embedding=lambda n: "embed_tokens" in n)


def active_params(text_model: Callable[[Any], torch.nn.Module], text_config: Any) -> int:
    """Parameters one token's forward pass reads, exactly, from the config alone (the family's text model built on
    the meta device): every matrix, norm, DeltaNet and router parameter and the LM head whole, the routed experts'
    top_k / num_experts, and of the token embedding the one row a token looks up (hidden_size parameters: the table
    itself is not counted)."""
    import torch

    with torch.device("meta"):
        module = text_model(text_config)
    return tensor_bytes_per_token(((name, p.numel()) for name, p in module.named_parameters()),
                                  text_config.num_experts_per_tok, text_config.num_experts, text_config.vocab_size,
                                  is_expert=lambda n: ".mlp.experts." in n, is_embedding=lambda n: "embed_tokens" in n)


def gguf_bytes_per_token(tensors: Iterable[tuple[str, int]], top_k: int, num_experts: int, vocab_size: int) -> int:
    """llama.cpp names routed experts `blk.N.ffn_{gate,up,down}_exps` (shared: `ffn_*_shexp`), the embedding
    `token_embd`."""
    return tensor_bytes_per_token(tensors, top_k, num_experts, vocab_size,
                                  is_expert=lambda n: "_exps" in n, is_embedding=lambda n: n.startswith("token_embd"))
