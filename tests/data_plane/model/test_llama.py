"""The llama-family model against transformers' forward logits, through the paged KV cache."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from data_plane.model.attention_metadata import DecodeEntry, PrefillEntry, build_attention_metadata
from data_plane.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from data_plane.model.llama import LlamaForCausalLM
from data_plane.model.loader import load_model
from shared.errors import UnsupportedModelError
from tests.data_plane.checkpoints import write_tiny_checkpoint

FAMILIES = ["llama", "qwen2", "qwen3"]
BLOCK_SIZE = 4
NUM_BLOCKS = 32
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {
        family: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for family, path in tiny_checkpoints.items()
    }


@pytest.fixture(scope="module")
def our_models(tiny_checkpoints: dict[str, Path]) -> dict[str, LlamaForCausalLM]:
    return {family: load_model(path, "auto", CPU)[0] for family, path in tiny_checkpoints.items()}


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def _hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _kv_caches(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS * BLOCK_SIZE, model.num_kv_heads_per_rank, model.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]


@torch.no_grad()
def _step(
    model: LlamaForCausalLM,
    caches: list[torch.Tensor],
    decode: list[tuple[list[int], list[int]]] = (),  # (block table, all tokens incl. the new last one)
    prefill: list[tuple[list[int], list[int], int]] = (),  # (block table, all tokens so far, num computed)
) -> torch.Tensor:  # logits of every new token [T, V], decode tokens first
    ids, positions = [], []
    for _, tokens in decode:
        ids.append(tokens[-1])
        positions.append(len(tokens) - 1)
    for _, tokens, computed in prefill:
        ids.extend(tokens[computed:])
        positions.extend(range(computed, len(tokens)))
    attn = build_attention_metadata(
        decode=[DecodeEntry(table, len(tokens)) for table, tokens in decode],
        prefill=[PrefillEntry(table, computed, len(tokens) - computed) for table, tokens, computed in prefill],
        block_size=BLOCK_SIZE,
        device=CPU,
    )
    hidden = model(torch.tensor(ids), torch.tensor(positions), caches, attn)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(family, our_models, hf_models):
    tokens = _tokens(13)
    ours = _step(our_models[family], _kv_caches(our_models[family]), prefill=[([5, 2, 9, 30], tokens, 0)])
    torch.testing.assert_close(ours, _hf_logits(hf_models[family], tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_through_paged_cache(family, our_models, hf_models):
    model = our_models[family]
    tokens = _tokens(15, seed=1)
    expected = _hf_logits(hf_models[family], tokens)
    caches = _kv_caches(model)
    table = [11, 3, 7, 1]  # non-contiguous blocks; 15 tokens need 4 blocks of 4
    got = [_step(model, caches, prefill=[(table, tokens[:7], 0)])]
    for n in range(8, 16):
        got.append(_step(model, caches, decode=[(table, tokens[:n])]))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_equals_separate_runs(family, our_models, hf_models):
    """One step: a decode, a fresh prefill and a prefill continuing a cached prefix, against each alone."""
    model = our_models[family]
    a, b, c = _tokens(10, seed=2), _tokens(6, seed=3), _tokens(11, seed=4)
    ta, tb, tc = [4, 9, 13], [6, 2], [20, 8, 17]

    def prime(caches: list[torch.Tensor]) -> None:  # a's first 9 tokens and c's first 5 are already cached
        _step(model, caches, prefill=[(ta, a[:9], 0), (tc, c[:5], 0)])

    alone = []
    for entry in [dict(decode=[(ta, a)]), dict(prefill=[(tb, b, 0)]), dict(prefill=[(tc, c, 5)])]:
        caches = _kv_caches(model)
        prime(caches)
        alone.append(_step(model, caches, **entry))
    caches = _kv_caches(model)
    prime(caches)
    together = _step(model, caches, decode=[(ta, a)], prefill=[(tb, b, 0), (tc, c, 5)])
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)
    hf = hf_models[family]
    expected = torch.cat([_hf_logits(hf, a)[-1:], _hf_logits(hf, b), _hf_logits(hf, c)[5:]])
    torch.testing.assert_close(together, expected, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path, tiny_checkpoints, our_models):
    path = write_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded, config = load_model(path, "auto", CPU)
    assert config.architecture == "LlamaForCausalLM"
    tokens = _tokens(9)
    torch.testing.assert_close(
        _step(sharded, _kv_caches(sharded), prefill=[([1, 2, 3], tokens, 0)]),
        _step(our_models["llama"], _kv_caches(sharded), prefill=[([1, 2, 3], tokens, 0)]),
        atol=0,
        rtol=0,
    )


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_and_unexpected_tensors_are_named(tmp_path, tiny_checkpoints):
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.self_attn.k_proj.weight"]
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # legacy buffer: ignored

    path = _rewrite(tiny_checkpoints["llama"], tmp_path / "broken", edit)
    with pytest.raises(UnsupportedModelError) as err:
        load_model(path, "auto", CPU)
    assert "missing tensors: model.layers.1.self_attn.k_proj.weight" in err.value.message
    assert "unexpected tensors: model.layers.0.mlp.extra_proj.weight" in err.value.message


def test_untied_model_without_lm_head_is_refused(tmp_path, tiny_checkpoints):
    path = _rewrite(tiny_checkpoints["qwen3"], tmp_path / "headless", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(UnsupportedModelError, match="missing tensors: lm_head.weight"):
        load_model(path, "auto", CPU)


def test_tied_model_may_ship_lm_head(tmp_path, tiny_checkpoints, our_models):
    def edit(t: dict[str, torch.Tensor]) -> None:
        assert "lm_head.weight" not in t
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    model, _ = load_model(_rewrite(tiny_checkpoints["qwen2"], tmp_path / "with_head", edit), "auto", CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, our_models["qwen2"].lm_head.weight, atol=0, rtol=0)


def test_wrong_shape_names_the_tensor(tmp_path, tiny_checkpoints):
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:5].clone()

    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: shape \(5, 64\)"):
        load_model(_rewrite(tiny_checkpoints["llama"], tmp_path / "bad_shape", edit), "auto", CPU)


def test_unsupported_architecture_lists_supported(tmp_path, tiny_checkpoints):
    path = tmp_path / "gpt2"
    shutil.copytree(tiny_checkpoints["llama"], path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as err:
        load_model(path, "auto", CPU)
    assert all(arch in err.value.message for arch in SUPPORTED_ARCHITECTURES)


def test_bin_only_checkpoint_asks_for_safetensors(tmp_path, tiny_checkpoints):
    path = tmp_path / "bin"
    path.mkdir()
    shutil.copy(tiny_checkpoints["llama"] / "config.json", path)
    torch.save({}, path / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="convert them to safetensors"):
        load_model(path, "auto", CPU)


def test_bfloat16_load_is_close(tiny_checkpoints, hf_models):
    path = tiny_checkpoints["llama"]
    model, config = load_model(path, "bfloat16", CPU)
    assert config.dtype == "float32"  # the checkpoint's own dtype; the load converted it
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32
    tokens = _tokens(13)
    ours = _step(model, _kv_caches(model, torch.bfloat16), prefill=[([5, 2, 9, 30], tokens, 0)])
    assert ours.dtype == torch.float32
    # same bf16 arithmetic as transformers (bit-identical on CPU today; allow ~1 bf16 ulp at |logit| ~ 8)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    torch.testing.assert_close(ours, _hf_logits(hf_bf16, tokens), atol=0.05, rtol=0)
    expected = _hf_logits(hf_models["llama"], tokens)
    assert (ours - expected).abs().max() < 0.1 * expected.abs().max()
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.75


def test_model_exposes_kv_cache_geometry(tiny_checkpoints):
    config = ModelConfig.from_pretrained(tiny_checkpoints["qwen3"])
    model = LlamaForCausalLM(config)
    assert (model.num_layers, model.num_kv_heads_per_rank, model.head_dim) == (2, 2, 32)
