import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_plane.demo.cli import main as demo_main
from data_plane.demo.model_builder import write_demo_model
from data_plane.tokenizer import Tokenizer
from shared.cli import main as cli_main

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
ENCODE_SAMPLES = [
    "Hello, world! How are you today?",
    "The 3 planets: Mars, Venus and Jupiter (2024).",
    "  leading spaces\n\ttabs\r\nand CRLF",
    "I'M sure it's fine, they'll see.",
    "Ünïcödé café, 你好，世界 🎉🚀",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return {'a': [x * 2]}",
]


@pytest.fixture(scope="module")
def hf_tokenizer(demo_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def hf_model(demo_model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, output_loading_info=True)
    return model.eval(), info


def test_writes_qwen2_config(demo_model_dir: Path) -> None:
    assert sorted(p.name for p in demo_model_dir.iterdir()) == sorted(FILES)
    config = json.loads((demo_model_dir / "config.json").read_text())
    tok = Tokenizer.from_pretrained(demo_model_dir)
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (4, 256, 768)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    assert config["vocab_size"] == tok.vocab_size and 3500 <= tok.vocab_size <= 4096
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    generation = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {
        tok.token_to_id("<|im_end|>"),
        tok.token_to_id("<|endoftext|>"),
    }


def test_tensor_names_and_shapes(demo_model_dir: Path) -> None:
    tensors = load_file(demo_model_dir / "model.safetensors")
    assert "lm_head.weight" not in tensors  # tied
    assert tensors["model.embed_tokens.weight"].shape == (4096, 256)
    assert tensors["model.layers.3.self_attn.k_proj.weight"].shape == (64, 256)  # 2 kv heads x 32
    assert tensors["model.layers.0.self_attn.q_proj.bias"].shape == (256,)
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_loads_in_transformers_without_missing_keys(hf_model) -> None:
    model, info = hf_model
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("text", ENCODE_SAMPLES)
def test_encode_matches_transformers(demo_model_dir: Path, hf_tokenizer, text: str) -> None:
    ours = Tokenizer.from_pretrained(demo_model_dir)
    assert ours.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    demo_model_dir: Path, hf_tokenizer, add_generation_prompt: bool
) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And of "}, {"type": "text", "text": "Italy?"}],
        },
    ]
    ours = Tokenizer.from_pretrained(demo_model_dir).apply_chat_template(messages, add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == expected
    assert ours.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_same_seed_is_byte_identical_other_seed_differs(tmp_path: Path) -> None:
    a, b, c = (write_demo_model(tmp_path / name, seed=seed) for name, seed in [("a", 7), ("b", 7), ("c", 8)])
    for pa, pb, pc in zip(a, b, c, strict=True):
        assert pa.read_bytes() == pb.read_bytes(), pa.name
        if pa.name == "model.safetensors":
            assert pa.read_bytes() != pc.read_bytes()
        else:  # only the weights depend on the seed
            assert pa.read_bytes() == pc.read_bytes(), pa.name


def test_greedy_generation_does_not_collapse(hf_model, hf_tokenizer) -> None:
    model, _ = hf_model
    for prompt in [
        "The weather today is",
        "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n",
    ]:
        input_ids = torch.tensor([hf_tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(input_ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        new_tokens = out[0, input_ids.shape[1] :].tolist()
        assert len(new_tokens) == 32
        assert len(set(new_tokens)) >= 8, new_tokens


def test_runtime_modules_do_not_import_transformers() -> None:
    code = (
        "import sys, data_plane.demo.model_builder, data_plane.demo.cli, data_plane.tokenizer, "
        "data_plane.engine.detokenizer; assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


def test_demo_cli_writes_skips_and_forces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"
    assert demo_main([str(out), "--seed", "3"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    first = (out / "model.safetensors").read_bytes()

    assert demo_main([str(out), "--seed", "4"]) == 0  # exists: left alone
    assert "exists" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == first

    assert demo_main([str(out), "--seed", "4", "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() != first


def test_demo_adapters_name_the_demo_engines_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A copy of a demo adapter uploaded anywhere names the base model as the demo engine serves it
    (`demo`), not the folder it was written beside (a relative path that matched no engine)."""
    assert demo_main([str(tmp_path / "model")]) == 0
    capsys.readouterr()
    for folder in (tmp_path / "model" / "adapters").iterdir():
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "demo", folder


def test_loraplane_dispatches_demo_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo-model", str(tmp_path / "m")])
    assert exc.value.code == 0
    assert (tmp_path / "m" / "config.json").is_file()
    capsys.readouterr()

    with pytest.raises(SystemExit) as exc:
        cli_main(["--help"])
    assert exc.value.code == 0
    usage = capsys.readouterr().out
    assert all(name in usage for name in ("engine", "control", "demo-model"))

    with pytest.raises(SystemExit) as exc:
        cli_main(["no-such-command"])
    assert exc.value.code == 2
    assert "unknown command" in capsys.readouterr().err
