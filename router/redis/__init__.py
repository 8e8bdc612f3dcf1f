"""What router replicas and indexers share through Redis, beside the index itself.

``client.py`` is the one connection a process keeps to the namespace (bounded calls,
availability, the probe, the incarnation marker, Lua scripts) and ``schema.py`` the
namespace's key names (docs/redis-schema.md); the KV-block index
(``router/index/redis.py``) runs over that client, and so does each of the others, one
module each: ``load_exchange.py`` (the replicas' in-flight load), ``decision_stream.py``
(decisions, session pins and load changes between replicas), ``snapshot_store.py``
(engine stream snapshots, replicated mode), ``response_engines.py`` (which engine holds
a stored Responses API response) and ``leases.py`` (writer leases).
"""
