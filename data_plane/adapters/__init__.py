"""The adapter lifecycle of the engine: names, versions and host copies (registry, entry, host_cache),
their figures (stats, metrics), versions fetched by digest (artifact_source over artifacts/), and the
reading of PEFT folders into host weights (loading/). The LoRA compute (slots, layers, kernels) is
data_plane.lora, below."""
