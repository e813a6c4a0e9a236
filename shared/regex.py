"""Python regexes from untrusted input (adapter configs), matched by RE2 in time linear in the text.

`compile_regex(pattern)` reads `pattern` with Python's own parser, so that it means exactly what it means
to `re` (flags, escapes, `{,n}`, verbose mode), and hands RE2 (google-re2) an equivalent pattern. RE2
never backtracks: no pattern can make a match take more than time linear in the text (and the pattern).
What RE2 cannot run is refused with a `RegexError` that names it: backreferences, lookahead and
lookbehind, conditional groups, atomic groups, possessive quantifiers, counted repetitions over 1000,
patterns longer than MAX_PATTERN_CHARS or too large for RE2's memory budget; so is an invalid pattern.

The texts are module names: ASCII without line breaks (`match` and `fullmatch` refuse others). On them
the translation is exact: each single-character item (a literal, `.`, a `[...]` set, `\\d`, under
case-folding or not) becomes the set of ASCII characters that Python's `re` itself matches with it;
`^`, `\\A`, `$` and `\\Z` are the text's two ends; `\\b` and `\\B` see the same word characters in both
(and `\\B`, as in `re`, never matches in the empty text). Whether a text matches is always `re`'s
answer. Which match `match` finds, and so its groups, is `re`'s too, unless a repetition whose body can
match the empty text takes part (`re` and RE2 order such a repetition's choices differently) or the group
lies inside a repetition (the two may keep different iterations' text).
Matching releases the GIL; compiling is Python work: call both off the event loop.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typeshed describes re's private modules under their public aliases (the same modules)
    import sre_constants as sre
    import sre_parse as _parser
else:
    from re import _constants as sre  # Python's regex parse tree: the opcodes of re._parser's output
    from re import _parser

import re2

MAX_PATTERN_CHARS = 65536
_MAX_COUNT = 1000  # RE2's largest counted repetition
_ASCII = "".join(map(chr, range(128)))
_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is the caller's answer, not a line on stderr

_UNSUPPORTED = {
    sre.GROUPREF: "a backreference",
    sre.GROUPREF_EXISTS: "a conditional group (?(…)…)",
    sre.ASSERT: "a lookahead or lookbehind",
    sre.ASSERT_NOT: "a negative lookahead or lookbehind",
    sre.ATOMIC_GROUP: "an atomic group (?>…)",
    sre.POSSESSIVE_REPEAT: "a possessive quantifier",
}
_CATEGORIES = {
    sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D", sre.CATEGORY_SPACE: r"\s",
    sre.CATEGORY_NOT_SPACE: r"\S", sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W",
}
_ANCHORS = {
    sre.AT_BEGINNING: r"\A", sre.AT_BEGINNING_STRING: r"\A", sre.AT_END: r"\z", sre.AT_END_STRING: r"\z",
    sre.AT_BOUNDARY: r"\b", sre.AT_NON_BOUNDARY: r"\B",
}
_NOTHING = r"[^\x00-\x{10FFFF}]"  # a set that matches no character
# the flags that decide which characters a single-character item matches (case, . and \n, \w's alphabet)
_CHAR_FLAGS = re.IGNORECASE | re.DOTALL | re.ASCII | re.UNICODE


class RegexError(ValueError):
    """The pattern is not a valid Python regex, or is one RE2 cannot run; the message says which and why,
    as a clause that follows the pattern ("uses a backreference, …")."""


class LinearRegex:
    """A compiled pattern: `re`'s meaning, RE2's linear-time matching, on ASCII texts without line breaks."""

    def __init__(self, compiled: Any, on_empty: Any, groups: dict[str, int]) -> None:
        self._compiled = compiled
        self._on_empty = on_empty  # the pattern for the empty text (where re's \B never matches)
        self._groups = groups  # Python's group names -> the numbered names given to RE2

    def fullmatch(self, text: str) -> bool:
        """Whether the whole of `text` matches, as `re.fullmatch(pattern, text)`."""
        return self._for(text).fullmatch(text) is not None

    def match(self, text: str) -> dict[str, str | None] | None:
        """The named groups of a match at the start of `text`, as `re.match(pattern, text).groupdict()`
        (but see the module's docstring); None where `re.match` finds none."""
        found = self._for(text).match(text)
        return None if found is None else {name: found.group(f"g{i}") for name, i in self._groups.items()}

    def _for(self, text: str) -> Any:
        if not text.isascii() or "\n" in text:
            raise ValueError("the linear-time matcher matches ASCII texts without line breaks only")
        return self._compiled if text else self._on_empty


def compile_regex(pattern: str) -> LinearRegex:
    """`pattern` (Python syntax) compiled for RE2, or RegexError."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RegexError(f"is {len(pattern)} characters long, more than the {MAX_PATTERN_CHARS} accepted")
    try:
        parsed = _parser.parse(pattern)
    except re.error as exc:
        raise RegexError(f"is invalid ({exc.msg})") from None
    except RecursionError:
        raise RegexError("nests groups too deeply") from None
    compiled = _re2(parsed, empty_text=False)
    # \B is the only item whose meaning depends on the whole text's being empty
    on_empty = _re2(parsed, empty_text=True) if r"\B" in compiled.pattern else compiled
    return LinearRegex(compiled, on_empty, dict(parsed.state.groupdict))


def _re2(parsed: Any, empty_text: bool) -> Any:
    try:
        translated = _items(parsed.data, parsed.state.flags, empty_text)
    except RecursionError:
        raise RegexError("nests groups too deeply") from None
    try:
        return re2.compile(translated, _OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise RegexError(f"cannot be run by the linear-time matcher, RE2 ({reason})") from None


def _items(items: list[tuple[Any, Any]], flags: int, empty_text: bool) -> str:
    return "".join(_item(op, av, flags, empty_text) for op, av in items)


def _item(op: Any, av: Any, flags: int, empty_text: bool) -> str:
    if op in _UNSUPPORTED:
        raise RegexError(f"uses {_UNSUPPORTED[op]}, which the linear-time matcher, RE2, cannot run")
    if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
        return _ascii_class(_python_source(op, av), flags & _CHAR_FLAGS)
    if op is sre.BRANCH:
        return "(?:" + "|".join(_items(branch, flags, empty_text) for branch in av[1]) + ")"
    if op is sre.SUBPATTERN:
        group, add_flags, del_flags, body = av
        inner = _items(body, _scoped_flags(flags, add_flags, del_flags), empty_text)
        return f"(?P<g{group}>{inner})" if group is not None else f"(?:{inner})"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        low, high, body = av
        if low > _MAX_COUNT or (high != sre.MAXREPEAT and high > _MAX_COUNT):
            raise RegexError(f"repeats something more than {_MAX_COUNT} times, RE2's limit")
        count = f"{{{low},}}" if high == sre.MAXREPEAT else f"{{{low},{high}}}"
        return f"(?:{_items(body, flags, empty_text)}){count}" + ("?" if op is sre.MIN_REPEAT else "")
    if op is sre.AT:
        return _NOTHING if empty_text and av is sre.AT_NON_BOUNDARY else _ANCHORS[av]
    raise RegexError(f"uses {op}, which the linear-time matcher does not translate")


def _scoped_flags(flags: int, add_flags: int, del_flags: int) -> int:
    """The flags inside `(?aiLmsux-imsx:…)`, as Python's compiler combines them."""
    if add_flags & _parser.TYPE_FLAGS:
        flags &= ~_parser.TYPE_FLAGS
    return (flags | add_flags) & ~del_flags


def _python_source(op: Any, av: Any) -> str:
    """A single-character item back in Python syntax, every character escaped as \\U…."""
    if op is sre.LITERAL:
        return _char(av)
    if op is sre.NOT_LITERAL:
        return f"[^{_char(av)}]"
    if op is sre.ANY:
        return "."
    parts = []
    for kind, value in av:
        if kind is sre.NEGATE:
            parts.append("^")
        elif kind is sre.LITERAL:
            parts.append(_char(value))
        elif kind is sre.RANGE:
            parts.append(f"{_char(value[0])}-{_char(value[1])}")
        elif kind is sre.CATEGORY:
            parts.append(_CATEGORIES[value])
        else:
            raise RegexError(f"uses {kind} in a character set, which the linear-time matcher does not translate")
    return "[" + "".join(parts) + "]"


def _char(code: int) -> str:
    return f"\\U{code:08x}"


@functools.lru_cache(maxsize=4096)
def _ascii_class(source: str, flags: int) -> str:
    """The RE2 set of the ASCII characters that `source`, one character wide, matches in Python's `re`."""
    codes = [ord(c) for c in re.findall(source, _ASCII, flags)]
    if not codes:
        return _NOTHING
    runs: list[list[int]] = []
    for code in codes:
        if runs and runs[-1][1] == code - 1:
            runs[-1][1] = code
        else:
            runs.append([code, code])
    return "[" + "".join(f"\\x{lo:02x}" if lo == hi else f"\\x{lo:02x}-\\x{hi:02x}" for lo, hi in runs) + "]"
