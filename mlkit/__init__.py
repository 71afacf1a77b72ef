"""mlkit: a functional JAX MoE model with paged KV state, quantisation and a serving engine."""
