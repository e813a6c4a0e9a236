"""The one rule for adapter and engine names, shared by the engine, the control plane and the router.

A name is 1–128 characters of letters, digits and `._/:-`, does not start with `.` or `/`, and has no
empty, `.` or `..` path segment, so that it can never walk out of a URL path it is placed in (a name
is still quoted with `quote(name, safe='')` wherever it goes into a URL). NUL, whitespace, newlines and
bidi controls are outside the alphabet.

`ADAPTER_NAME_PATTERN` says the same for schemas (msgspec validation and the OpenAPI documents); it is
written so that Python's `re.search` and ECMAScript read it alike: `$` alone would let a trailing
newline through in Python, so newlines are refused by a lookahead first. `AdapterName` is a `str`
annotated with it, for msgspec structs and path parameters.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

MAX_NAME_LENGTH = 128
_ALPHABET = "A-Za-z0-9._/:-"
_FIRST = "A-Za-z0-9_:-"

ADAPTER_NAME_PATTERN = (
    r"^(?!.*\n)"  # no newline anywhere (Python's `$` matches before a trailing one)
    r"(?!.*//)(?!.*/$)"  # no empty segment
    r"(?!(?:.*/)?\.\.?(?:/|$))"  # no `.` or `..` segment
    rf"[{_FIRST}][{_ALPHABET}]{{0,{MAX_NAME_LENGTH - 1}}}$"
)
ADAPTER_NAME_DESCRIPTION = "1–128 of letters, digits and `._/:-`; no leading `.` or `/`; no empty, `.` or `..` segment"
AdapterName = Annotated[str, msgspec.Meta(pattern=ADAPTER_NAME_PATTERN, description=ADAPTER_NAME_DESCRIPTION)]

_FULL = re.compile(rf"[{_FIRST}][{_ALPHABET}]{{0,{MAX_NAME_LENGTH - 1}}}")


def name_problem(name: str) -> str | None:
    """Why `name` is not a valid adapter or engine name, or None when it is."""
    if not name:
        return "the name is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"the name is longer than {MAX_NAME_LENGTH} characters"
    if _FULL.fullmatch(name) is None:
        return "the name may hold only letters, digits and `._/:-`, and may not start with `.` or `/`"
    if any(segment in ("", ".", "..") for segment in name.split("/")):
        return "the name may not have an empty, `.` or `..` path segment"
    return None


def is_valid_name(name: str) -> bool:
    return name_problem(name) is None
