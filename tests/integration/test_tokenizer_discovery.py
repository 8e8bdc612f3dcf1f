"""``tokenizer.mode: auto`` against an emulated engine: the router reads what the engine
serves (``/v1/models`` ``root``, as vLLM reports its ``--model``), looks for that model's
tokenizer files, checks what it found against the engine's own ``/tokenize``, and says
which path the pool is on and why in ``/admin/engines``, ``kvroute status`` and the
metrics."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import aiohttp
import pytest
from support.clients import metrics
from support.hf_tokenizer import FIXTURE
from support.routers import StartRouter

from router.cli import main
from router.emulator import EmulatedEngine

MODEL = "kvroute-emulated"


@pytest.fixture
def model_dirs(tmp_path: Path, tokenizer_json: Path) -> Path:
    """A model volume holding a Hugging Face tokenizer under the emulator's model name
    (which the emulator reports as its ``root``): not the emulator's own tokenizer."""
    directory = tmp_path / "models" / MODEL
    directory.mkdir(parents=True)
    shutil.copy(tokenizer_json, directory / "tokenizer.json")
    shutil.copy(FIXTURE, directory / "tokenizer_config.json")
    return tmp_path / "models"


async def test_the_emulators_root_is_looked_up_and_what_is_found_checked_against_it(
    engine: EmulatedEngine, routers: StartRouter, model_dirs: Path, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{engine.url}/v1/models") as resp:
        cards = (await resp.json())["data"]
    assert {c["id"]: c["root"] for c in cards}[MODEL] == MODEL
    app = await routers([engine.url], tokenizer={"model_dirs": [str(model_dirs)]})
    assert app.tokenizers.modes() == {MODEL: "words"}
    async with http.get(f"{app.url}/admin/engines") as resp:
        (pool,) = (await resp.json())["tokenizers"]
    found = model_dirs / MODEL / "tokenizer.json"
    assert pool["model"] == MODEL and pool["mode"] == "words" and pool["source"] == "probe"
    assert pool["description"] == (
        f"words: emulator probe; {found} tokenizes differently from the engine"
    )


async def test_kvroute_status_says_which_tokenizer_each_pool_is_on_and_why(
    engine: EmulatedEngine,
    routers: StartRouter,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    app = await routers([engine.url])
    # The CLI blocks on its HTTP call: run it off the loop the router serves on.
    assert await asyncio.to_thread(main, ["status", app.url, "--timeout", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    section = lines[lines.index("") + 1 :]
    assert section[0].split() == ["MODEL", "TOKENIZER"]
    assert section[1].split(maxsplit=1) == [MODEL, "words: emulator probe"]
    assert await asyncio.to_thread(main, ["status", app.url, "--json", "--timeout", "30"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert [t["mode"] for t in answer["tokenizers"]] == ["words"]
    assert answer["engines"]  # beside the engines, which stay as they were
    samples = await metrics(http, app.url)
    sources = {(s.labels["model"], s.labels["source"]) for s in samples["kvroute_tokenizer_source"]}
    assert sources == {(MODEL, "probe")}
