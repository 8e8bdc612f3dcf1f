"""The HTTP front end: the listener (``server.py``, ``listener.py``, ``observe.py``,
``auth.py``, ``body.py``) and its routes (``routes.py`` for the generation routes and
the small endpoints, one module per other API beside it)."""
