"""KV-cache events: domain types, wire codecs, the subscriber, the writer into a shared
index, and ``kvroute indexer`` (``indexer.py``), which runs them as a process of its own."""
