"""Reading a model release: config.json, safetensors headers and memory-mapped tensors, tensors into parameters."""
