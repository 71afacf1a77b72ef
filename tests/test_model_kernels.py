"""The model runs its kernels through the dispatchers: interpret mode matches XLA.

Covers the model-level checks of the kernel issues: a paged decode step of the
tiny configs with backend="interpret" (the Pallas kernels, interpreted) against
backend="xla" (the references), and a tiny model with INT4 experts.
"""

import dataclasses
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_GQA, TINY_MLA
from mlkit.kvcache import KVCacheConfig, PageAllocator, init_paged_state, sync_tags
from mlkit.model import apply, forward
from mlkit.quant import INT4_EXPERTS, Int4Weight, quantize_params
from host_data import put
from numpy_params import init_params_np
from pallas_kernels import paged_attention

# TINY_MLA cut to one dense and one MoE layer: both FFN kinds and a second layer's cache,
# at two thirds of the compile time.
MLA = dataclasses.replace(TINY_MLA, n_layers=2)

# Jitted so the tiny model compiles once per backend instead of running op by op.
apply_jit = jax.jit(apply, static_argnames=("cfg", "backend"))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _prefilled(cfg, kv_dtype):
  """A paged state holding two prompts (lengths 5 and 3, pages of 4), plus decode metadata."""
  params = init_params_np(cfg)
  alloc = PageAllocator(16, 4)
  for rid, n in enumerate([5, 3]):
    alloc.admit(rid, n)
  state = sync_tags(init_paged_state(cfg, KVCacheConfig(16, 4, kv_dtype)), alloc.device_tags())
  # Made on the host and placed with device_put: a jnp cast or jnp.asarray compiles a program.
  toks = put(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32))
  pos = put(np.broadcast_to(np.arange(5, dtype=np.int32), (2, 5)))
  _, state = apply_jit(params, toks, pos, state, cfg=cfg, batch_meta=alloc.batch_meta([0, 1], 4))
  for rid, n in enumerate([6, 4]):
    alloc.extend(rid, n)
  return params, state, alloc.batch_meta([0, 1], 4)


class PagedDecodeBackendTest(parameterized.TestCase):

  @parameterized.parameters((MLA, "float8_e4m3fn"), (TINY_GQA, "float8_e4m3fn"),
                            (MLA, "float32"))
  def test_interpret_matches_xla(self, cfg, kv_dtype):
    params, state, meta = _prefilled(cfg, kv_dtype)
    tokens, positions = put(np.array([[7], [9]], np.int32), np.array([[5], [3]], np.int32))
    # Copied through the host: an eager jnp.copy (or jnp.asarray) compiles a program per leaf.
    copy = jax.tree.map(lambda x: put(np.asarray(x)), state)
    op = "paged_mla_decode" if cfg.attention == "mla" else "paged_gqa_decode"
    spy = mock.Mock(wraps=getattr(paged_attention, op))
    with mock.patch.object(paged_attention, op, spy):
      ref, ref_state = apply_jit(params, tokens, positions, state, cfg=cfg, batch_meta=meta,
                                 backend="xla")
      out, out_state = apply_jit(params, tokens, positions, copy, cfg=cfg, batch_meta=meta,
                                 backend="interpret")
    # Decode attention went through the kernel dispatcher once per layer and backend.
    self.assertEqual(spy.call_count, 2 * cfg.n_layers)
    self.assertEqual({c.kwargs["backend"] for c in spy.call_args_list}, {"xla", "interpret"})
    self.assertTrue(np.all(np.isfinite(np.asarray(out))))
    self.assertLess(rel_err(out, ref), 1e-5)
    # Both wrote the same new entries (later layers' entries differ by f32 rounding
    # of the earlier layers' attention).
    for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(out_state)):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-5, atol=1e-5)


class Int4ModelBackendTest(absltest.TestCase):

  def test_int4_experts_interpret_matches_xla(self):
    cfg = MLA
    # Quantised in one compiled program rather than op by op.
    qparams = jax.jit(lambda p: quantize_params(p, INT4_EXPERTS))(init_params_np(cfg))
    self.assertIsInstance(qparams["layers"][1]["ffn"]["w_gate"], Int4Weight)
    toks = put(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 4)).astype(np.int32))
    ref = forward(qparams, toks, cfg=cfg, backend="xla")
    out = forward(qparams, toks, cfg=cfg, backend="interpret")
    self.assertTrue(np.all(np.isfinite(np.asarray(out))))
    # The kernel feeds bf16 activations to the tensor cores; the reference keeps f32.
    self.assertLess(rel_err(out, ref), 1e-2)


if __name__ == "__main__":
  absltest.main()
