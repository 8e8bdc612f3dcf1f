"""Where a served model's own tokenizer files are, found without being told.

``tokenizer.mode: auto`` looks, in this order, for a directory holding ``tokenizer.json``
(with ``tokenizer_config.json`` and ``chat_template.jinja`` beside it when they exist):

1. a path the engine reports (:class:`Reported`: vLLM's ``/v1/models`` ``root``, which is
   its ``--model`` argument; SGLang's ``tokenizer_path`` and ``model_path``), where the
   router sees the same files at the same path (the same machine, or a shared model
   volume mounted at the same place);
2. each of ``tokenizer.model_dirs`` (a volume mounted elsewhere), holding the engine's
   names whole or by their last path component;
3. the Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``, ``~/.cache/huggingface/hub``),
   through huggingface_hub's own lookup, for every name that is a hub id;
4. the hub itself (:func:`fetch`; the caller runs it in the background), for
   the hub ids the engine reports as its model (never the served name alone, which a
   deployment may keep private).

Nothing here talks to an engine or decides: :mod:`router.tokenization.pools` checks each
candidate against the engine's own ``/tokenize`` and picks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers (4.43 on) saves a chat template, instead of tokenizer_config.json."""
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})


@dataclass(frozen=True, slots=True)
class Reported:
    """A name an engine gave for its model, and which field it came from."""

    name: str
    field: str
    """``root`` (vLLM: the --model argument), ``tokenizer_path``, ``model_path`` (SGLang)
    or ``served name`` (the model's id in requests)."""

    @property
    def from_engine(self) -> bool:
        """Whether the engine reported it as where its model comes from (a path, or a
        hub id the engine itself fetched), rather than only as the model's name."""
        return self.field != "served name"


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """A model's tokenizer files, and where they were found."""

    tokenizer: Path
    config: Path | None
    chat_template: Path | None
    source: str
    """``engine``, ``model_dirs``, ``hf_cache`` or ``hub`` (the metric's label)."""
    detail: str
    """Where, in words: ``engine root``, ``tokenizer.model_dirs``, ``Hugging Face cache,
    org/name``..."""


def in_directory(directory: Path, source: str, detail: str) -> TokenizerFiles | None:
    """The tokenizer files of a model directory, if it holds a tokenizer.json."""
    tokenizer = directory / TOKENIZER_FILE
    try:
        if not tokenizer.is_file():
            return None
        config = directory / CONFIG_FILE
        template = directory / TEMPLATE_FILE
        return TokenizerFiles(
            tokenizer.absolute(),
            config.absolute() if config.is_file() else None,
            template.absolute() if template.is_file() else None,
            source,
            detail,
        )
    except OSError:  # unreadable, a name too long for the filesystem: not here
        return None


def hub_id(name: str) -> bool:
    """Whether ``name`` can be a Hugging Face hub id (``name`` or ``org/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isabs(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _within(directory: Path, name: str) -> list[Path]:
    """``directory/name`` and ``directory/<last component of name>``, leaving out any
    whose ``..`` would lead outside ``directory`` (a name is the engine's to choose;
    symbolic links inside the directory are the operator's and are followed)."""
    base = Path(os.path.normpath(directory.absolute()))
    paths = []
    for relative in (name.lstrip("/"), Path(name).name):
        path = Path(os.path.normpath(base / relative))
        if path != base and path.is_relative_to(base) and path not in paths:
            paths.append(path)
    return paths


def hub_cache_dir() -> str | None:
    """The Hugging Face cache directory when ``HF_HUB_CACHE`` says so now; None for
    huggingface_hub's own choice (which reads its environment once, at import)."""
    return os.environ.get("HF_HUB_CACHE") or None


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) forbids
    reaching the hub, now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or now.strip().upper() in _TRUE


def in_hub_cache(repo_id: str) -> TokenizerFiles | None:
    """A hub id's tokenizer files in the Hugging Face cache (its ``main`` revision)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, TOKENIZER_FILE, cache_dir=hub_cache_dir())
    except (ValueError, OSError):
        return None
    if not isinstance(found, str):
        return None
    return in_directory(Path(found).parent, "hf_cache", f"Hugging Face cache, {repo_id}")


def on_disk(
    names: Sequence[Reported], model_dirs: Sequence[str], looked: list[str]
) -> Iterator[TokenizerFiles]:
    """Every tokenizer found on disk for these names, in the order of preference (the
    module's steps 1-3); where each step looked is appended to ``looked``."""
    seen: set[Path] = set()

    def visit(directory: Path, source: str, detail: str) -> TokenizerFiles | None:
        key = directory.absolute()  # a relative root: where the router runs
        if key in seen:
            return None
        seen.add(key)
        looked.append(str(key))
        return in_directory(directory, source, detail)

    for reported in names:
        if reported.from_engine:
            found = visit(Path(reported.name), "engine", f"engine {reported.field}")
            if found is not None:
                yield found
    for directory in model_dirs:
        for reported in names:
            for path in _within(Path(directory), reported.name):
                found = visit(path, "model_dirs", "tokenizer.model_dirs")
                if found is not None:
                    yield found
    repos = list(dict.fromkeys(r.name for r in names if hub_id(r.name)))
    if repos:
        looked.append(f"the Hugging Face cache ({', '.join(repos)})")
    for repo in repos:
        found = in_hub_cache(repo)
        if found is not None:
            yield found


def downloadable(names: Sequence[Reported]) -> list[str]:
    """The hub ids the engine reported as where its model comes from."""
    return list(dict.fromkeys(r.name for r in names if r.from_engine and hub_id(r.name)))


def download(repo_id: str, timeout_s: float) -> TokenizerFiles:
    """Fetch a hub id's tokenizer files into the Hugging Face cache (blocking: run it on
    a thread). ``tokenizer.json`` must exist; the template files may not. Raises
    huggingface_hub's errors (no such repository, gated, offline, a timeout)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError

    where = {
        "cache_dir": hub_cache_dir(),
        "endpoint": os.environ.get("HF_ENDPOINT") or None,
        "etag_timeout": timeout_s,
    }
    path = Path(hf_hub_download(repo_id, TOKENIZER_FILE, **where))  # type: ignore[arg-type]
    for optional in (CONFIG_FILE, TEMPLATE_FILE):
        try:
            hf_hub_download(repo_id, optional, **where)  # type: ignore[arg-type]
        except EntryNotFoundError:
            pass
    found = in_directory(path.parent, "hub", f"Hugging Face hub, {repo_id}")
    if found is None:  # the file it just wrote is gone: not ours to explain
        raise FileNotFoundError(f"{path} vanished after its download")
    return found


async def fetch(repo_id: str, timeout_s: float) -> TokenizerFiles:
    """:func:`download` on a thread of its own, waited for ``timeout_s`` at most
    (``TimeoutError``). huggingface_hub does not bound each request it makes in time, so a
    hub that never answers keeps the thread: a daemon thread, which never holds up the
    router's exit (an executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[TokenizerFiles] = loop.create_future()

    def settle(result: TokenizerFiles | None, error: Exception | None) -> None:
        if done.done():  # waited for no longer
            return
        if error is not None:
            done.set_exception(error)
        else:
            assert result is not None
            done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = download(repo_id, timeout_s)
        except Exception as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=f"kvroute-hub {repo_id}", daemon=True).start()
    return await asyncio.wait_for(done, timeout_s)
