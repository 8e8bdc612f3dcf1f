"""KV-cache events: domain types, wire codecs and the subscriber."""
