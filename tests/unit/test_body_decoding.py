"""Request bodies: ``Content-Encoding`` undone against the body limit, and the JSON depth
check at every position (issue 19, items 6 and 7)."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.frontends.http.body import decode_content
from router.serving.errors import ApiError
from router.serving.parsing import decode_body, too_deep


def test_a_body_inflating_to_exactly_the_limit_passes_and_one_byte_more_is_a_413() -> None:
    limit = 1 << 20
    assert decode_content(gzip.compress(b"a" * limit), "gzip", limit) == b"a" * limit
    with pytest.raises(ApiError) as err:
        decode_content(gzip.compress(b"a" * (limit + 1)), "gzip", limit)
    assert err.value.status == 413


def test_codings_are_undone_last_first_and_every_gzip_member_is_read() -> None:
    body = b'{"prompt": "x"}'
    assert decode_content(zlib.compress(gzip.compress(body)), "gzip, deflate", 100) == body
    assert decode_content(gzip.compress(body[:5]) + gzip.compress(body[5:]), "x-gzip", 100) == body
    assert decode_content(zlib.compress(body)[2:-4], "deflate", 100) == body  # raw deflate
    assert decode_content(body, "identity", 100) == body
    assert decode_content(body, "", 100) == body


@pytest.mark.parametrize(
    ("data", "coding"),
    [
        (b"plain", "gzip"),
        (gzip.compress(b"cut", mtime=0)[:-3], "gzip"),
        (b"", "deflate"),
        (b"x", "br"),
    ],
)
def test_a_body_that_does_not_decode_is_a_400(data: bytes, coding: str) -> None:
    with pytest.raises(ApiError) as err:
        decode_content(data, coding, 100)
    assert err.value.status == 400


trees = st.recursive(
    st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=20,
)


def depth_of(node: object) -> int:
    if isinstance(node, dict):
        return 1 + max((depth_of(v) for v in node.values()), default=0)
    if isinstance(node, list):
        return 1 + max((depth_of(v) for v in node), default=0)
    return 0


@given(tree=trees, limit=st.integers(min_value=2, max_value=8))
def test_too_deep_agrees_with_the_depth_at_any_position(tree: object, limit: int) -> None:
    payload = {"prompt": "x", "extra": [1, tree, 1]}
    assert too_deep(payload, limit) == (depth_of(payload) > limit)


def test_nesting_in_the_middle_of_a_scalar_list_is_seen() -> None:
    body = json.dumps({"prompt": "a", "x": [1, [[[[1]]]], 1]}).encode()
    assert decode_body(body, 6)["x"][0] == 1
    with pytest.raises(ApiError) as err:
        decode_body(body, 5)
    assert err.value.status == 400
