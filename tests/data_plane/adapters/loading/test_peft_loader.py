"""load_peft_adapter against real peft: same modules, A, B and scaling; same merged weights; every refusal."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file, save_file

from data_plane.adapters.artifacts.verified_files import VerifiedFiles
from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.adapters.loading.peft_targets import TargetSpec, module_name
from data_plane.adapters.loading.staging import TensorStage
from data_plane.demo.adapters import DEMO_ADAPTERS, write_demo_adapters
from data_plane.demo.cli import DEMO_SERVED_NAME
from data_plane.demo.cli import main as demo_main
from data_plane.lora.errors import LoRAAdapterError
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.config import ModelConfig
from shared.peft import WEIGHTS_NAME
from tests.data_plane.adapters.loading.shared_files import inside, mappings_of, own_shared_files
from tests.data_plane.checkpoints import FAMILIES
from tests.data_plane.peft_adapters import SUPPORTED_KINDS, edit_config, load_base, write_peft_adapter

PREFIX = "base_model.model."


def _load(path: Path, base: Path, *, max_rank: int = 64, roots: list[str] | None = None,
          dtype: torch.dtype = torch.float32) -> LoRAAdapterWeights:
    roots = [str(path.parent)] if roots is None else roots
    return load_peft_adapter(path, ModelConfig.from_pretrained(base), max_rank=max_rank, allowed_roots=roots,
                             dtype=dtype)


def _assert_matches_peft(ours: LoRAAdapterWeights, base: Path, adapter: Path) -> None:
    """Per module A, B and scaling equal peft's; base + scaling * B @ A equals peft's merged weight."""
    model = PeftModel.from_pretrained(load_base(base), adapter).eval()
    theirs = {name.removeprefix(PREFIX): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert ours.description.rank == max(m.r["default"] for m in theirs.values())
    ours_flat = {module_name(layer, s): w for layer, mods in ours.layers.items() for s, w in mods.items()}
    assert set(ours_flat) == set(theirs)
    for name, w in ours_flat.items():
        assert torch.equal(w.lora_a, theirs[name].lora_A["default"].weight), name
        assert torch.equal(w.lora_b, theirs[name].lora_B["default"].weight), name
        assert w.scaling == pytest.approx(theirs[name].scaling["default"], rel=1e-12), name
    merged = model.merge_and_unload().state_dict()
    original = load_base(base).state_dict()
    for key, weight in original.items():
        module = key.removesuffix(".weight")
        if module in ours_flat:
            w = ours_flat[module]
            torch.testing.assert_close(weight + w.scaling * (w.lora_b @ w.lora_a), merged[key], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(weight, merged[key]), key


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", SUPPORTED_KINDS)
def test_matches_peft(family: str, kind: str, tiny_checkpoints, peft_adapters) -> None:
    adapter = peft_adapters(family, kind)
    ours = _load(adapter, tiny_checkpoints[family])
    _assert_matches_peft(ours, tiny_checkpoints[family], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert ours.description.alpha == config["lora_alpha"] and ours.path == str(adapter.resolve())
    files = ("adapter_config.json", "adapter_model.safetensors")  # peft also writes a README.md model card
    assert ours.description.size_bytes == sum((adapter / f).stat().st_size for f in files)


@pytest.mark.parametrize(("kind", "changes"), [
    ("attention", {"fan_in_fan_out": True}),  # peft ignores it for nn.Linear: A and B keep their layout
    ("patterns", {"target_modules": "all-linear"}),
    ("layers", {"layers_to_transform": 0, "layers_pattern": None}),
    ("rslora", {"target_modules": ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate_proj",
                                   "mlp.up_proj", "down_proj"]}),
])
def test_config_spellings_match_peft(kind, changes, tiny_checkpoints, peft_adapters, tmp_path) -> None:
    adapter = shutil.copytree(peft_adapters("llama", kind), tmp_path / "adapter")
    edit_config(adapter, **changes)
    _assert_matches_peft(_load(adapter, tiny_checkpoints["llama"]), tiny_checkpoints["llama"], adapter)


MATCH_CASES = [
    dict(target_modules=["q_proj", "down_proj"]),
    dict(target_modules=["model.layers.1.self_attn.k_proj", "up_proj", "self_attn.o_proj"]),
    dict(target_modules=r".*layers\.[01]\.(self_attn\.(q|o)|mlp\.gate)_proj"),
    dict(target_modules=["q_proj", "v_proj"], layers_to_transform=1),
    dict(target_modules=["k_proj", "down_proj"], layers_to_transform=[0, 1], layers_pattern="layers"),
    dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="h"),  # matches nothing
    dict(target_modules=["q_proj", "gate_proj", "down_proj"], exclude_modules=["model.layers.0.mlp.down_proj"]),
    dict(target_modules=["q_proj", "up_proj"], exclude_modules=r".*\.1\..*"),
    dict(target_modules=["embed_tokens", "lm_head", "q_norm", "input_layernorm"]),
    # regexes run on RE2 (shared.regex) in Python's meaning, also where RE2's own syntax reads them otherwise
    dict(target_modules=r"model\.layers\.0{,1}1{,1}\.self_attn\.[qv]_proj"),
    dict(target_modules=r"(?i).*\.(Q|K)_PROJ"),
    dict(target_modules=r"(?x) .* \. (?: up | down ) _proj  # the MLP's in and out"),
    dict(target_modules=r".*\.o_pro[[:j]"),
    dict(target_modules=r".*\bmlp\b.*?_proj\Z"),
    dict(target_modules=["q_proj", "v_proj"], exclude_modules=r"(?i).*LAYERS\.1\..*"),
    dict(target_modules=["k_proj", "up_proj"], layers_to_transform=[1], layers_pattern=["lay(?:er|ers)"]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[0], layers_pattern=r"[a-z]+"),
    dict(target_modules=["q_proj", "k_proj", "up_proj", "down_proj"],
         rank_pattern={r"(?i:Q_PROJ)": 4, r"layers\.\d{,1}\.mlp\.(up|down)_proj": 12},
         alpha_pattern={r"self_attn\.[kv]_proj": 32, r"(?x: \d \. mlp \. .*)": 3}),
]
PATTERNS = {"rank_pattern": {"q_proj": 4, r"layers\.1\.mlp\.down_proj": 12, "model.layers.0.self_attn.k_proj": 2},
            "alpha_pattern": {"v_proj": 32, r".*\.0\.mlp\..*": 3}}


@pytest.mark.parametrize("case", MATCH_CASES)
def test_target_matching_equals_peft(case, tiny_checkpoints, tmp_path) -> None:
    config = LoraConfig(r=8, lora_alpha=16, **{**PATTERNS, **case})
    config.save_pretrained(tmp_path)  # the file as peft writes it, parsed as the loader parses it
    spec = TargetSpec.from_peft_config(json.loads((tmp_path / "adapter_config.json").read_text()))
    for family in ("llama", "qwen3"):
        for key, _ in load_base(tiny_checkpoints[family]).named_modules():
            if key:
                assert spec.matches(key) == bool(check_target_module_exists(config, key)), (family, key)
                r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), key), config.r)
                alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), key), 16)
                assert spec.rank_and_alpha(key) == (r, alpha), key


@pytest.mark.parametrize("kind, cause", [
    ("dora", r"DoRA \(use_dora\)"), ("embed", "LoRA on embed_tokens is not supported"),
    ("modules_to_save", "modules_to_save"),
])
def test_refuses_unsupported_peft_kinds(kind, cause, tiny_checkpoints, peft_adapters) -> None:
    with pytest.raises(LoRAAdapterError, match=cause):
        _load(peft_adapters("llama", kind), tiny_checkpoints["llama"])


def _tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(adapter: Path) -> None:
        tensors = load_file(adapter / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return apply


def _truncate(adapter: Path) -> None:
    path = adapter / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _config_text(edit: Callable[[str], str]) -> Callable[[Path], None]:
    def apply(adapter: Path) -> None:
        path = adapter / "adapter_config.json"
        path.write_text(edit(path.read_text().strip()))
    return apply


Q0 = PREFIX + "model.layers.0.self_attn.q_proj"
REFUSALS = {  # mutation of a copy of the llama "attention" adapter (r=4, q/k/v/o) -> cause in the message
    "missing config": (lambda a: (a / "adapter_config.json").unlink(), "adapter_config.json is missing"),
    "missing weights": (lambda a: (a / "adapter_model.safetensors").unlink(), "adapter_model.safetensors is missing"),
    "truncated": (_truncate, "corrupt or truncated"),
    "garbage": (lambda a: (a / "adapter_model.safetensors").write_bytes(b"\0" * 999), "corrupt or truncated"),
    "invalid json": (lambda a: (a / "adapter_config.json").write_text('{"r": 4, "secret-x'), "not valid JSON"),
    "not lora": (lambda a: edit_config(a, peft_type="IA3"), "peft_type 'IA3' is not supported"),
    "an integer of 5000 digits in the config": (_config_text(lambda t: t[:-1] + ', "x": ' + "9" * 5000 + "}"),
                                                "cannot be parsed"),
    "config nesting too deep": (_config_text(lambda t: t[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                                "cannot be parsed"),
    # non-ASCII digits: int() reads "٠" as 0, but transformers names no module so and peft loads none there
    "non-ASCII layer digits": (_tensors(lambda t: [t.update({k.replace("layers.0.", "layers.\u0660."): t.pop(k)})
                                                   for k in [k for k in t if k.startswith(Q0)]]),
                               "module model.layers.\u0660.self_attn.q_proj, which loraplane cannot adapt"),
    "bias": (lambda a: edit_config(a, bias="all"), "bias 'all' is not supported"),
    "pissa": (lambda a: edit_config(a, init_lora_weights="pissa_niter_4"), "changes the base weights"),
    "bad regex": (lambda a: edit_config(a, target_modules="(q_proj"), "regex .* is invalid"),
    "backreference": (lambda a: edit_config(a, target_modules=r"(model)\.layers\.\d\.self_attn\.[qkvo]_proj\1"),
                      r"in target_modules of adapter_config.json uses a backreference, which .*RE2, cannot run"),
    "lookahead": (lambda a: edit_config(a, layers_to_transform=[0, 1], layers_pattern="lay(?=e)ers"),
                  r"regex 'lay\(\?=e\)ers' in layers_pattern .* uses a lookahead"),
    "lookbehind": (lambda a: edit_config(a, rank_pattern={r"(?<!x)q_proj": 4}),
                   r"regex '\(\?<!x\)q_proj' in rank_pattern .* uses a negative lookahead or lookbehind"),
    "no match": (lambda a: edit_config(a, target_modules=["c_attn"]), "matches no module"),
    "norm target": (lambda a: edit_config(a, target_modules=["q_proj", "input_layernorm"]), "not a linear projection"),
    "untargeted tensor": (lambda a: edit_config(a, target_modules=["q_proj"]), "does not target"),
    "untargeted layer": (lambda a: edit_config(a, layers_to_transform=[0]), "does not target"),
    "layers out of range": (lambda a: edit_config(a, layers_to_transform=[0, 7]), "names layer 7.*has 2 layers"),
    "rank lies": (lambda a: edit_config(a, r=16), r"expected \[16, 64\]"),
    "lora_A without lora_B": (_tensors(lambda t: t.pop(Q0 + ".lora_B.weight")), "has lora_A but no lora_B"),
    "no weights for target": (_tensors(lambda t: [t.pop(Q0 + ".lora_A.weight"), t.pop(Q0 + ".lora_B.weight")]),
                              "has no weights for it"),
    "lm_head tensor": (_tensors(lambda t: t.update({PREFIX + "lm_head.lora_A.weight": torch.zeros(4, 64)})),
                       "module lm_head, which loraplane cannot adapt"),
    "layer out of range": (_tensors(lambda t: t.update({PREFIX + "model.layers.7.self_attn.q_proj.lora_A.weight":
                                                        torch.zeros(4, 64)})), "layer 7, but the base model has 2"),
    "layer of 5000 digits": (_tensors(lambda t: t.update({PREFIX + f"model.layers.{'1' * 5000}.self_attn.q_proj.lora_A"
                                                          ".weight": torch.zeros(4, 64)})), "1, but the base model has 2"),
    "dora tensor": (_tensors(lambda t: t.update({Q0 + ".lora_magnitude_vector": torch.ones(64)})), "DoRA"),
    "nan": (_tensors(lambda t: t[Q0 + ".lora_B.weight"].fill_(float("nan"))), "NaN"),
    "inf in the last layer": (_tensors(lambda t: t[PREFIX + "model.layers.1.self_attn.o_proj.lora_A.weight"][0, 1]
                                       .fill_(float("-inf"))), "NaN or infinite"),
}



@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_name_the_cause(name, tiny_checkpoints, peft_adapters, tmp_path) -> None:
    mutate, cause = REFUSALS[name]
    adapter = shutil.copytree(peft_adapters("llama", "attention"), tmp_path / "adapter")
    mutate(adapter)
    before = own_shared_files()
    with pytest.raises(LoRAAdapterError, match=cause) as exc:
        _load(adapter, tiny_checkpoints["llama"])
    assert exc.value.status_code == 400 and "secret" not in exc.value.message
    assert own_shared_files() == before  # a refusal after the host copy's file was made removes it


def test_refuses_pickle_bin(tiny_checkpoints, tmp_path) -> None:
    adapter = write_peft_adapter(tiny_checkpoints["llama"], tmp_path / "bin", "attention", safe_serialization=False)
    assert (adapter / "adapter_model.bin").is_file()
    with pytest.raises(LoRAAdapterError, match=r"pickle \.bin weights are not loaded; convert to safetensors"):
        _load(adapter, tiny_checkpoints["llama"])


def test_refuses_adapter_of_another_base(tiny_checkpoints, peft_adapters) -> None:
    # qwen3's head_dim 32 makes its k_proj 64 wide where llama's is 32 (tiny qwen2 has llama's shapes)
    with pytest.raises(LoRAAdapterError, match=r"k_proj\.lora_B\.weight has shape \[64, 4\], expected \[32, 4\]"
                                               r".*another base model"):
        _load(peft_adapters("qwen3", "attention"), tiny_checkpoints["llama"])


def test_rank_limit_is_checked_before_reading_weights(tiny_checkpoints, peft_adapters, tmp_path) -> None:
    adapter = shutil.copytree(peft_adapters("llama", "patterns"), tmp_path / "adapter")
    (adapter / "adapter_model.safetensors").write_bytes(b"not read")
    with pytest.raises(LoRAAdapterError, match=r"rank 12 \(module model\.layers\.1\.mlp\.down_proj\) exceeds "
                                               r"--max-lora-rank 8"):
        _load(adapter, tiny_checkpoints["llama"], max_rank=8)


def test_path_must_stay_inside_the_roots(tiny_checkpoints, peft_adapters, tmp_path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    adapter = shutil.copytree(peft_adapters("llama", "attention"), outside / "adapter")
    (root / "link").symlink_to(adapter, target_is_directory=True)
    inner = shutil.copytree(adapter, root / "inner")
    for candidate in (root / "link", root / ".." / "outside" / "adapter", adapter):
        with pytest.raises(LoRAAdapterError, match=rf"outside the allowed LoRA roots \({root}\)"):
            _load(candidate, tiny_checkpoints["llama"], roots=[str(root)])
    (inner / "adapter_model.safetensors").unlink()
    (inner / "adapter_model.safetensors").symlink_to(adapter / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="links outside the allowed LoRA roots"):
        _load(inner, tiny_checkpoints["llama"], roots=[str(root)])
    with pytest.raises(LoRAAdapterError, match="no LoRA roots are configured"):
        _load(adapter, tiny_checkpoints["llama"], roots=[])
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        _load(root / "nope", tiny_checkpoints["llama"], roots=[str(root)])
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        _load(inner / "adapter_config.json", tiny_checkpoints["llama"], roots=[str(root)])
    # inside via a symlinked root, and through `..` that stays inside: allowed
    assert _load(root / "x" / ".." / "link", tiny_checkpoints["llama"], roots=[str(root), str(outside)]).description.rank == 4


def test_sha256_is_content_identity(tiny_checkpoints, peft_adapters, tmp_path) -> None:
    base, src = tiny_checkpoints["llama"], peft_adapters("llama", "attention")
    first = _load(src, base)
    assert _load(src, base).description.sha256 == first.description.sha256 and len(first.description.sha256) == 64
    copy = shutil.copytree(src, tmp_path / "copy")
    assert _load(copy, base).description.sha256 == first.description.sha256  # the folder's name or place is not part of it
    _tensors(lambda t: t[Q0 + ".lora_A.weight"][0, 0].add_(1e-3))(copy)
    changed = _load(copy, base)
    assert changed.description.sha256 != first.description.sha256 and changed.cache_namespace != first.cache_namespace
    edited = shutil.copytree(src, tmp_path / "edited")
    edit_config(edited, lora_alpha=9)
    assert _load(edited, base).description.sha256 not in (first.description.sha256, changed.description.sha256)


def test_sha256_is_the_manifest_digest_the_control_plane_records(tiny_checkpoints, peft_adapters) -> None:
    from control_plane.artifacts.inspect import inspect_adapter
    from shared.manifest import files_digest

    src = peft_adapters("llama", "attention")
    ours = _load(src, tiny_checkpoints["llama"])
    assert ours.description.sha256 == files_digest([src / "adapter_config.json", src / "adapter_model.safetensors"])
    assert inspect_adapter(str(src), (str(src.parent),)).description.sha256 == ours.description.sha256
    assert ours.cache_namespace == int(ours.description.sha256[:16], 16)


def test_a_paced_read_rests_between_every_tensor_and_every_mib_and_reads_the_same(tiny_checkpoints,
                                                                                 peft_adapters) -> None:
    """An adapter reader paces its CPU while the engine serves (background.CpuPace): the loader gives it a chance
    after each tensor it reads, each it checks and copies, and each MiB it hashes."""
    base, src = tiny_checkpoints["llama"], peft_adapters("llama", "patterns")
    calls = [0]

    def pace() -> None:
        calls[0] += 1

    ours = load_peft_adapter(src, ModelConfig.from_pretrained(base), max_rank=64, allowed_roots=[str(src.parent)],
                             pace=pace)
    unpaced = _load(src, base)
    tensors = sum(2 for mods in ours.layers.values() for _ in mods)
    mib = -(-(src / WEIGHTS_NAME).stat().st_size // (1 << 20))
    assert calls[0] == 2 * tensors + mib  # read, checked and copied; hashed
    assert ours.description.sha256 == unpaced.description.sha256
    for layer, mods in unpaced.layers.items():
        for short, w in mods.items():
            assert torch.equal(ours.layers[layer][short].lora_a, w.lora_a)
            assert torch.equal(ours.layers[layer][short].lora_b, w.lora_b)


@pytest.mark.parametrize("held", [False, True], ids=["file", "held bytes"])
def test_the_host_copy_is_one_shared_file_written_once(held, tiny_checkpoints, peft_adapters, tmp_path) -> None:
    """A and B are views of the adapter's one shared-memory file (the engine core maps it as it is): no
    tensor has storage of its own, and they equal the safetensors file's; dropping the weights removes it."""
    base, adapter = tiny_checkpoints["llama"], peft_adapters("llama", "patterns")
    ours = _load_held(adapter, base, tmp_path) if held else _load(adapter, base)
    assert ours.shared is not None
    file = ours.shared.file
    ranges = mappings_of(file)
    theirs = load_file(adapter / "adapter_model.safetensors")
    storages = set()
    for layer, modules in ours.layers.items():
        for short, w in modules.items():
            key = PREFIX + module_name(layer, short)
            assert torch.equal(w.lora_a, theirs[key + ".lora_A.weight"])
            assert torch.equal(w.lora_b, theirs[key + ".lora_B.weight"])
            for t in (w.a_t, w.b_t):
                assert t.is_contiguous() and inside(t, ranges), (layer, short)
                storages.add(t.untyped_storage().data_ptr())
            assert w.lora_a.data_ptr() == w.a_t.data_ptr() and w.lora_b.data_ptr() == w.b_t.data_ptr()
    assert len(storages) == 1  # one mapping for the whole adapter
    del ours  # its views (w, t) keep their pages, not the file
    gc.collect()
    assert not os.path.exists(file)


def test_dtype_conversion(tiny_checkpoints, peft_adapters) -> None:
    ours = _load(peft_adapters("llama", "attention"), tiny_checkpoints["llama"], dtype=torch.bfloat16)
    module = ours.layers[1]["v_proj"]
    assert module.lora_a.dtype == module.lora_b.dtype == torch.bfloat16 and module.rank == 4


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`loraplane demo-model DIR`: the demo base plus its adapters under DIR/adapters."""
    out = tmp_path_factory.mktemp("demo") / "model"
    assert demo_main([str(out)]) == 0
    return out


def test_demo_model_cli_writes_adapters_once(demo_dir, capsys) -> None:
    assert sorted(p.name for p in (demo_dir / "adapters").iterdir()) == sorted(DEMO_ADAPTERS)
    before = {n: (demo_dir / "adapters" / n / "adapter_model.safetensors").read_bytes() for n in DEMO_ADAPTERS}
    shutil.rmtree(demo_dir / "adapters" / "demo-poet")
    capsys.readouterr()
    assert demo_main([str(demo_dir)]) == 0  # existing ones are left alone, the missing one comes back
    out = capsys.readouterr().out
    assert "demo-pirate exists" in out and f"wrote adapter demo-poet to {demo_dir / 'adapters' / 'demo-poet'}" in out
    after = {n: (demo_dir / "adapters" / n / "adapter_model.safetensors").read_bytes() for n in DEMO_ADAPTERS}
    assert after == before  # seeded: the rewritten one has the same bytes


def test_demo_adapters_load_here_and_in_peft_and_change_answers(demo_dir) -> None:
    base_model = load_base(demo_dir)
    prompt = torch.tensor([[17, 301, 52, 999, 8, 64, 2001]])

    def greedy(model: torch.nn.Module) -> list[int]:
        with torch.no_grad():
            out = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        return out[0, prompt.shape[1]:].tolist()

    answers = {"base": greedy(base_model)}
    for name, spec in DEMO_ADAPTERS.items():
        adapter = demo_dir / "adapters" / name
        ours = _load(adapter, demo_dir, max_rank=16)
        assert (ours.description.rank, ours.description.target_modules) == (spec.r, list(spec.target_modules))
        assert {w.scaling for mods in ours.layers.values() for w in mods.values()} == {spec.scaling}
        _assert_matches_peft(ours, demo_dir, adapter)
        answers[name] = greedy(PeftModel.from_pretrained(load_base(demo_dir), adapter).eval())
    # every adapter answers differently from the base and from each other, from the first tokens on
    assert len({tuple(a) for a in answers.values()}) == len(answers), answers


def test_demo_adapters_are_deterministic(demo_dir, tmp_path) -> None:
    again = write_demo_adapters(demo_dir, tmp_path, seed=0, base_model=DEMO_SERVED_NAME)  # as the CLI names it
    for name, path in again.items():
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            assert (path / f).read_bytes() == (demo_dir / "adapters" / name / f).read_bytes()
    other = write_demo_adapters(demo_dir, tmp_path / "seed1", seed=1, names=["demo-short"])
    assert (other["demo-short"] / "adapter_model.safetensors").read_bytes() != (
        again["demo-short"] / "adapter_model.safetensors").read_bytes()


def test_tolerates_adapter_name_in_tensor_keys(tiny_checkpoints, peft_adapters, tmp_path) -> None:
    src = peft_adapters("llama", "attention")
    adapter = shutil.copytree(src, tmp_path / "adapter")
    _tensors(lambda t: t.update({k.replace(".weight", ".default.weight"): t.pop(k) for k in list(t)}))(adapter)
    renamed, original = _load(adapter, tiny_checkpoints["llama"]), _load(src, tiny_checkpoints["llama"])
    assert torch.equal(renamed.layers[1]["o_proj"].lora_b, original.layers[1]["o_proj"].lora_b)
    _tensors(lambda t: t.update({Q0 + ".lora_A.weight": t[Q0 + ".lora_A.default.weight"].clone()}))(adapter)
    with pytest.raises(LoRAAdapterError, match="are both lora_A of model.layers.0.self_attn.q_proj"):
        _load(adapter, tiny_checkpoints["llama"])


def _load_held(adapter: Path, base: Path, root: Path, staged: bool = False,
               on_staged: Callable[[], None] = lambda: None, **kwargs) -> LoRAAdapterWeights:
    """Load `adapter`'s files from verified bytes held in memory, under a folder that is not on disk (a
    version just fetched, its cache copy not yet written): nothing may be read from the file system.
    `staged`: the weights also come with the stage a download makes (adapters/loading/staging.py), fed in pieces."""
    held = root / "fetched"
    verified = VerifiedFiles()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = bytearray((adapter / name).read_bytes())
        stage = None
        if staged and name == "adapter_model.safetensors":
            stage = TensorStage(data)
            for end in range(0, len(data), 1000):
                stage.arrived(end)
            stage.arrived(len(data))
            stage.finish()
            on_staged()
        verified.hold(held / name, hashlib.sha256(data).hexdigest(), data, stage)
    try:
        return load_peft_adapter(held, ModelConfig.from_pretrained(base), max_rank=64, allowed_roots=[str(root)],
                                 verified=verified, **kwargs)
    finally:
        verified.release_under(held)  # as the cache does once its copy is written: a stage not taken is discarded


@pytest.mark.parametrize("staged", [False, True], ids=["held", "staged"])
@pytest.mark.parametrize("kind", SUPPORTED_KINDS)
def test_held_bytes_load_as_the_files_do(kind, staged, tiny_checkpoints, peft_adapters, tmp_path) -> None:
    base, adapter = tiny_checkpoints["llama"], peft_adapters("llama", kind)
    before = own_shared_files()
    made: list[set[Path]] = []  # the files that exist once the stage is done: its own, when staged
    ours = _load_held(adapter, base, tmp_path, staged, on_staged=lambda: made.append(own_shared_files() - before))
    assert not (tmp_path / "fetched").exists()
    _assert_matches_peft(ours, base, adapter)
    assert ours.description.sha256 == _load(adapter, base).description.sha256  # the same version digest as from disk
    assert ours.shared is not None and own_shared_files() - before == {Path(ours.shared.file)}  # one host copy
    if staged:  # ... which is the stage's: the load adopted it, copying nothing
        assert made == [{Path(ours.shared.file)}]


@pytest.mark.parametrize("staged", [False, True], ids=["held", "staged"])
@pytest.mark.parametrize("name", [n for n in REFUSALS if not n.startswith("missing")])
def test_held_bytes_are_refused_for_the_same_causes(name, staged, tiny_checkpoints, peft_adapters, tmp_path) -> None:
    mutate, cause = REFUSALS[name]
    adapter = shutil.copytree(peft_adapters("llama", "attention"), tmp_path / "adapter")
    mutate(adapter)
    before = own_shared_files()
    with pytest.raises(LoRAAdapterError, match=cause):
        _load_held(adapter, tiny_checkpoints["llama"], tmp_path, staged)
    assert own_shared_files() == before  # the stage's file too: nothing is left of a refused load
