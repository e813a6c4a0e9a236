"""A request's output constraint as plain text: what the grammar cache is keyed by (torch- and library-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """kind: which of vLLM's structured_outputs fields; text: the JSON schema (compact JSON text), the
    regular expression, the choices (a JSON array of strings), the grammar (Lark), or "" for json_object."""

    kind: ConstraintKind
    text: str
