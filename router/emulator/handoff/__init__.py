"""KV-cache handoffs between emulated engines, in the two dialects routers speak.

* ``nixl``: vLLM's NixlConnector (pull). A prefill leg answers with
  ``kv_transfer_params`` naming blocks it holds; the decode leg pulls them over the
  prefill engine's side channel.
* ``sglang``: SGLang's bootstrap (push). Both legs carry the same ``bootstrap_room``;
  the decode engine joins the room at the prefill engine's bootstrap listener and
  receives the KV when the prefill is done.

Both listeners speak ``wire`` (length-prefixed msgpack over TCP). The timing of a
transfer is the engine model's (``EngineParams.transfer_time``), paid by the decode leg.
"""
