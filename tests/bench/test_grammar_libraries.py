"""bench/grammar_libraries.py: its schema and document against jsonschema, its options, and one tiny run of
llguidance end to end (the JSON's shape), in the llguidance venv the script's docstring makes or, failing
that, this interpreter when it has llguidance."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import grammar_libraries  # noqa: E402  (bench/grammar_libraries.py: a script, not a package)

SCRIPT = Path(grammar_libraries.__file__)


def llguidance_python() -> str | None:
    venv = Path(grammar_libraries.DEFAULT_PYTHON["llguidance"])
    if venv.exists():
        return str(venv)
    return sys.executable if importlib.util.find_spec("llguidance") is not None else None


@pytest.mark.parametrize("fields", [2, 6, 30])
def test_the_document_is_valid_and_another_is_not(fields: int) -> None:
    schema, doc = grammar_libraries.schema_and_document(fields)
    assert len(schema["properties"]) == fields == len(doc) and list(doc) == schema["required"]
    jsonschema.validate(doc, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "extra": 1}, schema)
    if fields == 30:
        kinds = {p.get("type") if "enum" not in p else "enum" for p in schema["properties"].values()}
        assert kinds == {"string", "enum", "integer", "array", "boolean", "number", "object"}
        assert all("maxLength" in p for p in schema["properties"].values() if p.get("type") == "string"
                   and "enum" not in p)


def test_options() -> None:
    args = grammar_libraries.parse_args([])
    assert (args.vocab_sizes, args.fields, args.repeats) == ([32000, 150000], 30, 3)
    assert args.libraries == ["llguidance", "xgrammar"]
    assert grammar_libraries.parse_args(["--libraries", "xgrammar", "llguidance"]).libraries == list(
        grammar_libraries.LIBRARIES)
    for argv in (["--fields", "1"], ["--repeats", "0"], ["--vocab-sizes", "100"], ["--libraries", "outlines"]):
        with pytest.raises(SystemExit):
            grammar_libraries.parse_args(argv)


def test_a_tiny_llguidance_run_prints_one_json_object(tmp_path: Path) -> None:
    python = llguidance_python()
    if python is None:
        pytest.skip(f"no llguidance: make {grammar_libraries.DEFAULT_PYTHON['llguidance']} "
                    "(bench/grammar_libraries.py's docstring)")
    done = subprocess.run([sys.executable, str(SCRIPT), "--libraries", "llguidance", "--llguidance-python", python,
                           "--vocab-sizes", "600", "--fields", "6", "--repeats", "1", "--corpus-mb", "0.3",
                           "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"benchmark", "cpu", "cpus", "repeats", "fields", "schema_chars", "vocabularies", "libraries"}
    assert list(out["libraries"]) == ["llguidance"] and out["vocabularies"]["600"]["path_tokens"] > 10
    lib = out["libraries"]["llguidance"]
    assert lib["install"]["own_mb"] > 1 and lib["install"]["deps"] == {} and lib["install"]["torch_mb"] is None
    figures = lib["600"]
    request = {"compile_ms", "mask_us_per_token", "mask_us_p50", "mask_us_worst", "consume_us_per_token", "request_ms"}
    assert set(figures) == {"tokenizer_ms", "allowed_tokens_mean", "same_schema_again", *request}
    assert set(figures["same_schema_again"]) == request
    assert figures["mask_us_per_token"]["median"] > 0 and 1 <= figures["allowed_tokens_mean"] < 600
