"""From a conversation to token ids: turns and markers, chat templates (the folder's own, sandboxed, and the built-in
ones), the tokenizer."""
