"""The shared name rule: the function and the schema pattern agree, and unsafe names are refused."""

from __future__ import annotations

import re

import msgspec
import pytest

from shared.names import ADAPTER_NAME_PATTERN, AdapterName, is_valid_name, name_problem

VALID = ["a", "demo-poet", "org/adapter", "org/team/adapter:v2", "x.y", "a..b", "_x", ":x", "-x",
         "a" * 128, "v1.0/final", "a/.b", "a/b."]
INVALID = ["", ".", "..", "../lora_stats", "a/../b", "a/./b", "./a", "/a", "a/", "a//b", "a/..", "a/.",
           ".hidden", "name\n", "na\nme", "a\0b", "a b", "a\u202eb", "a\u200fb", "é", "a" * 129, "a?x=1",
           "a#frag", "a%2e%2e", "a\\b", "\n"]


@pytest.mark.parametrize("name", VALID)
def test_valid_names_pass_both_checks(name: str) -> None:
    assert name_problem(name) is None
    assert re.search(ADAPTER_NAME_PATTERN, name)


@pytest.mark.parametrize("name", INVALID)
def test_invalid_names_fail_both_checks(name: str) -> None:
    assert not is_valid_name(name)
    assert name_problem(name)
    assert re.search(ADAPTER_NAME_PATTERN, name) is None


def test_the_pattern_is_what_msgspec_enforces() -> None:
    assert msgspec.convert("org/a", AdapterName) == "org/a"
    for bad in ("a\n", "../x", "a//b"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, AdapterName)
