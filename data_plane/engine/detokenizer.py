"""Incremental detokenization: turn a growing list of output ids into text deltas.

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and decoding the
whole output every step is quadratic. As in vLLM, each step decodes only a short window: the ids
from `prefix_offset` (the start of the last emitted piece) to the end, compares it with the window
already emitted ([prefix_offset:read_offset]) and emits the difference. Text ending in U+FFFD is
held back because the last token may stop in the middle of a multi-byte UTF-8 character.

Invariant: read_offset is always a position after which decoding starts afresh (the text up to it
ended on a complete character), so the concatenation of all emitted pieces equals
tokenizer.decode(all_output_ids) once the final call is made with flush=True.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def detokenize_incrementally(
    tokenizer: _Decoder,
    all_output_ids: list[int],
    prefix_offset: int,
    read_offset: int,
    skip_special_tokens: bool,
    flush: bool = False,
) -> tuple[str, int, int]:
    """Return (new_text, new_prefix_offset, new_read_offset) for the ids appended since the last call.

    Start a sequence with prefix_offset = read_offset = 0 and feed back the returned offsets.
    flush=True (on the sequence's final step) also emits held-back text, e.g. a trailing
    incomplete UTF-8 sequence that no later token will complete.
    """
    prefix_text = tokenizer.decode(
        all_output_ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens
    )
    window_text = tokenizer.decode(all_output_ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    stable = not window_text.endswith(REPLACEMENT_CHAR)
    if len(window_text) > len(prefix_text) and (stable or flush):
        # [prefix_offset:read_offset] ends on a character boundary, so its text is a prefix of the window's.
        return window_text[len(prefix_text) :], read_offset, len(all_output_ids)
    return "", prefix_offset, read_offset
