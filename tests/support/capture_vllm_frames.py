"""Record a real vLLM's KV-event frames as golden files: ``make vllm-frames``.

Starts the real-vLLM tier's engine (tests/support/real_vllm.py) twice, once with vLLM's
default integer block hashes and once with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``
(raw digest bytes), with a small KV cache. On each it subscribes to the PUB socket and
sends requests that store a root run, store a child run under it, evict blocks, and clear
the cache (``/reset_prefix_cache``, published with the next step); then it records a whole
replay exchange from sequence 0. Every PUB message is written as-is (its three frames) and
described in ``manifest.json`` with what the decoder must make of it.

    python tests/support/capture_vllm_frames.py tests/fixtures/vllm-0.32-frames
"""

from __future__ import annotations

import base64
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.real_vllm import VllmEngine, vllm_version
from support.tiny_model import make_tiny_llama
from support.vllm_prompts import MODEL, text

#: Few blocks, so that a handful of prompts evict (and a model length that fits them).
CAPTURE_BLOCKS = 64


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read() or b"null")


def _summary(payload: bytes) -> dict[str, Any]:
    """What the batch holds, decoded with plain msgpack (not the router's decoder)."""
    batch = msgspec.msgpack.decode(payload)
    shape = "array" if isinstance(batch, list) else "map"
    events = batch[1] if isinstance(batch, list) else batch["events"]
    described = []
    for event in events:
        kind = event["type"] if isinstance(event, dict) else event[0]
        entry: dict[str, Any] = {"type": kind}
        if isinstance(event, dict):
            entry["fields"] = sorted(event)
            if "block_hashes" in event:
                entry["hashes"] = len(event["block_hashes"])
                entry["hash_kind"] = type(event["block_hashes"][0]).__name__
            if "token_ids" in event:
                entry["tokens"] = len(event["token_ids"])
            if "parent_block_hash" in event:
                entry["has_parent"] = event["parent_block_hash"] is not None
        described.append(entry)
    return {"batch_shape": shape, "batch_length": len(batch), "events": described}


def _capture(out: Path, label: str, env: dict[str, str], work: Path) -> list[dict[str, Any]]:
    engine = VllmEngine(
        label,
        make_tiny_llama(work / "model"),
        work,
        num_gpu_blocks=CAPTURE_BLOCKS,
        max_model_len=(CAPTURE_BLOCKS - 2) * 32,  # vLLM keeps a block back
        extra_env=env,
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    entries: list[dict[str, Any]] = []
    try:
        engine.start()
        engine.wait_ready()
        sub.connect(engine.events_endpoint)
        time.sleep(1.0)  # the slow joiner: the subscription must be live before we publish
        url = engine.url
        root = text(120, "golden-root")
        child = " " + text(60, "golden-child")  # whole new blocks after the root's
        steps = [
            ("stored-root", lambda: _post(f"{url}/v1/completions", _body(root))),
            ("stored-child", lambda: _post(f"{url}/v1/completions", _body(root + child))),
            *((f"evict-{i}", _evictor(url, i)) for i in range(5)),
            ("reset", lambda: _post(f"{url}/reset_prefix_cache")),
            ("after-reset", lambda: _post(f"{url}/v1/completions", _body(text(20, "after")))),
        ]
        for step, action in steps:
            action()
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                if not sub.poll(300):
                    continue
                topic, seq, payload = sub.recv_multipart()
                name = f"{label}-{len(entries):02d}-{step}.msgpack"
                (out / name).write_bytes(payload)
                entries.append(
                    {
                        "file": name,
                        "topic": topic.decode(),
                        "seq": int.from_bytes(seq, "big"),
                        "step": step,
                        **_summary(payload),
                    }
                )
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(engine.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            replies.append([base64.b64encode(f).decode() for f in frames])
            if b"\xff" * 8 in frames:
                break
        dealer.close(0)
        (out / f"{label}-replay.json").write_text(
            json.dumps({"start_seq": 0, "replies": replies}, indent=1) + "\n"
        )
    finally:
        sub.close(0)
        ctx.term()
        engine.stop()
    return entries


def _evictor(url: str, i: int) -> Any:
    return lambda: _post(f"{url}/v1/completions", _body(text(300, f"evictor-{i}")))


def _body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1}


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/vllm-0.32-frames")
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"vllm_version": vllm_version(), "block_size": 32, "messages": []}
    for label, env in (
        ("int", {}),
        ("bytes", {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}),
    ):
        with tempfile.TemporaryDirectory(prefix="vllm-frames-") as work:
            manifest["messages"] += _capture(out, label, env, Path(work))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(manifest['messages'])} messages from vLLM {manifest['vllm_version']} in {out}")


if __name__ == "__main__":
    main()
