"""The serving Engine beside a peer implementation on one checkpoint, in the same run.

``compare``: the engine's side, the peer worker process, and one row per batch (tok/s,
ratio, identical tokens). ``transformers_worker``: the Hugging Face transformers side,
a script that imports nothing from this project (it runs in the interpreter
``MLKIT_PEER_PYTHON`` names). ``python -m experiments cpu_peer`` runs them.
"""
