"""The usual way to serve LoRA adapters without a LoRA server, the naive-PEFT baseline of
bench/lora_throughput.py's (d) and bench/serving.py --peft: transformers + PEFT, every adapter loaded
into one PeftModel, one request at a time with its adapter set, greedy `generate`. Test-only libraries
(transformers, peft), imported here only.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


class NaivePeft:
    def __init__(self, model_dir: Path, adapter_dirs: list[Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model = PeftModel.from_pretrained(base, adapter_dirs[0], adapter_name="a0")
        for i, path in enumerate(adapter_dirs[1:], start=1):
            self.model.load_adapter(path, adapter_name=f"a{i}")
        self.model.generation_config.eos_token_id = None  # every request generates output_len tokens

    def tokens_per_s(self, jobs: list[tuple[list[int], int]], output_len: int) -> float:
        """jobs: (prompt token ids, index of its adapter in adapter_dirs), served one after the other."""
        start, tokens = time.perf_counter(), 0
        for prompt, adapter in jobs:
            self.model.set_adapter(f"a{adapter}")
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                          do_sample=False, pad_token_id=0)
            tokens += out.shape[1] - ids.shape[1]
        return tokens / (time.perf_counter() - start)
