from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_AGGREGATED: _ClassVar[Mode]
    MODE_LOCAL: _ClassVar[Mode]
    MODE_SPLIT: _ClassVar[Mode]

class Endpoint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENDPOINT_UNSPECIFIED: _ClassVar[Endpoint]
    ENDPOINT_COMPLETIONS: _ClassVar[Endpoint]
    ENDPOINT_CHAT_COMPLETIONS: _ClassVar[Endpoint]
MODE_UNSPECIFIED: Mode
MODE_AGGREGATED: Mode
MODE_LOCAL: Mode
MODE_SPLIT: Mode
ENDPOINT_UNSPECIFIED: Endpoint
ENDPOINT_COMPLETIONS: Endpoint
ENDPOINT_CHAT_COMPLETIONS: Endpoint

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("applied", "restart")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    applied: _containers.RepeatedScalarFieldContainer[str]
    restart: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, applied: _Optional[_Iterable[str]] = ..., restart: _Optional[_Iterable[str]] = ...) -> None: ...

class PickRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "messages", "block_keys", "body", "max_tokens", "n", "cache_salt", "session", "headers", "subset")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    SUBSET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    messages: Messages
    block_keys: BlockKeys
    body: bytes
    max_tokens: int
    n: int
    cache_salt: str
    session: str
    headers: _containers.ScalarMap[str, str]
    subset: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., block_keys: _Optional[_Union[BlockKeys, _Mapping]] = ..., body: _Optional[bytes] = ..., max_tokens: _Optional[int] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ..., session: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., subset: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class BlockKeys(_message.Message):
    __slots__ = ("keys", "prompt_tokens")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class Score(_message.Message):
    __slots__ = ("endpoint", "dp_rank", "matched_blocks", "cached_tokens", "queue", "prefill", "decode", "reported", "total")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    dp_rank: int
    matched_blocks: int
    cached_tokens: int
    queue: float
    prefill: float
    decode: float
    reported: float
    total: float
    def __init__(self, endpoint: _Optional[str] = ..., dp_rank: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., queue: _Optional[float] = ..., prefill: _Optional[float] = ..., decode: _Optional[float] = ..., reported: _Optional[float] = ..., total: _Optional[float] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("policy", "reason", "summary", "matched_blocks", "cached_tokens", "scores")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    reason: str
    summary: str
    matched_blocks: int
    cached_tokens: int
    scores: _containers.RepeatedCompositeFieldContainer[Score]
    def __init__(self, policy: _Optional[str] = ..., reason: _Optional[str] = ..., summary: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., scores: _Optional[_Iterable[_Union[Score, _Mapping]]] = ...) -> None: ...

class Target(_message.Message):
    __slots__ = ("endpoint", "url", "dp_rank", "dp_size", "role", "decision")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    url: str
    dp_rank: int
    dp_size: int
    role: str
    decision: Decision
    def __init__(self, endpoint: _Optional[str] = ..., url: _Optional[str] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., role: _Optional[str] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class Split(_message.Message):
    __slots__ = ("split", "reason", "uncached_tokens", "transfer_s", "saved_s")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    SAVED_S_FIELD_NUMBER: _ClassVar[int]
    split: bool
    reason: str
    uncached_tokens: int
    transfer_s: float
    saved_s: float
    def __init__(self, split: _Optional[bool] = ..., reason: _Optional[str] = ..., uncached_tokens: _Optional[int] = ..., transfer_s: _Optional[float] = ..., saved_s: _Optional[float] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("dialect", "prefill_kv_transfer_params_json", "bootstrap_host", "bootstrap_port", "bootstrap_room")
    DIALECT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_HOST_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    dialect: str
    prefill_kv_transfer_params_json: str
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    def __init__(self, dialect: _Optional[str] = ..., prefill_kv_transfer_params_json: _Optional[str] = ..., bootstrap_host: _Optional[str] = ..., bootstrap_port: _Optional[int] = ..., bootstrap_room: _Optional[int] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("request_id", "model", "mode", "decode", "prefill", "split", "handoff", "headers", "fallbacks", "prompt_tokens", "approximate", "expires_in_s")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    mode: Mode
    decode: Target
    prefill: Target
    split: Split
    handoff: Handoff
    headers: _containers.ScalarMap[str, str]
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    prompt_tokens: int
    approximate: bool
    expires_in_s: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., mode: _Optional[_Union[Mode, str]] = ..., decode: _Optional[_Union[Target, _Mapping]] = ..., prefill: _Optional[_Union[Target, _Mapping]] = ..., split: _Optional[_Union[Split, _Mapping]] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ..., headers: _Optional[_Mapping[str, str]] = ..., fallbacks: _Optional[_Iterable[str]] = ..., prompt_tokens: _Optional[int] = ..., approximate: _Optional[bool] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("endpoint", "body", "request_id", "headers")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    body: bytes
    request_id: str
    headers: _containers.ScalarMap[str, str]
    def __init__(self, endpoint: _Optional[_Union[Endpoint, str]] = ..., body: _Optional[bytes] = ..., request_id: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("status", "headers", "data")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    status: int
    headers: _containers.ScalarMap[str, str]
    data: bytes
    def __init__(self, status: _Optional[int] = ..., headers: _Optional[_Mapping[str, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "served_endpoint", "prefilled", "prompt_tokens", "completion_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SERVED_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    served_endpoint: str
    prefilled: bool
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., served_endpoint: _Optional[str] = ..., prefilled: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("held_s",)
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    held_s: float
    def __init__(self, held_s: _Optional[float] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ...) -> None: ...

class AddEngineRequest(_message.Message):
    __slots__ = ("url", "role", "models", "dp_size", "bootstrap_port", "kv_events", "kv_events_replay", "kv_events_topic", "topology")
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    url: str
    role: str
    models: _containers.RepeatedScalarFieldContainer[str]
    dp_size: int
    bootstrap_port: int
    kv_events: str
    kv_events_replay: str
    kv_events_topic: str
    topology: EngineTopology
    def __init__(self, url: _Optional[str] = ..., role: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., dp_size: _Optional[int] = ..., bootstrap_port: _Optional[int] = ..., kv_events: _Optional[str] = ..., kv_events_replay: _Optional[str] = ..., kv_events_topic: _Optional[str] = ..., topology: _Optional[_Union[EngineTopology, _Mapping]] = ...) -> None: ...

class EngineTopology(_message.Message):
    __slots__ = ("node", "rack", "zone")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    node: str
    rack: str
    zone: str
    def __init__(self, node: _Optional[str] = ..., rack: _Optional[str] = ..., zone: _Optional[str] = ...) -> None: ...

class EngineRef(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    def __init__(self, endpoint: _Optional[str] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "inflight_requests", "queued_prefill_tokens", "decode_blocks", "index_blocks", "index_share")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEX_SHARE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    inflight_requests: int
    queued_prefill_tokens: int
    decode_blocks: int
    index_blocks: int
    index_share: float
    def __init__(self, rank: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., decode_blocks: _Optional[int] = ..., index_blocks: _Optional[int] = ..., index_share: _Optional[float] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("endpoint", "url", "role", "state", "models", "dp_size", "ranks", "inflight_requests", "index_blocks", "index_share", "refused_reason", "discovered", "topology")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEX_SHARE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    DISCOVERED_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    url: str
    role: str
    state: str
    models: _containers.RepeatedScalarFieldContainer[str]
    dp_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    inflight_requests: int
    index_blocks: int
    index_share: float
    refused_reason: str
    discovered: bool
    topology: EngineTopology
    def __init__(self, endpoint: _Optional[str] = ..., url: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., dp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., inflight_requests: _Optional[int] = ..., index_blocks: _Optional[int] = ..., index_share: _Optional[float] = ..., refused_reason: _Optional[str] = ..., discovered: _Optional[bool] = ..., topology: _Optional[_Union[EngineTopology, _Mapping]] = ...) -> None: ...
