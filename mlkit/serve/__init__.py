"""Prefill and decode as separate server processes, KV moved by JAX's transfer server.

Layered on ``mlkit.engine`` (which never imports this package): each process
runs one ``Engine`` on its local devices; a small control channel
(:mod:`mlkit.serve.protocol`) carries requests, first tokens, checksums and
array specs, and the KV pages move with ``jax.experimental.transfer``.

- :mod:`mlkit.serve.prefill`: :class:`PrefillServer`.
- :mod:`mlkit.serve.decode`: :class:`DecodeServer` (the front door) and
  :class:`ColocatedServer`.
- :mod:`mlkit.serve.client`: :class:`Client` and ``python -m mlkit.serve.client``.
- ``python -m mlkit.serve --role prefill|decode|colocated``: one process.

docs/serving_processes.md has the protocol and the failure handling.
"""
