"""The embedded demo model's training: its data generators (shape scenes, clips, foreign scenes), its tokenizer, and
the training, export and evaluation of a3b_core/demo/a3b-demo and a3b-demo-fp8 (python -m bench.demo_model.train)."""
