"""One device's rows sorted by expert (``pallas_kernels.moe_router.sort_by_expert_local``).

Interpret mode returns the jnp reference's arrays bit for bit for every device of a split
(Kimi K2.6's 64 x 8 pairs over 8 devices of 48 experts, and small odd shapes); the local
rows come first, hold exactly the device's pairs in stable expert order (checked against
a numpy construction), and every row is written once; the weights' gradient is the
reference's; bad input; the expert-parallel dispatch on a kernel backend takes this path
and equals the "xla" dispatch; and the kernel compiles for an H200 to one launch without
spills.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import h200_compile_cases
from mlkit.model.moe import dispatch_experts
from pallas_kernels.moe_router import sort_by_expert_local, sort_by_expert_local_reference
from router_sort_refs import pairs as _pairs
from host_data import put
from router_sort_refs import sort_local_ref


class SortLocalTest(parameterized.TestCase):

  @parameterized.named_parameters(("kimi", 64, 8, 384, 48), ("odd", 7, 3, 12, 3),
                                  ("one_expert_each", 5, 2, 8, 1), ("one_pair", 1, 1, 4, 2))
  def test_interpret_equals_the_reference_on_every_device(self, n, k, e, n_local):
    ids, w = _pairs(0, n, k, e)
    run = jax.jit(lambda i, w, d: sort_by_expert_local(i, w, e, d, e // n_local,
                                                       backend="interpret"))
    for shard in range(e // n_local):
      d = put(np.int32(shard))
      got, want = run(ids, w, d), sort_local_ref(ids, w, e, d, e // n_local)
      for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=f"shard={shard}")

  def test_local_rows_come_first_in_stable_expert_order(self):
    n, k, e, n_local = 16, 4, 32, 8
    ids, w = _pairs(1, n, k, e)
    ids_np, w_np = np.asarray(ids).reshape(-1), np.asarray(w).reshape(-1)
    for shard in (0, 1, 3):
      first = shard * n_local
      token_of, row_w, slot, sizes = (np.asarray(a) for a in sort_by_expert_local(
          ids, w, e, put(np.int32(shard)), e // n_local, backend="interpret"))
      mine = [i for i in sorted(range(n * k), key=lambda i: (ids_np[i], i))
              if first <= ids_np[i] < first + n_local]
      count = len(mine)
      np.testing.assert_array_equal(sizes, np.bincount(ids_np[mine] - first,
                                                       minlength=n_local))
      np.testing.assert_array_equal(token_of[:count], np.asarray(mine) // k)
      np.testing.assert_array_equal(row_w[:count], w_np[mine])
      flat = slot.reshape(-1)
      for row, i in enumerate(mine):
        self.assertEqual(flat[i], row)
      self.assertTrue((np.delete(flat, mine) == -1).all())
      # Every row written once: the tokens of all rows are every pair's token once.
      np.testing.assert_array_equal(np.sort(token_of), np.arange(n * k) // k)
      np.testing.assert_array_equal(np.sort(row_w), np.sort(w_np))

  def test_weight_gradient_is_the_references(self):
    ids, w = _pairs(2, 9, 4, 16)
    cot, one = put(np.random.default_rng(3).normal(size=36).astype(np.float32), np.int32(1))

    def loss(fn):  # one program per gradient, where eagerly each operation is one
      return jax.jit(jax.grad(lambda w: jnp.sum(fn(w)[1] * cot)))(w)
    got = loss(lambda w: sort_by_expert_local(ids, w, 16, one, 4, backend="interpret"))
    want = loss(lambda w: sort_by_expert_local_reference(ids, w, 16, one, 4))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    self.assertTrue(np.asarray(got).any())

  def test_bad_input(self):
    ids, w = _pairs(4, 4, 2, 8)
    # The bad arrays are made in numpy and placed as they are: no program converts them.
    zero = put(np.int32(0))
    with self.assertRaisesRegex(ValueError, "n_shards must divide"):
      sort_by_expert_local(ids, w, 8, zero, 0, backend="interpret")
    with self.assertRaisesRegex(ValueError, "n_shards must divide"):
      sort_by_expert_local(ids, w, 8, zero, 3, backend="interpret")
    with self.assertRaisesRegex(ValueError, "shard must be an int32 scalar"):
      sort_by_expert_local(ids, w, 8, put(np.zeros((2,), np.int32)), 4, backend="interpret")
    with self.assertRaisesRegex(ValueError, "weights must be float32"):
      sort_by_expert_local(ids, put(np.asarray(w).astype(jnp.bfloat16)), 8, zero, 4)
    with self.assertRaisesRegex(ValueError, "expert_ids must be int32"):
      sort_by_expert_local(put(np.asarray(ids).astype(np.float32)), w, 8, zero, 4)


def _sorts(jaxpr, inside=False) -> list[bool]:
  """For each sort_by_expert kernel call in ``jaxpr`` (nested ones too), whether it runs
  inside a shard_map."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      if eqn.params.get("name") == "sort_by_expert":
        out.append(inside)
      continue
    for sub in jax_core.jaxprs_in_params(eqn.params):
      out += _sorts(sub, inside or eqn.primitive.name == "shard_map")
  return out


class ExpertParallelDispatchTest(absltest.TestCase):

  def test_kernel_backend_sorts_per_device_and_equals_xla(self):
    # 16 experts over 8 devices, a decode step's few rows: one pass, so each device
    # sorts its own rows (one sort_by_expert inside the shard_map, none outside).
    n, k, e, d, f = 12, 4, 16, 32, 16
    rng = np.random.default_rng(5)
    p = {name: (rng.normal(size=shape) / np.sqrt(shape[1])).astype(np.float32)
         for name, shape in (("w_gate", (e, d, f)), ("w_up", (e, d, f)), ("w_down", (e, f, d)))}
    x = put(rng.normal(size=(n, d)).astype(np.float32))
    ids, w = _pairs(6, n, k, e)
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    sharding = NamedSharding(mesh, PartitionSpec("ep"))
    p = jax.device_put(p, sharding)  # from the host: no program splits them

    def run(backend):
      return jax.jit(lambda p, x, i, w: dispatch_experts(p, x, i, w, e, backend=backend,
                                                         expert_sharding=sharding))
    closed = jax.make_jaxpr(run("interpret"))(p, x, ids, w)
    self.assertEqual(_sorts(closed.jaxpr), [True])  # one sort, inside the shard_map
    got, want = run("interpret")(p, x, ids, w), run("xla")(p, x, ids, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    self.assertGreater(np.abs(np.asarray(want)).max(), 0.1)


class SortLocalH200Test(h200_compile_cases.H200CompilerTest):

  def test_one_launch_without_spills(self):
    from pallas_kernels.h200 import compile as hc
    # Kimi K2.6's decode step on one of 8 H200s: 64 tokens x top-8, 48 of 384 experts.
    self.assert_one_launch_without_spills(
        jax.jit(lambda i, w, d: sort_by_expert_local(i, w, 384, d, 8, backend="pallas")),
        hc.spec((64, 8), jnp.int32), hc.spec((64, 8), jnp.float32), hc.spec((), jnp.int32),
        kernel="sort_by_expert")


if __name__ == "__main__":
  absltest.main()
