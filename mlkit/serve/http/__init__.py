"""The OpenAI-compatible HTTP front door of a serving process (docs/http.md).

- :mod:`mlkit.serve.http.calls`: how an HTTP request reaches the engine thread
  and its tokens come back (no locks, no polling).
- :mod:`mlkit.serve.http.openai_api`: request checking and response shapes.
- :mod:`mlkit.serve.http.app`: the FastAPI routes.
- :mod:`mlkit.serve.http.metrics`: Prometheus metrics.
- :mod:`mlkit.serve.http.server`: uvicorn in a thread on a socket bound at start-up.

Only ``calls`` is imported by the engine side; the rest loads when a server
serves HTTP.
"""
