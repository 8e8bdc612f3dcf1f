"""``make soak``: the router under steady load for a bounded time, with faults on a schedule.

``python -m router.bench.soak`` starts on loopback, each in its own process group: a
throw-away ``redis-server`` on a free port (never the machine's own Redis), four
emulated engines (``kvroute engine``) publishing KV events, and ``kvroute serve`` in
front of them with the Redis index. Then it

1. measures capacity: a short closed-loop ramp through the router (2, 4, 8, ...
   requests in flight) until answered requests per second stop growing;
2. sends an open-loop paced stream at ``--load`` (80%) of that capacity for
   ``--minutes`` (10): streaming and non-streaming completions and chat completions,
   over system prompts that many requests share;
3. injects faults on a schedule (:func:`~router.bench.soak.fleet.fault_plan`): an
   engine SIGKILLed and started again on the same port, the Redis server SIGKILLed and
   started again empty, and an engine that stalls mid-stream (``stall_after_tokens``
   through its ``/admin/faults``) for a while;
4. prints per minute (by the minute a request was sent): requests sent, answered,
   failed by reason, lost, latency p50/p99 of the answered ones, the router's resident
   memory (``VmRSS`` at the minute's end) and CPU, the CPU of the soak's processes and
   of the whole machine, and the router's Redis outages; then the router's counters
   and a summary of its log, and a verdict:

   * no request lost: each got an answer or a clean error (an HTTP status with an
     OpenAI error body, or an SSE error event followed by ``[DONE]``);
   * no failure the router caused: every failure was served by an engine while it was
     being restarted or stalled (:func:`~router.bench.soak.report.attribute`); a Redis
     restart excuses none, and a 500 or a ``router_error`` is never excused;
   * memory flat: the router's RSS at the end of the last minute is within 10% of its
     RSS at the end of minute 2 (minute 1 is warm-up).

Everything goes to ``--output`` (``bench-results/soak.json``); the exit status is 1 when
the verdict fails. docs/reliability.md quotes a full run.

One module per part: :mod:`~router.bench.soak.report` (the records and the pure report
maths: :func:`~router.bench.soak.report.attribute`, the per-minute table, the verdict,
the text and JSON), :mod:`~router.bench.soak.fleet` (the processes, the faults, the
sampler), :mod:`~router.bench.soak.sender` (the request mix, the strict sender, the
capacity ramp) and :mod:`~router.bench.soak.run` (the flags and the wiring).
"""
