"""`loraplane agent`: a torch-free sidecar beside an engine of another kind (vLLM) that speaks the engine
admin contract to the control plane and the engine's own runtime LoRA API to the engine."""
