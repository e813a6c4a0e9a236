"""PEFT folders read and validated into host weights: the loader, safetensors in memory, the shared-memory
host copy, the reader processes, and the hand-over of host weights to another process."""
