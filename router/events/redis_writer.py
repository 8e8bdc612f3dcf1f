"""The event writer's former home: it now writes to any remote index, in
:mod:`router.events.writer`. These names stay importable from here."""

from router.events.writer import LostListener, RemoteEventWriter, WriterStats

RedisEventWriter = RemoteEventWriter

__all__ = ["LostListener", "RedisEventWriter", "WriterStats"]
