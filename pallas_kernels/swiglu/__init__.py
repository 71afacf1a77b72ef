"""SwiGLU from the gate and up projections' split-K partial sums: a Pallas Triton kernel
(``swiglu_parts``) and its jnp reference. docs/swiglu.md has the design."""

from pallas_kernels.swiglu.parts import swiglu_parts
from pallas_kernels.swiglu.reference import silu_times, swiglu_parts_reference

__all__ = ["silu_times", "swiglu_parts", "swiglu_parts_reference"]
