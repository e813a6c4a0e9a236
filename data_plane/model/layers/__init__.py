"""Building blocks of the llama-family models, written ready for tensor parallelism."""
