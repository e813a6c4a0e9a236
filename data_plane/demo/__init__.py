"""A tiny, randomly initialised Qwen2 checkpoint generated offline, for demos and tests.

Entry point: `data_plane.demo.model_builder.write_demo_model` (or `loraplane demo-model DIR`).
Kept import-free so that `data_plane.demo.tokenizer_builder` does not pull in torch.
"""
