"""The front ends: transport adapters onto the serving pipeline (:mod:`router.serving`).

Each maps its transport's requests onto the pipeline (intake, gate, plan, forward,
relay) and the pipeline's errors back to its transport, and holds nothing else:

* ``http/``: the HTTP listener (aiohttp), its OpenAI, Anthropic, Responses, passthrough
  and admin routes;
* ``grpc/``: the gRPC listeners, ``kvroute.v1`` ``Router`` and ``Admin``;
* ``extproc.py``: Envoy's ext_proc endpoint picker (served on the gRPC listeners);
* ``sidecar.py``: ``kvroute sidecar``, llm-d's P/D sidecar in front of a decode engine.

Nothing outside this package imports it, except the wiring that builds the front ends
(:mod:`router.app`, :mod:`router.serve`, :mod:`router.cli`); tests/unit/test_import_graph.py
holds that rule.
"""
