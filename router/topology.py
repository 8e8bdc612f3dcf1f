"""Where engines run, and what moving KV between two of them costs.

An engine's :class:`Topology` is three free-form names, any of them unknown: its node,
its rack and its zone (``engines[].topology``, the admin API, gRPC ``AddEngine``, or
Kubernetes discovery from the pod's node). Two engines' :func:`locality` is the
narrowest domain they are known to share:

=============  ==============================================================
``same_node``  both name the same node (NVLink between the GPUs)
``same_rack``  both name the same rack, and no two different zones
``same_zone``  both name the same zone, or two different racks (the spine)
``cross_zone`` both name zones, and they differ
``unknown``    anything else: the link of ``disaggregation.transfer_bandwidth_gb_s``
=============  ==============================================================

A :class:`Link` is one locality's price (``disaggregation.links.<locality>``): the
seconds a transfer of N tokens' KV takes over it, and whether it is fast enough to split
over at all (``disaggregation.min_link_bandwidth_gb_s``). Pure: the planner and the
cluster simulator call the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.config import DisaggregationConfig, TopologyConfig

#: Locality classes with a configured link, narrowest first.
LOCALITIES = ("same_node", "same_rack", "same_zone", "cross_zone")
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Topology:
    """Where one engine runs (None: not known)."""

    node: str | None = None
    rack: str | None = None
    zone: str | None = None

    @classmethod
    def from_config(cls, cfg: TopologyConfig) -> Topology | None:
        """The configured topology; None when nothing of it is known."""
        found = cls(cfg.node or None, cfg.rack or None, cfg.zone or None)
        return found if found.known else None

    @property
    def known(self) -> bool:
        return bool(self.node or self.rack or self.zone)

    def describe(self) -> str:
        """``node/rack/zone`` with ``-`` for what is unknown."""
        return "/".join(part or "-" for part in (self.node, self.rack, self.zone))


def locality(a: Topology | None, b: Topology | None) -> str:
    """The narrowest domain ``a`` and ``b`` are known to share (module docstring)."""
    if a is None or b is None:
        return UNKNOWN
    if a.node and a.node == b.node:
        return "same_node"
    if a.zone and b.zone and a.zone != b.zone:
        return "cross_zone"
    if a.rack and b.rack:
        return "same_rack" if a.rack == b.rack else "same_zone"
    if a.zone and a.zone == b.zone:
        return "same_zone"
    return UNKNOWN


@dataclass(frozen=True, slots=True)
class Link:
    """The price of moving KV over one locality class of link."""

    locality: str
    bandwidth_gb_s: float
    latency_s: float
    min_uncached_tokens: int

    def transfer_s(self, tokens: int, cfg: DisaggregationConfig) -> float:
        """Seconds to hand ``tokens`` tokens' KV over: bytes over the bandwidth, the
        link's fixed latency and the handoff's own overhead."""
        seconds = tokens * cfg.kv_bytes_per_token / (self.bandwidth_gb_s * 1e9)
        return seconds + cfg.handoff_overhead_s + self.latency_s

    def fast_enough(self, cfg: DisaggregationConfig) -> bool:
        """Whether a split may use this link: an unknown link always may (the router
        knows nothing better), a known one when it meets ``min_link_bandwidth_gb_s``."""
        return self.locality == UNKNOWN or self.bandwidth_gb_s >= cfg.min_link_bandwidth_gb_s

    def describe(self) -> str:
        return f"{self.locality}:{self.bandwidth_gb_s:g}GB/s"


def default_link(cfg: DisaggregationConfig) -> Link:
    """The link between engines whose locality is unknown."""
    return Link(UNKNOWN, cfg.transfer_bandwidth_gb_s, 0.0, cfg.min_uncached_tokens)


def link_for(kind: str, cfg: DisaggregationConfig) -> Link:
    """The configured link of locality class ``kind``."""
    if kind == UNKNOWN:
        return default_link(cfg)
    link = getattr(cfg.links, kind)
    threshold = link.min_uncached_tokens
    return Link(
        kind,
        link.bandwidth_gb_s,
        link.latency_s,
        cfg.min_uncached_tokens if threshold is None else threshold,
    )


def link_between(a: Topology | None, b: Topology | None, cfg: DisaggregationConfig) -> Link:
    """The link a transfer between engines at ``a`` and ``b`` takes."""
    return link_for(locality(a, b), cfg)
