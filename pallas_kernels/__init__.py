"""Pallas GPU kernels, each package with a pure-jnp reference beside it."""
