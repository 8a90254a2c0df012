"""Runs a llama.cpp tree's own convert_hf_to_gguf.py on the vocabulary-less benchmark checkpoint.

    python bench/convert_gguf.py LLAMA_CPP_TREE MODEL_DIR OUT.gguf

The random model has no tokenizer, so the converter's Qwen3.5-MoE class is told to take its vocabulary from the
tree's `models/ggml-vocab-qwen2.gguf`: Qwen2's byte-level BPE cut to the bench model's 32,000 tokens (the merges
that make them kept; the last two ids are the chat tokens <|im_start|> and <|im_end|>), so that our engine reads it as it reads a Qwen GGUF's. llama-bench feeds random token ids, so
which words they are does not matter. Written as BF16, without the (absent) MTP block.
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
        import gguf
        size = self.hparams["vocab_size"]
        reader = gguf.GGUFReader(tree / "models" / "ggml-vocab-qwen2.gguf")
        chat = ["<|im_start|>", "<|im_end|>"]  # the control tokens our engine's prompts need, as the last ids
        tokens = reader.fields[gguf.Keys.Tokenizer.LIST].contents()[:size - len(chat)] + chat
        types = reader.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents()[:size - len(chat)] + [3] * len(chat)
        known = set(tokens)
        merges = [m for m in reader.fields[gguf.Keys.Tokenizer.MERGES].contents()
                  if m.replace(" ", "", 1) in known and all(part in known for part in m.split(" ", 1))]
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("qwen2")
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types(types)
        self.gguf_writer.add_token_merges(merges)

    Qwen3_5MoeTextModel.set_vocab = builtin_vocab
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out_file), "--outtype", "bf16", "--no-mtp"]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
