"""`python -m experiments <name>`: thin entry points that write JSON, markdown and PNG.

Each experiment module exposes ``run(out_dir: str, *, quick: bool = True) -> dict``.
The logic lives in mlkit; experiments only warm up, time and write results.
"""
