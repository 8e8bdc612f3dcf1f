"""The documentation contracts: every config key and every exposed metric is documented."""

from __future__ import annotations

import re

from support.docs import DOCS

from router.config import describe


def test_every_configuration_key_is_in_the_reference() -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [path for path, *_ in describe() if f"`{path}`" not in text]
    assert not missing, f"undocumented configuration keys: {missing}"


def test_the_metrics_page_lists_families_only_once() -> None:
    text = (DOCS / "metrics.md").read_text()
    rows = re.findall(r"^\| `(kvroute_[a-z0-9_]+)`", text, flags=re.M)
    assert len(rows) == len(set(rows))
    assert len(rows) >= 20


async def test_the_suite_runs_on_uvloop_like_production() -> None:
    import asyncio

    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")


def test_each_simulator_example_of_the_readme_says_how_long_it_takes() -> None:
    text = (DOCS.parent / "README.md").read_text()
    block = re.search(r"```\n(# [^`]*?kvroute simulate[^`]*)```", text)
    assert block, "the README's simulator examples"
    # Each command with the comment lines above it.
    examples = re.findall(r"((?:# .*\n)+)\.venv/bin/kvroute (simulate|plan)", block.group(1))
    assert len(examples) >= 2
    for comment, command in examples:
        assert re.search(r"about \d+ (s|minutes?)\b", comment), (command, comment)
