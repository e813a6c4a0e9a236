"""How the linear weights lie on the CPU: laid out once, after loading, for the CPU's matmul.

- "packed": bfloat16 weights where oneDNN multiplies bfloat16 on this CPU (layers/packed.py): prepacked
  into its blocked layout, so that no call reorders them again.
- "widened": bfloat16/float16 weights on a CPU without native half-precision dot products (AVX2 only):
  a float32 copy that float32 BLAS multiplies, the outputs rounded to the model's dtype (layers/packed.py
  says why the results are the half-precision GEMM's). Twice the weights' memory, several times the speed.
- "column-major": float32: the same [out, in] tensor, strides (1, out). F.linear(x, W) is then x @ Wᵀ
  over a contiguous Wᵀ, which CPU BLAS multiplies faster at decode batch sizes
  (docs/performance.md#engine-throughput).
- "plain": LORAPLANE_LINEAR_WEIGHTS=plain, the weights left as loaded: to compare, or to rule the layouts
  out (also the way to keep half-precision weights at half the memory on an AVX2 CPU).
In "packed" and "widened" the plain weight is dropped (an empty tensor of its dtype stays as the
parameter), except a tied head's, which the embedding still reads.
"""

from __future__ import annotations

import torch
from torch import nn

from data_plane.device import env_choice
from data_plane.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from data_plane.model.layers.linear import LinearBase
from data_plane.model.layers.packed import PackedWeight, WidenedWeight, can_pack, should_widen

LINEAR_WEIGHTS_ENV = "LORAPLANE_LINEAR_WEIGHTS"
CHOICES = ("auto", "plain")


def prepare_cpu_weights(model: nn.Module) -> str:
    """Lay out every linear layer's and the head's weight as the module doc says; answers the layout."""
    if env_choice(LINEAR_WEIGHTS_ENV, CHOICES) == "plain":
        return "plain"
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embedded = {id(m.weight) for m in model.modules()
                if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    dtype = (linears or heads)[0].weight.dtype if linears or heads else torch.float32
    layout: type[PackedWeight] | type[WidenedWeight] | None = (
        PackedWeight if can_pack(dtype) else WidenedWeight if should_widen(dtype) else None)
    with torch.no_grad():
        if layout is None:
            for module in linears:
                module.weight.data = module.weight.data.t().contiguous().t()
            return "column-major"
        for module in linears:
            module.cpu_weight = layout(module.weight.data)
            module.weight.data = module.weight.data.new_empty(0)
        for head in heads:
            head.cpu_weight = layout(head.weight.data)
            if id(head.weight) not in embedded:  # untied: the laid-out copy is the only one needed
                head.weight.data = head.weight.data.new_empty(0)
    return "packed" if layout is PackedWeight else "widened"
