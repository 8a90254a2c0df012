"""The embedded demo model's data: procedural shape images, their captions, and the tokenizer."""
