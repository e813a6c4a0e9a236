"""The largest page offset a listing accepts (GET /v1/adapters, GET /v1/audit): beyond any real registry
or trail, and within the database's integer (an unbounded offset overflowed it: a 500)."""

MAX_OFFSET = 1 << 31
