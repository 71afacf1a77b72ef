"""Planning the report's deployments on 8x H200 from shapes and compiles, without a GPU.

``kv_tokens``: KV tokens per H200 at the report's scale, by KV dtype and weight recipe.
``step_compile``: the engine's decode and prefill steps compiled for 8x H200 from a CPU
host (what a run compiles, at which depths, with which pools). ``step_memory``: XLA's
per-device bytes fitted over depth and read at full depth, the largest KV pool that
fits beside the step's temporaries, and one row per deployment beside the analytic
model. ``python -m experiments capacity`` and ``h200_compile`` run them and write tables.
"""
