"""`loraplane demo-model --preset`: the llama-250m preset's stated shape, and a checkpoint of it (two layers
deep, the same width) that transformers and PEFT load and that greedy decoding does not collapse on."""

import os
from pathlib import Path

import pytest
import torch

from data_plane.demo.cli import main as demo_main
from data_plane.demo.presets import PRESETS, write_preset_adapters, write_preset_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PRESET = PRESETS["llama-250m"]


def test_llama_250m_is_the_stated_shape() -> None:
    s = PRESET.shape
    assert (s.hidden_size, s.intermediate_size, s.num_hidden_layers) == (1024, 2816, 16)
    assert (s.num_attention_heads, s.num_key_value_heads, PRESET.vocab_size) == (16, 4, 32000)
    assert PRESET.dtype == torch.bfloat16
    assert (PRESET.adapter.r, set(PRESET.adapter.target_modules)) == (16, {"q_proj", "k_proj", "v_proj", "o_proj"})


@pytest.fixture(scope="module")
def shallow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama")
    write_preset_model(out, PRESET.with_layers(2))
    write_preset_adapters(out, out / "adapters", PRESET.with_layers(2), count=2)
    return out


def test_transformers_loads_it_with_the_presets_shapes(shallow: Path) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(shallow, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    c = model.config
    assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == ("llama", 1024, 2816, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings) == (16, 4, 32000, False)
    assert model.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (256, 1024)
    assert model.lm_head.weight.shape == (32000, 1024)
    # at 16 layers: the 246 M parameters of the comparison with vLLM
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert round((model.num_parameters() + 14 * per_layer) / 1e6) == 246
    tokenizer = transformers.AutoTokenizer.from_pretrained(shallow)
    assert len(tokenizer) == 32000
    assert tokenizer.decode([31999]) == "<unused31999>"
    assert tokenizer.decode(tokenizer("Hello there, stars.")["input_ids"]) == "Hello there, stars."


def test_greedy_wanders_and_an_adapter_changes_it(shallow: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(shallow).eval()
    ids = torch.tensor([[(7919 * i) % 31000 + 10 for i in range(24)]])

    def greedy(m) -> list[int]:
        with torch.inference_mode():
            out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    base = greedy(model)
    assert len(set(base)) >= 12, base
    adapted = greedy(peft.PeftModel.from_pretrained(model, shallow / "adapters" / "lora-001"))
    assert adapted != base


def test_adapters_flag_needs_a_preset(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        demo_main([str(tmp_path), "--adapters", "3"])
