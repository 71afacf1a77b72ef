"""Model params for tests, drawn with numpy.

``mlkit.model.init_params`` is one jitted threefry program per config, and on this CPU
compiling it costs ~8-12 s for a tiny model, more than the model's own forward pass.
Tests that need *some* random params of the right layout (not the library's generator)
draw them here instead: the layout comes from ``mlkit.model.param_specs``, the scales
are the ones ``init_params`` uses, and nothing is compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np

from mlkit import model


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)


def init_params_np(cfg, seed: int = 0, mtp=None) -> dict:
  """Params laid out as ``model.init_params(cfg, key)``, with its distributions.

  N(0, 1/fan_in) matrices (embeddings N(0, 1), or N(0, 1/d_model) when tied), unit
  norms, zero router bias; in ``cfg.param_dtype`` except where the spec names a dtype
  (routers stay f32). Values come from ``np.random.default_rng(seed)``, drawn in leaf order.

  Args:
    cfg: the model config.
    seed: the numpy generator seed.
    mtp: as ``model.init_params``'s: None, or the optional parts of the ``mtp`` layers to
      add (drawn after every main-model leaf, so those are the same either way).

  Returns:
    The params pytree (jax arrays).
  """
  rng = np.random.default_rng(seed)

  def leaf(spec):
    shape, kind = spec[0], spec[1]
    dt = jnp.dtype(spec[2] if len(spec) == 3 else cfg.param_dtype)
    if kind in ("ones", "zeros"):
      x = np.full(shape, 1.0 if kind == "ones" else 0.0, np.float32)
    else:
      std = (cfg.d_model ** -0.5 if cfg.tie_embeddings else 1.0) if kind == "embed" else shape[-2] ** -0.5
      x = (rng.standard_normal(shape) * std).astype(np.float32)
    # Cast on the host (ml_dtypes rounds to nearest even, as XLA does) and place with
    # device_put: an eager jnp cast or fill, or jnp.asarray itself, compiles a small
    # program per shape.
    return jax.device_put(x.astype(dt))

  return jax.tree_util.tree_map(leaf, model.param_specs(cfg, mtp=mtp), is_leaf=_is_spec)
