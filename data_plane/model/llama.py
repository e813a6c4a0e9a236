"""Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm), GQA.

Module names follow Hugging Face (model.layers.N.self_attn.o_proj, …) except the fused projections
qkv_proj (q/k/v_proj) and gate_up_proj (gate/up_proj), so LoRA target names map onto them directly.
Every linear receives the step's LoRA batch explicitly (`lora`); the base layers ignore it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from data_plane.model.attention import PagedAttention
from data_plane.model.attention_metadata import AttentionMetadata
from data_plane.model.config import ModelConfig
from data_plane.model.layers.activation import SiluAndMul
from data_plane.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from data_plane.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from data_plane.model.layers.norm import RMSNorm
from data_plane.model.layers.rotary import RotaryEmbedding, apply_rotary
from data_plane.model.lora_batch import LoRABatch
from data_plane.model.weights import load_llama_weights


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=config.mlp_bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=config.mlp_bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # x: [T, hidden]
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_up_proj(x, lora)), lora)
        return out


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        # kept here: qkv_proj may be wrapped by a LoRA layer, which does not mirror the base's attributes
        self.qkv_split = self.qkv_proj.output_sizes_per_partition
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_proj_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        # Qwen3: RMSNorm over each head's vector of q and k, before rope
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,  # [T, D/2]
        kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
        attn: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, lora)  # [T, (H + 2 Hkv) * D]
        q, k, v = qkv.split(self.qkv_split, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))  # [T, H, D]
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
            qk = torch.cat((q, k), dim=1)  # [T, H + Hkv, D]
        else:  # q and k sit side by side in qkv: one rotary over both heads at once
            qk = qkv[:, : self.qkv_split[0] + self.qkv_split[1]].view(num_tokens, -1, self.head_dim)
        qk = apply_rotary(qk, cos, sin).reshape(num_tokens, -1)  # [T, (H + Hkv) * D]
        q, k = torch.split(qk, self.qkv_split[:2], dim=-1)  # [T, H * D], [T, Hkv * D]
        out = self.attn(q, k, v, kv_cache, attn)  # [T, H * D]
        projected: torch.Tensor = self.o_proj(out, lora)
        return projected


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp_rank, tp_size)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the previous layer's MLP output, or the embeddings at the first layer
        residual: torch.Tensor | None,  # [T, hidden]: the stream h is added to; None at the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the stream it is to be added to)
        """HF's `h = h + attn(norm(h)); h = h + mlp(norm(h))`, each add fused into the norm after it; the
        last layer's add is the final norm's (LlamaModel)."""
        if residual is None:
            residual = h
            normed = self.input_layernorm(h)
        else:
            normed, residual = self.input_layernorm.add_forward(h, residual)
        attended = self.self_attn(normed, cos, sin, kv_cache, attn, lora)
        normed, residual = self.post_attention_layernorm.add_forward(attended, residual)
        out: torch.Tensor = self.mlp(normed, lora)
        return out, residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        layers = [LlamaDecoderLayer(config, tp_rank, tp_size) for _ in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.num_kv_heads_per_rank = layers[0].self_attn.num_kv_heads
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # one cos/sin cache for all layers, gathered once per step
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        attn: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)  # HF casts cos/sin to the activation dtype too
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv_cache, attn, lora)
        if residual is None:  # no layers
            only_normed: torch.Tensor = self.norm(h)
            return only_normed
        normed, _ = self.norm.add_forward(h, residual)
        return normed


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.model = LlamaModel(config, tp_rank, tp_size)
        # tied: the head reuses the embedding parameter (never allocated twice, loaded once)
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size, shared_weight=tied)
        # what the KV cache allocator needs: one [2, num_slots, num_kv_heads_per_rank, head_dim] per layer
        self.num_kv_heads_per_rank = self.model.num_kv_heads_per_rank
        self.head_dim = config.head_dim
        self.num_layers = config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_slots, Hkv, D]
        attn: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        hidden: torch.Tensor = self.model(input_ids, positions, kv_caches, attn, lora)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors into this rank's parameters; UnsupportedModelError on missing/unexpected."""
        load_llama_weights(
            dict(self.named_parameters()),
            weights,
            tied=self.config.tie_word_embeddings,
            architecture=self.config.architecture,
        )
