"""How the linear weights lie on the CPU: laid out once, after loading, for the CPU's matmul.

- "packed": bfloat16 weights where oneDNN multiplies bfloat16 on this CPU (layers/packed.py): prepacked
  into its blocked layout, so that no call reorders them again. The plain weight is dropped (an empty
  tensor of its dtype stays as the parameter), except a tied head's, which the embedding still reads.
- "column-major": every other case (float32; bfloat16 without oneDNN's path): the same [out, in] tensor,
  strides (1, out). F.linear(x, W) is then x @ Wᵀ over a contiguous Wᵀ, which CPU BLAS multiplies faster
  at decode batch sizes (docs/performance.md#engine-throughput).
- "plain": LORAPLANE_LINEAR_WEIGHTS=plain, the weights left as loaded: to compare, or to rule packing out.
"""

from __future__ import annotations

import torch
from torch import nn

from data_plane.device import env_choice
from data_plane.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from data_plane.model.layers.linear import LinearBase
from data_plane.model.layers.packed import can_pack, pack

LINEAR_WEIGHTS_ENV = "LORAPLANE_LINEAR_WEIGHTS"
CHOICES = ("auto", "plain")


def prepare_cpu_weights(model: nn.Module) -> str:
    """Lay out every linear layer's and the head's weight as the module doc says; answers the layout."""
    choice = env_choice(LINEAR_WEIGHTS_ENV, CHOICES)
    if choice == "plain":
        return "plain"
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embedded = {id(m.weight) for m in model.modules()
                if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    dtype = (linears or heads)[0].weight.dtype if linears or heads else torch.float32
    packing = can_pack(dtype)
    with torch.no_grad():
        for module in linears:
            if packing:
                module.packed_weight = pack(module.weight.data)
                module.weight.data = module.weight.data.new_empty(0)
            else:
                module.weight.data = module.weight.data.t().contiguous().t()
        for head in heads if packing else []:
            head.packed_weight = pack(head.weight.data)
            if id(head.weight) not in embedded:  # untied: the packed copy is the only one needed
                head.weight.data = head.weight.data.new_empty(0)
    return "packed" if packing else "column-major"
