"""ModelConfig parsing: hub spellings (rope_scaling) and transformers 5 spellings (rope_parameters)."""

from __future__ import annotations

import json

import pytest

from data_plane.model.config import ModelConfig
from shared.errors import UnsupportedModelError

# abridged from meta-llama/Llama-3.1-8B-Instruct/config.json
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

# abridged from Qwen/Qwen2.5-0.5B-Instruct/config.json
QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_llama31_hub_config():
    c = ModelConfig.from_dict(LLAMA31)
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (128, 8, 500000.0)
    assert c.rope_scaling == LLAMA31["rope_scaling"]
    assert (c.attention_bias, c.o_proj_bias, c.qk_norm, c.tie_word_embeddings) == (False, False, False, False)
    assert c.dtype == "bfloat16"
    assert (c.bos_token_id, c.eos_token_ids) == (128000, [128001, 128008, 128009])


def test_qwen25_hub_config_has_qkv_bias_and_no_window():
    c = ModelConfig.from_dict(QWEN25)
    assert (c.attention_bias, c.o_proj_bias, c.tie_word_embeddings) == (True, False, True)
    assert (c.head_dim, c.rope_scaling, c.sliding_window, c.eos_token_ids) == (64, None, None, [151645])


def test_transformers5_rope_parameters_spelling(tmp_path):
    raw = {k: v for k, v in LLAMA31.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    raw["rope_parameters"] = {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}
    raw["dtype"] = "float16"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = ModelConfig.from_pretrained(tmp_path)
    assert (c.rope_theta, c.rope_scaling, c.dtype) == (500000.0, LLAMA31["rope_scaling"], "float16")


def test_legacy_type_key_and_default_rope():
    c = ModelConfig.from_dict({**LLAMA31, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = ModelConfig.from_dict({**LLAMA31, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert (plain.rope_scaling, plain.rope_theta) == (None, 1e4)


def test_qwen3_qk_norm_and_explicit_head_dim():
    c = ModelConfig.from_dict({**QWEN25, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                               "head_dim": 128, "attention_bias": False})
    assert (c.qk_norm, c.head_dim, c.attention_bias, c.o_proj_bias) == (True, 128, False, False)


def test_architecture_from_model_type_when_absent():
    raw = {k: v for k, v in LLAMA31.items() if k != "architectures"}
    assert ModelConfig.from_dict(raw).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "supported: LlamaForCausalLM, MistralForCausalLM"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 5}, "not a multiple"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding-window"),
    ],
)
def test_refusals(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**LLAMA31, **change})


def test_qwen_sliding_window_in_use_is_refused():
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        ModelConfig.from_dict({**QWEN25, "use_sliding_window": True})


def test_missing_config_json(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_field_is_named():
    raw = {k: v for k, v in LLAMA31.items() if k != "intermediate_size"}
    with pytest.raises(UnsupportedModelError, match="lacks intermediate_size"):
        ModelConfig.from_dict(raw)
