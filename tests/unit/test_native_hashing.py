"""The compiled block-key helper (router/native/native.c) against the pure-Python path:
the same keys for every input kind, the same errors, and the fallback when it is absent."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import hashing
from router.hashing import _block_keys_python, block_keys, seed_for

native = pytest.importorskip("router._native", reason="the compiled helper was not built")

token_ids = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=600)
block_sizes = st.sampled_from([1, 2, 3, 16, 32, 64, 128])
seeds = st.integers(min_value=0, max_value=2**64 - 1)


def test_an_install_with_a_compiler_uses_the_helper() -> None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip("no C compiler: the pure-Python path is the one in use")
    assert hashing.NATIVE


@settings(max_examples=300, deadline=None)
@given(tokens=token_ids, block_size=block_sizes, seed=seeds)
def test_native_keys_equal_the_pure_python_keys(tokens: list[int], block_size: int, seed: int):
    expected = _block_keys_python(tokens, block_size, seed)
    packed = array("I", tokens)
    assert native.block_keys(tokens, block_size, seed, -1) == expected
    assert native.block_keys(tuple(tokens), block_size, seed, -1) == expected
    assert native.block_keys(packed, block_size, seed, -1) == expected
    assert native.block_keys(hashing.tokens_to_bytes(tokens), block_size, seed, -1) == expected
    assert block_keys(tokens, block_size, seed) == expected


@settings(max_examples=100, deadline=None)
@given(tokens=token_ids, block_size=block_sizes, limit=st.integers(min_value=0, max_value=50))
def test_max_blocks_is_honoured_alike(tokens: list[int], block_size: int, limit: int) -> None:
    seed = seed_for("model")
    expected = _block_keys_python(tokens, block_size, seed, limit)
    assert block_keys(tokens, block_size, seed, limit) == expected
    assert len(expected) == min(len(tokens) // block_size, limit)


def test_long_prompts_use_the_heap_buffer_and_agree() -> None:
    tokens = [(i * 2_654_435_761) % 2**32 for i in range(20_000)]  # past the stack buffer
    seed = seed_for("m", "salt")
    assert block_keys(tokens, 16, seed) == _block_keys_python(tokens, 16, seed)


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([1, -1], OverflowError),
        ([2**32], OverflowError),
        ([1, 2**70], OverflowError),
        ([1.5], TypeError),
        (["a"], TypeError),
        ([None], TypeError),
    ],
)
def test_bad_ids_raise_what_the_pure_path_raises(tokens: list[object], error: type) -> None:
    with pytest.raises(error):
        _block_keys_python(tokens, 16, 0)  # type: ignore[arg-type]
    with pytest.raises(error):
        native.block_keys(tokens, 16, 0, -1)


def test_a_bad_id_in_the_partial_last_block_is_still_refused() -> None:
    tokens = [*range(32), -5]
    with pytest.raises(OverflowError):
        _block_keys_python(tokens, 16, 0)
    with pytest.raises(OverflowError):
        native.block_keys(tokens, 16, 0, -1)


def test_index_likes_are_taken_as_array_takes_them() -> None:
    class Id:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    tokens = [Id(i) for i in range(40)]
    assert native.block_keys(tokens, 8, 7, -1) == _block_keys_python(list(range(40)), 8, 7)


def test_other_sequences_take_the_pure_path_with_the_same_keys() -> None:
    seed = seed_for("m")
    expected = _block_keys_python(list(range(100)), 16, seed)
    assert block_keys(range(100), 16, seed) == expected
    assert block_keys(array("l", range(100)), 16, seed) == expected


def test_a_non_positive_block_size_is_refused() -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2, 3], 0, 0)
    with pytest.raises(ValueError):
        native.block_keys([1, 2, 3], 0, 0, -1)


def test_without_the_helper_the_pure_path_runs_with_the_same_keys() -> None:
    """``KVROUTE_PURE_PYTHON=1`` (as an install without a compiler) selects the fallback."""
    env = {**os.environ, "KVROUTE_PURE_PYTHON": "1"}
    code = (
        "from router import hashing\n"
        "print(hashing.NATIVE, hashing.block_keys(list(range(64)), 16, 5))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split(" ", 1)
    assert out[0] == "False"
    assert out[1].strip() == str(_block_keys_python(list(range(64)), 16, 5))


def test_an_unimportable_helper_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "router._native", None)  # import raises ImportError
    try:
        reloaded = importlib.reload(hashing)
        assert not reloaded.NATIVE
        assert reloaded.block_keys(list(range(64)), 16, 5) == _block_keys_python(
            list(range(64)), 16, 5
        )
    finally:
        monkeypatch.undo()
        importlib.reload(hashing)
    assert hashing.NATIVE


def test_the_switch_is_not_read_as_a_configuration_key() -> None:
    from router.config import load_config

    config = load_config(environ={"KVROUTE_PURE_PYTHON": "1", "KVROUTE_POLICY__NAME": "random"})
    assert config.policy.name == "random"


def test_the_metrics_say_which_path_computes_keys() -> None:
    from router.metrics import StateCollector, StateSources

    families = {f.name: f for f in StateCollector(StateSources()).collect()}
    assert families["kvroute_native_helper"].samples[0].value == (1 if hashing.NATIVE else 0)
