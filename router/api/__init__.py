"""Front ends: the OpenAI-compatible HTTP API (and, later, gRPC and ext_proc)."""
