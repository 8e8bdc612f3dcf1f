"""Flow control in front of the request plan: priority bands, fairness across tenants,
rate limits and pool saturation (docs/reliability.md, "Flow control").

* :mod:`router.flow.ticket`: who a request is (tenant, API key) and its priority.
* :mod:`router.flow.queue`: the banded admission queue (bands, flows, ordering).
* :mod:`router.flow.fairness`: which flow a band serves next (``vtc``, ``round_robin``).
* :mod:`router.flow.ratelimit`: RPM / TPM token buckets, local or shared through Redis.
* :mod:`router.flow.saturation`: how full a pool is, in [0, 1].
* :mod:`router.flow.control`: :class:`FlowControl`, what the front ends call.
"""
