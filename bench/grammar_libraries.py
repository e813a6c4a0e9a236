"""The two grammar engines for structured outputs, llguidance and xgrammar, on one JSON schema and one
tokenizer: compile time, the time to fill the next-token bitmask per token along a fixed valid document,
and install size. Prints one JSON object; progress on stderr.

    .venv/bin/python bench/grammar_libraries.py [--vocab-sizes 32000 150000] [--fields 30] [--repeats 3]
        [--libraries llguidance xgrammar] [--llguidance-python P] [--xgrammar-python P]

Each library runs in its own venv, never in .venv (xgrammar pulls torch, transformers and triton); make
them once, outside the repository (pip uses the configured registry; torch as the Makefile pins it):

    python3.11 -m venv /tmp/gl-venv && /tmp/gl-venv/bin/pip install llguidance
    python3.11 -m venv /tmp/xg-venv && /tmp/xg-venv/bin/pip install "torch==2.13.0" xgrammar

The tokenizers are byte-level BPEs with the demo tokenizer's pipeline (data_plane/demo/tokenizer_builder.py)
trained offline on this Python's standard library sources, one per --vocab-sizes, cached in --cache-dir,
padded with `<unused{id}>` tokens as the demo's is where the sources run out of merges (`padding_tokens`);
both libraries load the same tokenizer.json. The schema has --fields properties (bounded strings, enums,
bounded integers, bounded arrays, booleans, numbers and one nested object; all required, no others), the
document is a fixed valid instance of it, and its BPE tokens then the end-of-turn token are the path. A run
is one fresh process of one library at one vocabulary, set up as vLLM's backends are (flexible whitespace,
a new matcher per request): it loads the tokenizer (`tokenizer_ms`), then serves one request: compiles the
schema (`compile_ms`: xgrammar's GrammarCompiler.compile_json_schema, llguidance's grammar_from_json_schema
and LLMatcher construction) and walks the path: before each token it fills the bitmask
(`mask_us_per_token`, the mean over the path; `mask_us_p50` the median token, `mask_us_worst` the slowest),
checks that the token is allowed, and consumes it (`consume_us_per_token`). `request_ms` is compile plus the
whole walk. `same_schema_again` is a second such request in the same process (xgrammar's compiler cache
then holds the schema). Runs alternate the libraries' order each repeat; figures are medians over
--repeats with their range.
`allowed_tokens_mean` (the mean count of allowed tokens per step) is the same for both when they enforce
the same language. `install` is the library's own files (its RECORD) and the dependencies it pulls into a
fresh venv, not counting torch and what torch itself pulls (`torch_mb`, reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = ("llguidance", "xgrammar")
DEFAULT_PYTHON = {"llguidance": "/tmp/gl-venv/bin/python", "xgrammar": "/tmp/xg-venv/bin/python"}
EOS = "<|im_end|>"  # data_plane.demo.tokenizer_builder.IM_END (the worker cannot import the repository)
WORDS = ("release", "notes", "for", "the", "quarterly", "review", "of", "the", "storage", "cluster", "include",
         "latency", "budget", "owner", "migration", "plan", "rollback", "window", "and", "the", "summary", "of",
         "every", "incident")
# the kinds of the top-level properties, cycled; the last property is the nested object
KINDS = ("string", "enum", "integer", "string", "array", "integer", "enum", "boolean", "string", "number")
LEVELS = ("low", "medium", "high", "critical", "unknown")


def progress(message: str) -> None:
    print(f"[grammar_libraries] {message}", file=sys.stderr, flush=True)


def spread(values: list[float], digits: int = 2) -> dict[str, float]:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


# --- the schema and its document -------------------------------------------------------------------------

def words(start: int, max_length: int) -> str:
    """WORDS from `start` on, joined by spaces, as many as fit in max_length characters."""
    text = ""
    for k in range(len(WORDS)):
        longer = f"{text} {WORDS[(start + k) % len(WORDS)]}".strip()
        if len(longer) > max_length:
            break
        text = longer
    return text


def property_schema(kind: str, i: int) -> dict[str, Any]:
    if kind == "string":
        return {"type": "string", "maxLength": 16 + 8 * (i % 4)}
    if kind == "enum":
        return {"type": "string", "enum": list(LEVELS[: 3 + i % 3])}
    if kind == "integer":
        return {"type": "integer", "minimum": -10 * (i % 3), "maximum": 100 * (i + 1)}
    if kind == "array":
        return {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3 + i % 3}
    return {"type": kind}


def property_value(kind: str, i: int, schema: dict[str, Any]) -> Any:
    if kind == "string":
        return words(i, schema["maxLength"])
    if kind == "enum":
        return schema["enum"][i % len(schema["enum"])]
    if kind == "integer":
        return schema["minimum"] + (37 * i) % (schema["maximum"] - schema["minimum"] + 1)
    if kind == "array":
        return [words(i + k, 12) for k in range(1 + i % schema["maxItems"])]
    if kind == "boolean":
        return i % 2 == 0
    return round(0.25 * i + 0.5, 2)


def nested_schema() -> dict[str, Any]:
    props = {"name": {"type": "string", "maxLength": 32}, "count": {"type": "integer", "minimum": 0, "maximum": 1000},
             "level": {"type": "string", "enum": list(LEVELS)},
             "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
             "active": {"type": "boolean"}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def schema_and_document(fields: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of `fields` properties (the last one the nested object) and a valid document, in its order."""
    props: dict[str, Any] = {}
    doc: dict[str, Any] = {}
    for i in range(fields - 1):
        kind = KINDS[i % len(KINDS)]
        name = f"{kind}_{i}"
        props[name] = property_schema(kind, i)
        doc[name] = property_value(kind, i, props[name])
    props["nested"] = nested_schema()
    doc["nested"] = {"name": words(3, 32), "count": 512, "level": "high", "tags": ["owner", "plan"], "active": True}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return schema, doc


# --- tokenizers ------------------------------------------------------------------------------------------

def corpus(megabytes: float) -> list[str]:
    """The non-empty lines of this Python's standard library sources, files in path order, up to `megabytes`."""
    stdlib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    budget, lines = int(megabytes * 1e6), []
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        lines += [line for line in text.splitlines() if line.strip()]
        budget -= len(text)
        if budget <= 0:
            break
    return lines


def tokenizer_file(vocab_size: int, corpus_mb: float, cache_dir: Path) -> Path:
    """tokenizer.json of a BPE of vocab_size tokens, trained (or taken from cache_dir); padded as the demo
    tokenizer is when the corpus runs out of merges first."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    path = cache_dir / f"bpe-{vocab_size}-stdlib{version}-{corpus_mb:g}mb.json"
    if path.exists():
        return path
    from data_plane.demo.tokenizer_builder import padded, train_bpe  # the worker processes never get here

    progress(f"training a {vocab_size}-token BPE on {corpus_mb:g} MB of the standard library (cached: {path})")
    tok = train_bpe(corpus(corpus_mb), vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(padded(tok.to_str(), vocab_size), encoding="utf-8")
    return path


def unused_tokens(tokenizer_json: Path) -> int:
    """How many of the tokenizer's tokens are padding, which no text encodes to."""
    vocab = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["vocab"]
    return sum(1 for token in vocab if token.startswith("<unused"))


def token_path(tokenizer_json: Path, document: str) -> list[int]:
    """The document's BPE tokens, then the end-of-turn token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = tok.encode(document, add_special_tokens=False).ids
    if tok.decode(ids) != document:
        raise RuntimeError("the tokenizer does not round-trip the document")
    return [*ids, tok.token_to_id(EOS)]


# --- one run, in the library's venv (standard library and the library only) ------------------------------

def allowed_count(words32: list[int], vocab_size: int) -> int:
    full, rest = divmod(vocab_size, 32)
    count = sum((w & 0xFFFFFFFF).bit_count() for w in words32[:full])
    return count + ((words32[full] & ((1 << rest) - 1)).bit_count() if rest else 0)


def is_allowed(words32: list[int], token: int) -> bool:
    return bool((words32[token >> 5] >> (token & 31)) & 1)


def walk(fill: Any, read: Any, consume: Any, path: list[int], vocab_size: int) -> dict[str, Any]:
    """Before each token of path: fill the mask (timed), check the token is allowed, consume it (timed)."""
    mask_ns, consume_ns, allowed = [], [], []
    for step, token in enumerate(path):
        start = time.perf_counter_ns()
        fill()
        mask_ns.append(time.perf_counter_ns() - start)
        words32 = read()
        allowed.append(allowed_count(words32, vocab_size))
        if not is_allowed(words32, token):
            raise RuntimeError(f"token {token} (step {step} of {len(path)}) is masked out")
        start = time.perf_counter_ns()
        if not consume(token):
            raise RuntimeError(f"token {token} (step {step} of {len(path)}) was refused")
        consume_ns.append(time.perf_counter_ns() - start)
    return {"mask_ns": mask_ns, "consume_ns": consume_ns, "allowed_mean": statistics.mean(allowed)}


def llguidance_requests(job: dict[str, Any]) -> tuple[str, float, Any]:
    """llguidance's version, its tokenizer's load time (s), and one request: compile the schema, walk the path."""
    import ctypes
    import importlib.metadata

    import llguidance

    vocab_size, path = job["vocab_size"], job["path"]
    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(Path(job["tokenizer"]).read_text(encoding="utf-8"), n_vocab=vocab_size,
                                       eos_token=path[-1])
    tokenizer_s = time.perf_counter() - start
    mask = (ctypes.c_int32 * ((vocab_size + 31) // 32))()
    address, size = ctypes.addressof(mask), ctypes.sizeof(mask)

    def request() -> dict[str, Any]:
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(job["schema"], defaults={"whitespace_flexible": True})
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        compile_s = time.perf_counter() - start
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        walked = walk(lambda: matcher.unsafe_compute_mask_ptr(address, size), lambda: list(mask),
                      matcher.consume_token, path, vocab_size)
        if not matcher.is_stopped():
            raise RuntimeError("the matcher did not stop at the end-of-turn token")
        return {"compile_s": compile_s, **walked}

    return importlib.metadata.version("llguidance"), tokenizer_s, request


def xgrammar_requests(job: dict[str, Any]) -> tuple[str, float, Any]:
    """xgrammar's version, its tokenizer's load time (s), and one request: compile the schema, walk the path."""
    import importlib.metadata

    import xgrammar
    from transformers import PreTrainedTokenizerFast

    vocab_size, path = job["vocab_size"], job["path"]
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=job["tokenizer"], eos_token=EOS)
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[path[-1]])
    compiler = xgrammar.GrammarCompiler(info, max_threads=8, cache_enabled=True)
    tokenizer_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def request() -> dict[str, Any]:
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(job["schema"]), any_whitespace=True)
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - start
        walked = walk(lambda: matcher.fill_next_token_bitmask(bitmask), lambda: bitmask[0].tolist(),
                      matcher.accept_token, path, vocab_size)
        if not matcher.is_terminated():
            raise RuntimeError("the matcher did not terminate at the end-of-turn token")
        return {"compile_s": compile_s, **walked}

    return importlib.metadata.version("xgrammar"), tokenizer_s, request


def worker(library: str, job_file: str) -> None:
    job = json.loads(Path(job_file).read_text(encoding="utf-8"))
    version, tokenizer_s, request = (llguidance_requests if library == "llguidance" else xgrammar_requests)(job)
    print(json.dumps({"version": version, "tokenizer_s": tokenizer_s, "first": request(), "again": request()}))


# --- the parent: runs, install sizes, the report ----------------------------------------------------------

def one_run(python: str, library: str, job_file: Path) -> dict[str, Any]:
    """One fresh process of `library` on the job; isolated (-I) so the repository shadows nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([python, "-I", str(Path(__file__).resolve()), "--worker", library, str(job_file)],
                          capture_output=True, text=True, env=env, cwd=job_file.parent, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{library} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def site_packages(python: str) -> Path:
    out = subprocess.run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


def install_size(python: str, library: str) -> dict[str, Any]:
    """MB on disk of the library's files and of its dependency closure less torch's, from the venv's RECORDs."""
    from importlib.metadata import Distribution, distributions

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dists: dict[str, Distribution] = {canonicalize_name(d.metadata["Name"]): d
                                      for d in distributions(path=[str(site_packages(python))])}

    def closure(root: str) -> set[str]:
        seen: set[str] = set()
        todo: list[tuple[str, tuple[str, ...]]] = [(canonicalize_name(root), ())]
        while todo:
            name, extras = todo.pop()
            if name not in dists or (name in seen and not extras):
                continue
            seen.add(name)
            for text in dists[name].requires or []:
                req = Requirement(text)
                if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                    todo.append((canonicalize_name(req.name), tuple(sorted(req.extras))))
        return seen

    def megabytes(name: str) -> float:
        files = dists[name].files or []
        return sum(p.stat().st_size for f in files if (p := Path(str(dists[name].locate_file(f)))).is_file()) / 1e6

    own = canonicalize_name(library)
    torch = closure("torch")
    deps = sorted(closure(library) - {own} - torch)
    sizes = {name: round(megabytes(name), 1) for name in deps}
    own_mb, deps_mb = megabytes(own), sum(megabytes(name) for name in deps)
    return {"own_mb": round(own_mb, 1), "deps_mb": round(deps_mb, 1), "total_mb": round(own_mb + deps_mb, 1),
            "deps": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
            "torch_mb": round(sum(megabytes(n) for n in torch), 1) if "torch" in closure(library) else None}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def request_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges over the runs of one request each (compile and walk)."""
    return {"compile_ms": spread([r["compile_s"] * 1e3 for r in runs]),
            "mask_us_per_token": spread([statistics.mean(r["mask_ns"]) / 1e3 for r in runs]),
            "mask_us_p50": spread([statistics.median(r["mask_ns"]) / 1e3 for r in runs]),
            "mask_us_worst": spread([max(r["mask_ns"]) / 1e3 for r in runs]),
            "consume_us_per_token": spread([statistics.mean(r["consume_ns"]) / 1e3 for r in runs]),
            "request_ms": spread([r["compile_s"] * 1e3 + (sum(r["mask_ns"]) + sum(r["consume_ns"])) / 1e6
                                  for r in runs])}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One library at one vocabulary: its first request after the tokenizer loads, and the same schema again."""
    return {"tokenizer_ms": spread([r["tokenizer_s"] * 1e3 for r in runs]),
            **request_figures([r["first"] for r in runs]),
            "allowed_tokens_mean": round(statistics.mean(r["first"]["allowed_mean"] for r in runs), 1),
            "same_schema_again": request_figures([r["again"] for r in runs])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 150000])
    parser.add_argument("--fields", type=int, default=30, help="top-level properties of the schema")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument("--llguidance-python", default=DEFAULT_PYTHON["llguidance"])
    parser.add_argument("--xgrammar-python", default=DEFAULT_PYTHON["xgrammar"])
    parser.add_argument("--corpus-mb", type=float, default=40.0, help="standard library source to train on")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".loraplane" / "grammar-bench")
    args = parser.parse_args(argv)
    if args.fields < 2 or args.repeats < 1 or min(args.vocab_sizes) < 300:
        parser.error("--fields must be >= 2, --repeats >= 1, --vocab-sizes >= 300 (the 256 bytes and more)")
    args.libraries = [lib for lib in LIBRARIES if lib in args.libraries]
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    pythons = {lib: getattr(args, f"{lib}_python") for lib in args.libraries}
    for lib, python in pythons.items():
        if not Path(python).exists():
            sys.exit(f"no python at {python} for {lib}: make its venv (see this script's docstring)")
    schema, doc = schema_and_document(args.fields)
    document = json.dumps(doc)
    vocabularies: dict[str, Any] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {lib: {} for lib in args.libraries}
    with tempfile.TemporaryDirectory(prefix="grammar-bench-") as tmp:
        jobs = {}
        for vocab in args.vocab_sizes:
            tokenizer = tokenizer_file(vocab, args.corpus_mb, args.cache_dir)
            path = token_path(tokenizer, document)
            jobs[vocab] = Path(tmp) / f"job-{vocab}.json"
            jobs[vocab].write_text(json.dumps({"tokenizer": str(tokenizer), "vocab_size": vocab, "schema": schema,
                                               "path": path}), encoding="utf-8")
            vocabularies[str(vocab)] = {"path_tokens": len(path), "document_chars": len(document),
                                        "padding_tokens": unused_tokens(tokenizer)}
        for repeat in range(args.repeats):
            order = args.libraries if repeat % 2 == 0 else args.libraries[::-1]
            for lib in order:
                for vocab in args.vocab_sizes:
                    progress(f"repeat {repeat + 1}/{args.repeats}: {lib} at {vocab} tokens")
                    runs[lib].setdefault(str(vocab), []).append(one_run(pythons[lib], lib, jobs[vocab]))
    libraries: dict[str, Any] = {}
    for lib in args.libraries:
        progress(f"install size of {lib}")
        libraries[lib] = {"version": runs[lib][str(args.vocab_sizes[0])][0]["version"], "python": pythons[lib],
                          "install": install_size(pythons[lib], lib),
                          **{vocab: summary(r) for vocab, r in runs[lib].items()}}
    print(json.dumps({"benchmark": "grammar_libraries", "cpu": cpu_model(), "cpus": len(os.sched_getaffinity(0)),
                      "repeats": args.repeats, "fields": args.fields, "schema_chars": len(json.dumps(schema)),
                      "vocabularies": vocabularies, "libraries": libraries}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
