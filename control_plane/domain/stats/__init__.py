"""Fleet-wide LoRA statistics: the engines' /v1/lora_stats, /v1/lora_adapters and /metrics combined."""
