"""What the router reads of a request: model and stream (400s name the field), a prefix key of the prompt's
first bytes, and the client key check."""

from __future__ import annotations

import pytest

from data_plane.router.request import check_client_key, parse_head, prefix_key
from shared.errors import AuthenticationError, InvalidRequestError


@pytest.mark.parametrize(("body", "param"), [
    (b"not json", None), (b"[1, 2]", None), (b'{"prompt": "x"}', "model"), (b'{"model": 3}', "model"),
    (b'{"model": ""}', "model"), (b'{"model": "demo", "stream": "yes"}', "stream"),
])
def test_bad_bodies_are_400s_naming_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_head(body)
    assert caught.value.status_code == 400 and caught.value.param == param


def test_head_and_prefix_keys() -> None:
    head = parse_head(b'{"model": "demo", "stream": true, "prompt": "Once upon a time", "max_tokens": 3}')
    assert (head.model, head.stream) == ("demo", True)
    long_a = parse_head(b'{"model": "demo", "prompt": "' + b"x" * 300 + b'a"}')
    long_b = parse_head(b'{"model": "demo", "prompt": "' + b"x" * 300 + b'b"}')
    assert prefix_key(long_a, 256) == prefix_key(long_b, 256)  # the same first 256 bytes
    assert prefix_key(long_a, 400) != prefix_key(long_b, 400)
    other_model = parse_head(b'{"model": "other", "prompt": "' + b"x" * 300 + b'a"}')
    assert prefix_key(other_model, 256) != prefix_key(long_a, 256)
    chat = parse_head(b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}]}')
    assert prefix_key(chat, 256) is not None
    assert prefix_key(parse_head(b'{"model": "demo"}'), 256) is None


def test_client_keys() -> None:
    check_client_key(None, frozenset())  # no keys: open
    keys = frozenset({"k1", "k2"})
    check_client_key("Bearer k2", keys)
    for header in (None, "Bearer nope", "Basic k1", "k1", "Bearer "):
        with pytest.raises(AuthenticationError):
            check_client_key(header, keys)
