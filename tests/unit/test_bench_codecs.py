"""The JSON benchmark's payloads and timing helper (router/bench/codecs.py)."""

from __future__ import annotations

import json

from router.bench import codecs


def test_payloads_have_the_sizes_they_claim() -> None:
    text = codecs.completion_text_body()["prompt"]
    assert 2000 <= len(text.split()) <= 2300  # punctuation may stand alone
    assert '"' in text and "\n" in text and any(ord(c) > 127 for c in text)
    assert len(codecs.chat_body()["messages"]) == 9
    assert len(codecs.token_ids_body()["prompt"]) == 8192
    assert codecs.completion_text_body() == codecs.completion_text_body()  # deterministic


def test_cases_agree_across_libraries() -> None:
    libs, missing = codecs.available()
    assert {"json", "msgspec"} <= set(libs)
    assert set(libs) | set(missing) == set(codecs.LIBRARIES)
    cases = codecs.cases(libs)  # raises if any two libraries disagree
    assert [c.op for c in cases].count("decode") == 4
    for case in cases:
        assert set(case.calls) == set(libs)


def test_per_call_and_table() -> None:
    runs = codecs.per_call_us(lambda: json.dumps([1, 2, 3]), repeat=3, budget_s=0.001)
    assert len(runs) == 3 and all(r > 0 for r in runs)
    rows = [{"case": "x", "op": "decode", "bytes": 1234, "us": {"json": 4.0, "msgspec": 2.0}}]
    table = codecs.format_table(rows, {"orjson": "not importable"})
    assert "2.00x" in table and "1,234" in table and "skipped orjson" in table
