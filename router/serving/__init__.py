"""The request pipeline around the routing decision, free of any transport.

Every front end (HTTP, gRPC ``Pick``/``Generate``, ext_proc, the sidecar) and the
simulator share these steps instead of writing them each: the charges a plan's legs put
on the engines' load, the planner's wiring, the engine call with its retries and the
answer's relay. Front ends map their transport onto these and the errors back.
"""
