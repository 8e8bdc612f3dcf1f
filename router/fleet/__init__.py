"""The fleet: the engines the router routes to, as the router sees them.

Their identity and registry (``registry.py``), in-flight load (``load.py``, shared
between replicas by ``shared_load.py``), latency model (``latency.py``), health
(``monitor.py``, ``scrape.py``), membership as they come and go (``membership.py``,
Kubernetes discovery in ``k8s.py``) and KV block sizes (``block_size.py``). The engines
themselves are elsewhere: a model of one in :mod:`router.engine_model`, an emulated one
serving it over HTTP in :mod:`router.emulator`."""
