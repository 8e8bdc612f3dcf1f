"""The gRPC front end: the listeners (``server.py``) and ``kvroute.v1``'s ``Router`` and
``Admin`` services (``api.py``). The messages and stubs are generated from proto/ into
:mod:`router.grpc.gen` (``make proto``)."""
