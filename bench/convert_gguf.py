"""Runs a llama.cpp tree's own convert_hf_to_gguf.py on the vocabulary-less benchmark checkpoint.

    python bench/convert_gguf.py LLAMA_CPP_TREE MODEL_DIR OUT.gguf

The random model has no tokenizer, so the converter's Qwen3.5-MoE class is told to take its vocabulary from the
tree's `models/ggml-vocab-llama-spm.gguf` (exactly 32000 tokens, the bench model's vocabulary size); llama-bench
feeds random token ids, so which words they are does not matter. Written as BF16, without the (absent) MTP block.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    tree, model_dir, out_file = (Path(a).resolve() for a in sys.argv[1:4])
    # the converter finds its own package, gguf-py and the built-in vocabularies through sys.path[0]
    sys.path[0:0] = [str(tree), str(tree / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.qwen import Qwen3_5MoeTextModel

    def builtin_vocab(self) -> None:
        self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])

    Qwen3_5MoeTextModel.set_vocab = builtin_vocab
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out_file), "--outtype", "bf16", "--no-mtp"]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
