"""KV-transfer handoff dialects: how a request is split into a prefill and a decode leg."""
