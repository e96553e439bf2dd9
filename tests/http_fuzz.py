"""Hypothesis strategies for the project's HTTP surfaces, and the contract every answer keeps:
never a 5xx for bad input, and every 4xx a JSON body with a message."""

from __future__ import annotations

import json
import struct
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

JSON_TYPE = "application/json"

# Fuzzing a running service: its module-scoped services sit behind function-scoped fixtures,
# each example waits on real requests, and generated bodies may be large.
LIVE_FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
RAW_TYPE = "application/octet-stream"


def mostly(usual: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` about four times in five, so most examples get deep into the checks."""
    return st.floats(0, 1).flatmap(lambda share: odd if share > 0.8 else usual)


PRINTABLE = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
# What an HTTP client sends as a header value: requests and httpx refuse one with leading or
# trailing whitespace (requests' InvalidHeader for ' ', h11's "Illegal header value b' '")
# before a byte leaves, so such a draw would test the client, not the server.
HEADER_TEXT = PRINTABLE.map(str.strip)
# Any JSON value, NaN and Infinity included (json.dumps writes them), with huge integers.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(10**40), 10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children)
    ),
    max_leaves=60,
)
# Bodies no parser should take quietly: deep nesting, NaN, huge numbers, odd encodings.
NASTY = [
    b"[" * 100_000,
    b"[" * 3000 + b"]" * 3000,
    b'{"observation": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"stream": true, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"n": NaN}',
    b'{"n": -Infinity}',
    b'{"n": 1' + b"0" * 5000 + b"}",
    b'{"n": 1e999999}',
    b"\xff\xfe\x00",
    b"\xef\xbb\xbf{}",
    b"\x00" * 64,
    b"",
    b"null",
    b'"just a string"',
]
NASTY_BODIES = st.sampled_from(NASTY)
# One big body per kind: over the byte limit, a JSON batch past the batch limit, a raw batch
# past it.
OVERSIZED_BODIES = st.sampled_from(
    [
        b'{"observation": [' + b"0.5, " * 300_000 + b"0.5]}",
        json.dumps({"observation": [[0.1, 0.2, 0.3, 0.4]] * 5000}).encode(),
        struct.pack("<4f", 0.1, 0.2, 0.3, 0.4) * 4097,
    ]
)


def _number() -> st.SearchStrategy:
    return mostly(
        st.floats(-5, 5),
        st.floats(allow_nan=True, allow_infinity=True)
        | st.integers(-(10**40), 10**40)
        | st.sampled_from([1e39, -3.5e38, 2**63, 2**64, True, None, "1", [1.0], {}]),
    )


def observations(size: int = 4) -> st.SearchStrategy:
    """One observation or a batch, often of the right size, sometimes ragged or odd."""
    one = mostly(
        st.lists(_number(), min_size=size, max_size=size),
        st.lists(_number(), max_size=size + 3),
    )
    return mostly(one, st.lists(one, max_size=5)) | JSON_VALUES


POLICY_JSON = st.one_of(
    st.builds(lambda obs: {"observation": obs}, observations()),
    st.builds(lambda obs: {"observations": obs}, observations()),
    st.builds(
        lambda obs, extra: {**extra, "observation": obs},
        observations(),
        st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3),
    ),
    JSON_VALUES,
).map(lambda value: json.dumps(value).encode())
RAW_BODIES = mostly(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=12).map(
        lambda floats: struct.pack(f"<{len(floats)}f", *floats)
    ),
    st.binary(max_size=200),
)
POLICY_BODIES = mostly(POLICY_JSON, st.binary(max_size=500) | NASTY_BODIES | OVERSIZED_BODIES)
CONTENT_TYPES = mostly(
    st.just(JSON_TYPE),
    st.sampled_from(
        [
            RAW_TYPE,
            "missing",
            "",
            "text/plain",
            "application/json; charset=utf-8",
            "APPLICATION/JSON",
            "multipart/form-data; boundary=x",
        ]
    )
    | HEADER_TEXT,
)
METHODS = mostly(st.just("POST"), st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]))

# MLflow registry deliveries (deployments.receiver): near-valid payloads, and anything else.
_DELIVERY = st.fixed_dictionaries(
    {
        "entity": mostly(st.sampled_from(["model_version_alias", "model_version"]), JSON_VALUES),
        "action": mostly(st.sampled_from(["created", "deleted"]), JSON_VALUES),
        "timestamp": mostly(st.just("2026-01-01T00:00:00+00:00"), JSON_VALUES),
        "data": mostly(
            st.fixed_dictionaries(
                {"name": mostly(st.text(min_size=1, max_size=40), JSON_VALUES)},
                optional={
                    "alias": mostly(st.text(max_size=40), JSON_VALUES),
                    "version": mostly(st.integers(1, 10**6).map(str), JSON_VALUES),
                },
            ),
            JSON_VALUES,
        ),
    }
)
DELIVERY_BODIES = mostly(
    _DELIVERY.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=2000)
    | JSON_VALUES.map(lambda value: json.dumps(value).encode())
    | NASTY_BODIES,
)
# A delivery request's parts: "right" signs with the block's secret, "now" and "fresh" are a
# valid timestamp and a new delivery id, "missing" leaves the header out.
RECEIVER_REQUESTS = {
    "method": mostly(st.just("POST"), st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])),
    "path": mostly(
        st.just("/mlflow"), st.sampled_from(["/health", "/"]) | PRINTABLE.map("/x/".__add__)
    ),
    "body": DELIVERY_BODIES,
    "signature": mostly(st.just("right"), st.sampled_from(["wrong", "missing"]) | HEADER_TEXT),
    "timestamp": mostly(
        st.just("now"),
        st.sampled_from(["missing", "1e9", "99999999999999999999"])
        | st.integers(-(10**12), 10**12).map(str),
    ),
    "delivery_id": mostly(st.just("fresh"), st.sampled_from(["missing", ""]) | HEADER_TEXT),
    "content_type": mostly(st.just("application/json"), st.just("missing") | HEADER_TEXT),
}

# OpenAI completion bodies: the real fields with plausible, odd and hostile values.
_TEXT = mostly(st.text(min_size=1, max_size=30), JSON_VALUES)
_SAMPLING = {
    "max_tokens": mostly(st.integers(1, 4), JSON_VALUES | st.integers()),
    "max_completion_tokens": mostly(st.integers(1, 4), JSON_VALUES | st.integers()),
    "temperature": mostly(st.floats(0, 2), JSON_VALUES),
    "top_p": mostly(st.floats(0.01, 1), JSON_VALUES),
    "top_k": mostly(st.integers(-1, 50), JSON_VALUES | st.integers()),
    "seed": mostly(st.integers(0, 2**31), JSON_VALUES | st.integers()),
    "stop": mostly(st.lists(st.text(min_size=1, max_size=5), max_size=4), JSON_VALUES),
    "presence_penalty": mostly(st.floats(-2, 2), JSON_VALUES),
    "frequency_penalty": mostly(st.floats(-2, 2), JSON_VALUES),
    "min_tokens": mostly(st.integers(0, 4), JSON_VALUES | st.integers()),
    "ignore_eos": mostly(st.booleans(), JSON_VALUES),
    "n": mostly(st.just(1), JSON_VALUES),
    "stream": mostly(st.booleans(), JSON_VALUES),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_VALUES),
}
_LIMIT_FIELD = {True: "max_completion_tokens", False: "max_tokens"}  # by chat or not
_MESSAGE = mostly(
    st.fixed_dictionaries(
        {
            "role": mostly(st.sampled_from(["system", "user", "assistant"]), JSON_VALUES),
            "content": mostly(
                _TEXT,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT})),
            ),
        }
    ),
    JSON_VALUES,
)


@st.composite
def openai_requests(draw, model: str, max_tokens: int | None = None) -> tuple[str, bytes]:
    """(path, body) for the completion routes: mostly near-valid JSON objects; `max_tokens`
    caps what near-valid bodies ask to generate (a live engine's time)."""
    chat = draw(st.booleans())
    key = "messages" if chat else "prompt"
    prompt = mostly(_TEXT, st.lists(st.integers(-5, 10**6), max_size=8) | JSON_VALUES)
    given = {"messages": mostly(st.lists(_MESSAGE, min_size=1, max_size=3), JSON_VALUES)}
    given = given if chat else {"prompt": prompt}
    if max_tokens is not None:
        given[_LIMIT_FIELD[chat]] = st.integers(1, max_tokens)
    optional = {"model": mostly(st.just(model), JSON_VALUES), **_SAMPLING}
    if max_tokens is not None:
        optional = {k: v for k, v in optional.items() if k not in _LIMIT_FIELD.values()}
    near_valid = mostly(
        st.fixed_dictionaries(given, optional=optional),
        st.fixed_dictionaries(
            {k: v for k, v in given.items() if k != key}, optional={key: given[key], **optional}
        ),
    ).map(lambda body: json.dumps(body).encode())
    body = draw(
        mostly(
            near_valid,
            st.binary(max_size=300)
            | JSON_VALUES.map(lambda v: json.dumps(v).encode())
            | NASTY_BODIES,
        )
    )
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


# The figures window of a router's `GET <route>/-/status?window_s=N`: whole seconds within
# [1, 900], and what is not (signs, decimals, exponents, other digits, padding, huge numbers).
WINDOWS = mostly(
    st.integers(1, 900).map(str),
    st.sampled_from(
        ["0", "901", "-5", "+5", "1.5", "5s", "", " 5", "5 ", "1e3", "0x10", "NaN", "\u0663"]
        + ["\u00b2", "0000005", "9" * 60, "300&window_s=5", "300#x"]
    )
    | st.integers().map(str)
    | PRINTABLE,
)
STATUS_QUERIES = st.one_of(
    WINDOWS.map(lambda v: f"window_s={quote(v, safe='')}"),
    WINDOWS.map(lambda v: f"window_s={v}"),  # unencoded: '&', '#', '%' and spaces as they come
    st.lists(WINDOWS, min_size=2, max_size=3).map(
        lambda vs: "&".join(f"window_s={quote(v, safe='')}" for v in vs)
    ),
    st.tuples(PRINTABLE, WINDOWS).map(lambda p: f"{p[0]}&window%5Fs={quote(p[1], safe='')}"),
    PRINTABLE,
)


def status_window_of(url: str, default: int = 300, most: int = 900) -> int | None:
    """The window a router's `-/status` should report for the URL a client sent (its query
    parsed as Starlette parses it), or None when it must refuse it with a 400."""
    query = parse_qsl(urlsplit(url).query, keep_blank_values=True)
    return expected_window([v for k, v in query if k == "window_s"], default, most)


def expected_window(values: list[str], default: int = 300, most: int = 900) -> int | None:
    """The window_s values a query gave, as a window; None for a 400: given more than once,
    or not whole seconds (ASCII digits, at most 6 of them) within [1, `most`]."""
    if not values:
        return default
    value = values[0] if len(values) == 1 else ""
    if value.isascii() and value.isdigit() and len(value) <= 6 and 1 <= int(value) <= most:
        return int(value)
    return None


def assert_contract(status: int, body: bytes, headers: dict[str, str]) -> Any:
    """No 5xx; a 4xx is JSON with a non-empty message (`error`, or OpenAI's error.message).
    Returns the decoded JSON body."""
    assert status < 500, (status, body[:500])
    kind = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
    if status < 400:
        return json.loads(body) if kind.startswith(JSON_TYPE) else body
    assert kind.startswith(JSON_TYPE), (status, kind, body[:500])
    error = json.loads(body)["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert isinstance(message, str) and message, (status, body[:500])
    return json.loads(body)


@st.composite
def policy_requests(draw) -> tuple[str, str, bytes]:
    """(method, content type, body) for the policy route; "missing": no content-type."""
    content_type = draw(CONTENT_TYPES)
    raw = content_type == RAW_TYPE
    body = draw(mostly(RAW_BODIES, POLICY_BODIES) if raw else POLICY_BODIES)
    return draw(METHODS), content_type, body
