"""shared.regex: Python regexes run by RE2. Oracle: Python's own `re` on the same pattern and text, for
patterns both run; the constructs RE2 cannot run are refused by name; backtracking patterns match in
time linear in the text."""

from __future__ import annotations

import random
import re
import time

import pytest

from shared.regex import MAX_PATTERN_CHARS, RegexError, compile_regex

pytestmark = pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")  # "[[:a]", as re warns

TEXTS = ["", "a", "A", "aa", "ab", "a.b", "0", "01", "1.0", "_", ":]", "[:", "a{,3}", "x{ 2}", "k", "K", "s", "S",
         "model.layers.0.self_attn.q_proj", "model.layers.12.mlp.down_proj", "lm_head", "model.embed_tokens"]

# Each reads differently in RE2's own syntax (or not at all) and means here what it means to `re`.
SPELLINGS = [
    r"a{,3}", r"a{,}", r"a{ 2}", r"[[:digit:]]", r"[[:a]*", r"[]a]", r"(?i)ſ", r"(?i)İ", "(?i)\u212a",
    r"(?x) model \. layers \. \d+ \. .*  # a comment", r".*\Z", r"(?s).", r"\v", r"[\b]", r"\u0041", r"\x41",
    r"(?a:\w)+", r"(?i:A)b", r"(?i)[a-z]+", r"[^a]", r"(?i)[^a]", r"\B", r".\B.", r"\b.*\b", r"a$", r"(?m)^a$",
    r"\A.*?\.(?P<idx>\d+)\.", r"[\d.]+", r"\W+", r"\S*", r"[\s\w]*",
    r".*\.(q|k|v)_proj", r"model\.layers\.[01]\.(self_attn\.(q|o)|mlp\.gate)_proj", r".*\.1\..*",
]


@pytest.mark.parametrize("pattern", SPELLINGS)
def test_patterns_mean_what_they_mean_to_re(pattern: str) -> None:
    ours, theirs = compile_regex(pattern), re.compile(pattern)
    for text in TEXTS:
        assert ours.fullmatch(text) == (theirs.fullmatch(text) is not None), text
        found = theirs.match(text)
        assert ours.match(text) == (None if found is None else found.groupdict()), text


ATOMS = ["a", "b", ".", r"\.", r"\d", r"\w", r"\W", "[ab]", "[^a.]", "[a-c0-2]", "0", "1", "_", "A", "(?i:a)",
         "[[:a]", "[.-9]"]
EMPTY = [r"\b", r"\B", "^", "$", r"\A", r"\Z", "(?:)"]  # items that match the empty text (where they match)
QUANTIFIERS = ["", "", "", "*", "+", "?", "*?", "+?", "??", "{2}", "{0,2}", "{1,}", "{,1}", "{1,2}?"]
SOLID = ["", "", "+", "{2}", "{1,}", "+?", "{1,2}?"]  # quantifiers that never match the empty text


def _random_pattern(rng: random.Random, depth: int = 0, *, solid: bool = False) -> str:
    """A random pattern; `solid`: one that never matches the empty text."""
    parts = []
    for _ in range(rng.randint(1, 3)):
        if depth < 2 and rng.random() < 0.25:
            quantifier = rng.choice(SOLID if solid else QUANTIFIERS)
            body = "|".join(_random_pattern(rng, depth + 1, solid=solid or quantifier != "")
                            for _ in range(rng.randint(1, 3)))
            parts.append(rng.choice(["(", "(?:", "(?i:"]) + body + ")" + quantifier)
        elif not solid and rng.random() < 0.2:
            parts.append(rng.choice(EMPTY))
        else:
            parts.append(rng.choice(ATOMS) + rng.choice(SOLID if solid else QUANTIFIERS))
    return "".join(parts)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_patterns_match_as_re_does(seed: int) -> None:
    """Random patterns over a small grammar, on random texts. Which match and groups: as `re` where no
    repeated group can match the empty text (seed 2; there `re` and RE2 may prefer different matches),
    as layers_pattern's index needs; whether there is a match: always (seed 1)."""
    rng = random.Random(seed)
    compared = 0
    for _ in range(1000):
        groups = seed == 2
        pattern = ("(?i)" if rng.random() < 0.2 else "") + _random_pattern(rng, solid=groups)
        pattern += f"(?P<idx>{_random_pattern(rng, solid=groups)})" if rng.random() < 0.5 else ""
        try:
            theirs = re.compile(pattern)
        except re.error:  # "multiple repeat" and the like: invalid here too
            with pytest.raises(RegexError, match="is invalid"):
                compile_regex(pattern)
            continue
        ours = compile_regex(pattern)
        for _ in range(12):
            text = "".join(rng.choice("ab01._A9") for _ in range(rng.randint(0, 5)))
            assert ours.fullmatch(text) == (theirs.fullmatch(text) is not None), (pattern, text)
            found, got = theirs.match(text), ours.match(text)
            assert (got is None) == (found is None), (pattern, text)
            if groups and found is not None:
                assert got == found.groupdict(), (pattern, text)
            compared += 1
    assert compared > 700 * 12


@pytest.mark.parametrize(("pattern", "named"), [
    (r"(q_proj)\1", "a backreference"),
    (r"(?P<p>q)(?P=p)", "a backreference"),
    (r"model(?=\.)", "a lookahead or lookbehind"),
    (r"(?<=layers\.)\d", "a lookahead or lookbehind"),
    (r"(?!lm_head).*", "a negative lookahead or lookbehind"),
    (r"(?<!x)y", "a negative lookahead or lookbehind"),
    (r"(a)?(?(1)b|c)", "a conditional group"),
    (r"(?>a+)b", "an atomic group"),
    (r"a*+b", "a possessive quantifier"),
    (r"a{1001}", "more than 1000 times"),
    (r"(q_proj", "is invalid (missing ), unterminated subpattern)"),
    (r"(?U)a", "is invalid"),
    ("(" * 5000 + ")" * 5000, "nests groups too deeply"),
    ("a" * (MAX_PATTERN_CHARS + 1), f"more than the {MAX_PATTERN_CHARS} accepted"),
    (r"((((a{100}){100}){100}){100})", "cannot be run by the linear-time matcher, RE2"),
])
def test_what_re2_cannot_run_is_refused_by_name(pattern: str, named: str) -> None:
    with pytest.raises(RegexError) as refused:
        compile_regex(pattern)
    assert named in str(refused.value)


def test_texts_are_ascii_module_names() -> None:
    regex = compile_regex(".*")
    for text in ("modèle.layers.0", "model\n", "a\nb"):
        with pytest.raises(ValueError, match="ASCII texts without line breaks"):
            regex.fullmatch(text)


def _seconds(pattern: str, text: str, times: int = 20) -> float:
    """The fastest of `times` matches of `text` (the least disturbed by other work on the host)."""
    regex = compile_regex(pattern)
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        regex.fullmatch(text)
        best = min(best, time.perf_counter() - start)
    return best


def test_backtracking_patterns_match_in_time_linear_in_the_text() -> None:
    # re takes seconds at 26 zeros and twice as long with each more; 52 would take years
    pattern = r"model\.layers\.(?:0|0)*1\.self_attn\.q_projX"
    key = "model.layers.{}1.self_attn.q_proj"
    assert _seconds(pattern, key.format("0" * 51)) <= 3 * _seconds(pattern, key.format("0" * 25))
    pattern = r"model\.layers\.0\.self_attn\.q_proj|(?:.|.){23}Y"
    assert _seconds(pattern, "model.layers.0.post_attention_layernorm" * 2) <= 3 * _seconds(
        pattern, "model.layers.0.post_attention_layernorm")
