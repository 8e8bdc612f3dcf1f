"""``python -m router.bench.soak`` (``make soak``)."""

from router.bench.soak.run import main

raise SystemExit(main())
