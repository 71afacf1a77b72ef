"""Contiguous per-sequence KV cache: the numerical reference for the paged cache.

A cache is any pytree with an ``update(layer, new, positions, batch_meta)``
method returning ``(cache, view, mask)``:

* ``new`` holds this step's entries, keyed like the view (MLA: ``latent``
  [B, T, C] and ``k_rope`` [B, T, R], plus ``index_k`` [B, T, Di] on a layer
  that runs the sparse-attention indexer; GQA: ``k`` and ``v`` [B, T, KV, hd]).
* ``view`` holds every key/value the step's queries may attend to, with the same
  keys and a length axis S in place of T.
* ``mask`` [B, T, S] says which of them each query may see: a
  :class:`~mlkit.model.masks.KeyMask` (query and key positions, never built whole
  for a long prefill) or a bool array.

A cache may also offer ``write(layer, new, positions, batch_meta) -> cache`` and
``decode_attention(layer, queries, batch_meta, *, scale, backend, sharding)`` (sharding:
None or an ``mlkit.parallel.DecodeSharding``, how to run it per device); the model then
runs decode steps (T == 1) through them, which is how the paged cache routes
decode attention to the Pallas kernels (MLA queries: (q_latent [B, H, C],
q_rope [B, H, R]) -> [B, H, C], or on the kernel backends a
``pallas_kernels.mla_absorb.AbsorbQuery`` whose absorbed product the decode op runs;
GQA: (q [B, H, hd],) -> [B, H, hd]).

The model only talks to this interface, so the paged cache can stand in for the
contiguous one with no change to model code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from mlkit.config import ModelConfig
from mlkit.model.masks import causal_mask


def cache_entry_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
  """Per-token cache entry shapes for one layer (without the batch/length axes).

  A layer that runs the sparse-attention indexer also caches its key (``index_k``
  [index_head_dim]).
  """
  if cfg.attention == "mla":
    shapes = {"latent": (cfg.kv_lora_rank,), "k_rope": (cfg.qk_rope_head_dim,)}
    if cfg.runs_indexer(layer):
      shapes["index_k"] = (cfg.index_head_dim,)
    return shapes
  return {"k": (cfg.n_kv_heads, cfg.head_dim), "v": (cfg.n_kv_heads, cfg.head_dim)}


@struct.dataclass
class ContiguousKVCache:
  """A dense [B, S_max, ...] cache per layer; slot s holds the token at position s.

  Attributes:
    layers: one dict per layer of arrays [B, S_max, *entry_shape].
  """

  layers: list

  @property
  def batch_size(self) -> int:
    return jax.tree_util.tree_leaves(self.layers[0])[0].shape[0]

  @property
  def max_len(self) -> int:
    return jax.tree_util.tree_leaves(self.layers[0])[0].shape[1]

  def update(self, layer: int, new: dict, positions: jax.Array, batch_meta=None):
    """Writes this step's entries at their positions and returns the whole layer.

    Args:
      layer: layer index.
      new: this step's entries, each [B, T, ...].
      positions: [B, T] int32 absolute positions (slot = position).
      batch_meta: unused by the contiguous cache.

    Returns:
      (cache, view, mask): the updated cache, the layer's full buffers
      [B, S_max, ...] and a causal :class:`KeyMask` [B, T, S_max] (slot <= query position).
    """
    del batch_meta
    b_idx = jnp.arange(positions.shape[0])[:, None]  # [B, 1]
    cur = self.layers[layer]
    upd = {name: cur[name].at[b_idx, positions].set(new[name].astype(cur[name].dtype))
           for name in cur}
    layers = list(self.layers)
    layers[layer] = upd
    return ContiguousKVCache(layers=layers), upd, causal_mask(positions, self.max_len)


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int | None = None,
               dtype=None) -> ContiguousKVCache:
  """An empty contiguous cache [B, max_len, ...] per layer in ``dtype`` (default cfg.dtype).

  Built by one program per configuration (op by op, every entry's zeros would compile a
  program of its own).
  """
  return _empty_cache(cfg, batch_size, max_len or cfg.max_seq_len,
                      jnp.dtype(dtype or cfg.dtype))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype) -> ContiguousKVCache:
  layers = [{name: jnp.zeros((batch_size, max_len) + shp, dtype)
             for name, shp in cache_entry_shapes(cfg, i).items()}
            for i in range(cfg.n_layers)]
  return ContiguousKVCache(layers=layers)


def no_cache_view(new: dict, positions: jax.Array, segment_ids: jax.Array | None = None):
  """View and causal mask for a cache-free forward: the chunk attends only to itself.

  With ``segment_ids`` [B, T] (packed rows of independent sequences), a token also sees
  only keys of its own segment, so each sequence attends exactly as it would alone.
  """
  # [B, T, T]: key position <= query position (and the same segment)
  return new, causal_mask(positions, positions.shape[1], key_pos=positions,
                          query_seg=segment_ids, key_seg=segment_ids)
