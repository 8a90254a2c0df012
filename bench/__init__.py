"""Benchmarks of the engine against transformers and llama.cpp (run by hand: python bench/speed.py), and the demo
model's training (demo_model/)."""
