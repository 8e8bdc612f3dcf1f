"""The Dynamo side of ``make bench-scale``: NVIDIA Dynamo's radix-tree KV indexer
(``dynamo.llm.RadixTree`` from PyPI's ``ai-dynamo-runtime``, in process, no runtime)
given the same fleet and query as kvroute's index.

Run by ``router/bench/scale.py`` with ``build/dynamo/venv/bin/python`` (where kvroute is
not installed): ``scale_dynamo.py ENGINES BLOCKS REPEAT`` prints one JSON object. The
fleet comes from ``scale_data.py``, loaded by its path. Each chain is one stored event
whose blocks carry kvroute's key as ``tokens_hash`` (what ``find_matches`` walks) and
the engines' hash as ``block_hash`` (what removals name); the query is its 512 keys.
"""

from __future__ import annotations

import os
import sys

# Run by its path, this file's directory leads sys.path, where router/bench/tokenize.py
# would stand in for the standard library's tokenize.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("DYN_LOG", "error")


def _scale_data():  # type: ignore[no-untyped-def]
    path = Path(__file__).with_name("scale_data.py")
    spec = importlib.util.spec_from_file_location("kvroute_scale_data", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(engines: int, blocks: int, repeat: int) -> dict[str, object]:
    data = _scale_data()
    from dynamo.llm import RadixTree

    fleet = data.Fleet(engines, blocks)
    tree = RadixTree()
    gc.collect()
    before = data.rss_bytes()
    applied = 0
    spent = 0.0
    event_id = 0
    for engine in range(engines):
        events = []
        for chain in fleet.chains(engine):
            event_id += 1
            blocks_ = [
                {"block_hash": h, "tokens_hash": k}
                for h, k in zip(chain.hashes, chain.keys, strict=True)
            ]
            stored = {"stored": {"parent_hash": None, "blocks": blocks_}}
            events.append(json.dumps({"event_id": event_id, "data": stored}).encode())
            applied += len(blocks_)
        t0 = time.perf_counter()
        for event in events:
            tree.apply_event(engine, event)
        spent += time.perf_counter() - t0
        del events
    gc.collect()
    time.sleep(0.5)  # the tree's thread applies what it was sent
    grown = data.rss_bytes() - before
    query = fleet.query.keys
    scores = tree.find_matches(query).scores
    found = {worker: depth for (worker, _rank), depth in scores.items()}
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        tree.find_matches(query).scores  # noqa: B018 - the scores, as a router reads them
        samples.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    tree.clear_all_blocks(0)
    cleared = time.perf_counter() - t0
    return data.row("dynamo RadixTree", fleet, applied, grown, spent, samples, cleared, found)  # type: ignore[no-any-return]


if __name__ == "__main__":
    if len(sys.argv) != 4 or not all(a.isdigit() for a in sys.argv[1:]):
        sys.exit(f"usage: {sys.argv[0]} ENGINES BLOCKS REPEAT (run by router/bench/scale.py)")
    print(json.dumps(main(*(int(a) for a in sys.argv[1:4]))))
