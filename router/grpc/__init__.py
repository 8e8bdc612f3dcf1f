"""The Python code generated from proto/ (``gen/``, ``make proto``): the ``kvroute.v1``
messages and stubs, for the gRPC front end (:mod:`router.frontends.grpc`) and clients."""
