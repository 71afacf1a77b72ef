"""The router's kernels (``pallas_kernels.moe_router``): the expert choice, and the rows
sorted by expert, each in one Pallas Triton launch.

Expert choice:
Interpret mode against ``select_experts_reference`` (the same experts, weights and scores)
and against an independent numpy choice (a stable sort), at Kimi K2.6's, GLM 5.2's and
DeepSeek-V3's routing (384 and 256 experts, 8 groups keeping 4), the tiny presets', a
softmax router, N that is no power of two, k and E that are none, split-K partial logits,
and ties; bad input; ``mlkit.model.moe.route`` on the kernel backends against "xla"; and
compiles for an H200 at the decode and prefill shapes: one launch, no spills.

Sort by expert: interpret mode equals the jnp sort bit for bit (ragged routings, every
row to one expert, empty experts, N x k that is no power of two, up to MAX_ROWS); bad
input; the reference past MAX_ROWS pairs or MAX_EXPERTS experts; and H200 compiles.
"""

import dataclasses
import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import h200_compile_cases
from configs import TINY_MLA
from host_data import put
from router_sort_refs import select_ref, sort_ref
from mlkit.model import layers, moe
from pallas_kernels.moe_router import select_experts
from pallas_kernels.moe_router import select_experts_reference
from pallas_kernels.moe_router import sort_by_expert
from pallas_kernels.moe_router import sort_by_expert_reference
from pallas_kernels.moe_router.sort import MAX_EXPERTS
from pallas_kernels.moe_router.sort import MAX_ROWS


def _inputs(n, e, seed, *, bias=True, splits=0):
  rng = np.random.default_rng(seed)
  shape = (n, e) if not splits else (splits, n, e)
  logits = put(rng.normal(size=shape).astype(np.float32))
  b = put((rng.normal(size=(e,)) * 0.3).astype(np.float32)) if bias else None
  return logits, b


def _numpy_choice(logits, bias, *, top_k, router, n_group, topk_group, norm_topk_prob,
                  scaling):
  """float64 numpy: what the routing means, written without lax.top_k."""
  x = np.asarray(logits, np.float64)
  if x.ndim == 3:
    x = x.sum(0)
  n, e = x.shape
  if router == "sigmoid":
    scores = 1 / (1 + np.exp(-x))
    choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
  else:
    ex = np.exp(x - x.max(1, keepdims=True))
    scores = choice = ex / ex.sum(1, keepdims=True)
  if n_group > 1:
    g = choice.reshape(n, n_group, e // n_group)
    top2 = -np.sort(-g, axis=-1)[..., :min(2, e // n_group)].sum(-1)  # [N, G]
    keep = np.argsort(-top2, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((n, n_group), bool)
    np.put_along_axis(mask, keep, True, axis=1)
    choice = np.where(np.repeat(mask, e // n_group, axis=1), choice, -np.inf)
  ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
  w = np.take_along_axis(scores, ids, axis=-1)
  if norm_topk_prob:
    w = w / w.sum(-1, keepdims=True)
  return ids, w * scaling, scores


CASES = dict(
    # name: (N, E, routing)
    kimi_decode=(64, 384, dict(top_k=8, scaling=2.827)),
    glm_decode=(64, 256, dict(top_k=8, scaling=2.5)),
    deepseek_v3_groups=(24, 256, dict(top_k=8, n_group=8, topk_group=4, scaling=2.5)),
    tiny_groups=(5, 8, dict(top_k=2, n_group=2, topk_group=1)),
    softmax_no_bias=(17, 16, dict(top_k=2, router="softmax", norm_topk_prob=False)),
    k_and_e_not_powers_of_two=(6, 48, dict(top_k=6, n_group=4, topk_group=3)),
    one_token_one_expert=(1, 1, dict(top_k=1)),
    prefill_rows=(1536, 160, dict(top_k=6, scaling=16.0)),
)


def _routing(routing: dict) -> dict:
  """``routing`` with select_experts' defaults spelled out, in one order: the jitted
  reference is one program per shape and routing as written."""
  return dict(dict(router="sigmoid", n_group=1, topk_group=1, norm_topk_prob=True,
                   scaling=1.0), **routing)


class SelectExpertsInterpretTest(parameterized.TestCase):

  @parameterized.named_parameters((name, *case) for name, case in CASES.items())
  def test_matches_the_reference(self, n, e, routing):
    routing = _routing(routing)
    logits, bias = _inputs(n, e, seed=n * 1000 + e, bias=routing["router"] == "sigmoid")
    ids, w, scores = select_experts(logits, bias, backend="interpret", **routing)
    rids, rw, rscores = select_ref(logits, bias, **routing)
    self.assertEqual((ids.shape, ids.dtype), ((n, routing["top_k"]), jnp.int32))
    self.assertEqual((w.shape, scores.shape), ((n, routing["top_k"]), (n, e)))
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(scores, rscores, rtol=1e-6, atol=1e-7)
    # What the routing means, in float64 numpy: the same experts, close weights.
    nids, nw, nscores = _numpy_choice(logits, bias, **routing)
    np.testing.assert_array_equal(ids, nids)
    np.testing.assert_allclose(w, nw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, nscores, rtol=1e-5, atol=1e-6)

  def test_split_k_partials_are_added(self):
    parts, bias = _inputs(64, 384, seed=7, splits=16)
    # Kimi's decode routing, written as kimi_decode's case writes it: the summed logits'
    # reference below is that case's program.
    kw = _routing(CASES["kimi_decode"][2])
    self.assertEqual(kw, _routing(dict(top_k=8, scaling=2.827)))
    got = select_experts(parts, bias, backend="interpret", **kw)
    want = select_ref(parts, bias, **kw)
    for g, r in zip(got, want):
      np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
    # The same as the summed logits (the sum in the reference's order).
    summed = select_ref(put(np.asarray(parts).sum(0, dtype=np.float32)), bias, **kw)
    np.testing.assert_array_equal(got[0], summed[0])
    np.testing.assert_allclose(got[1], summed[1], rtol=1e-5)

  def test_ties_go_to_the_lower_expert(self):
    # Every token's scores repeat in pairs: the lower expert of a tied pair comes first,
    # and a tied group sum keeps the lower group.
    base = np.random.default_rng(3).normal(size=(8, 16)).astype(np.float32)
    logits = put(np.repeat(base, 2, axis=1))  # [8, 32]: experts 2i and 2i+1 tie
    for routing in (dict(top_k=5), dict(top_k=4, n_group=4, topk_group=2)):
      ids, _, _ = select_experts(logits, None, backend="interpret", **routing)
      rids, _, _ = select_ref(logits, None, **routing)
      np.testing.assert_array_equal(ids, rids)
      ids = np.asarray(ids)
      for row in ids:
        for a, b in zip(row, row[1:]):
          if a // 2 == b // 2:
            self.assertLess(a, b, ids)
    # The weights of a tie are equal: a bias that breaks it moves only the choice.
    bias = np.zeros((32,), np.float32)
    bias[1] = 1.0
    ids, w, _ = select_experts(logits, put(bias), top_k=1, norm_topk_prob=False,
                               backend="interpret")
    np.testing.assert_array_equal(np.asarray(ids)[:, 0], 1)
    # The sigmoid of expert 1's logit, in float64.
    np.testing.assert_allclose(np.asarray(w)[:, 0],
                               1 / (1 + np.exp(-np.float64(base[:, 0]))), rtol=1e-6)

  def test_bad_input_raises(self):
    logits, bias = _inputs(4, 8, seed=1)
    # The bad arrays are made in numpy and placed as they are: no program converts them.
    host, bias_host = np.asarray(logits), np.asarray(bias)
    wide = put(np.zeros((2, 4096), np.float32))
    for bad, kw, msg in (
        (put(host.astype(jnp.bfloat16)), {}, "logits must be float32"),
        (put(host[0]), {}, "logits must be float32"),
        (put(host[:0]), {}, "logits must be float32"),
        (logits, dict(bias=put(bias_host[:4])), r"bias must be float32 \[8\]"),
        (logits, dict(bias=put(bias_host.astype(jnp.bfloat16))),
         r"bias must be float32 \[8\]"),
        (logits, dict(router="relu"), "router must be one of"),
        (logits, dict(n_group=3), "n_group"),
        (logits, dict(n_group=2, topk_group=3), "topk_group"),
        (logits, dict(top_k=9), r"top_k must be in \[1, 8\]"),
        (logits, dict(top_k=5, n_group=2, topk_group=1), r"top_k must be in \[1, 4\]"),
        (wide, dict(backend="interpret"), "E must be at most"),
    ):
      kw = dict(dict(bias=None, top_k=2, backend="interpret"), **kw)
      with self.assertRaisesRegex(ValueError, msg):
        select_experts(bad, **kw)
    # The reference takes any E (run in one program).
    ids, _, _ = jax.jit(lambda x: select_experts(x, top_k=2, backend="xla"))(wide)
    self.assertEqual(ids.shape, (2, 2))


class GradientTest(parameterized.TestCase):
  """The kernels train: their gradients are the references' (custom VJPs)."""

  @parameterized.named_parameters(("sigmoid_groups", "sigmoid", 2, True),
                                  ("softmax", "softmax", 1, False),
                                  ("split_k", "sigmoid", 1, True))
  def test_select_experts_gradients(self, router, n_group, with_bias):
    splits = 4 if self._testMethodName.endswith("split_k") else 0
    logits, bias = _inputs(12, 16, seed=5, bias=with_bias, splits=splits)
    rng = np.random.default_rng(6)
    cw, cs = (put(rng.normal(size=s).astype(np.float32)) for s in ((12, 4), (12, 16)))
    kw = dict(top_k=4, router=router, n_group=n_group, scaling=2.0)

    def loss(fn, logits, bias):
      _, w, scores = fn(logits, bias, **kw)
      return jnp.sum(w * cw) + jnp.sum(scores * cs)

    kernel = lambda l, b, **k: select_experts(l, b, backend="interpret", **k)  # noqa: E731
    # Each gradient in one program, where eagerly every jnp operation is one.
    got = jax.jit(jax.grad(functools.partial(loss, kernel), argnums=(0, 1)))(logits, bias)
    want = jax.jit(jax.grad(functools.partial(loss, select_experts_reference),
                            argnums=(0, 1)))(logits, bias)
    self.assertGreater(np.abs(np.asarray(want[0])).max(), 0)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    if with_bias:
      np.testing.assert_allclose(got[1], want[1], atol=1e-7)

  def test_sort_by_expert_gradients(self):
    rng = np.random.default_rng(8)
    ids, w, c = put(rng.integers(0, 6, (10, 3)).astype(np.int32),
                    rng.random((10, 3)).astype(np.float32),
                    rng.normal(size=(30,)).astype(np.float32))
    grad = lambda fn: jax.jit(jax.grad(lambda w: jnp.sum(fn(ids, w)[1] * c)))(w)  # noqa: E731
    got = grad(lambda i, w: sort_by_expert(i, w, 6, backend="interpret"))
    want = grad(lambda i, w: sort_by_expert_reference(i, w, 6))
    np.testing.assert_array_equal(got, want)
    self.assertFalse(np.all(np.asarray(want) == 0))


class RouteTest(parameterized.TestCase):
  """``mlkit.model.moe.route`` on the kernel backend equals its "xla" routing."""

  @parameterized.named_parameters(("tiny_groups", 64, 10), ("wide_split_k", 2048, 64))
  def test_kernel_backend_routes_as_xla(self, d, n):
    cfg = dataclasses.replace(TINY_MLA, d_model=d)
    rng = np.random.default_rng(d)
    p = {"router": put((rng.normal(size=(d, cfg.n_routed_experts)) / np.sqrt(d))
                       .astype(np.float32)),
         "router_bias": put((rng.normal(size=(cfg.n_routed_experts,)) * 0.1)
                            .astype(np.float32))}
    x = put(rng.normal(size=(n, d)).astype(jnp.bfloat16))
    # One jitted kernel routing, run and then read: its trace and lowering are shared.
    route_kernel = jax.jit(lambda p, x: moe.route(p, x, cfg, backend="interpret"))
    got = route_kernel(p, x)
    want = jax.jit(lambda p, x: moe.route(p, x, cfg, backend="xla"))(p, x)
    np.testing.assert_array_equal(got[0], want[0])
    # Split-K adds the logits' parts in another order: f32 rounding only.
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    lowered = route_kernel.lower(p, x)
    self.assertEqual("sne" in lowered.as_text(debug_info=True),
                     d >= layers.ROUTER_SPLIT_MIN_D)


class SortByExpertInterpretTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("kimi_decode", 64, 8, 384, "ragged"), ("glm_decode", 64, 8, 256, "ragged"),
      ("one_expert_takes_all", 16, 4, 8, "one"), ("most_experts_empty", 9, 3, 64, "few"),
      ("odd_rows", 7, 3, 5, "ragged"), ("one_row", 1, 1, 1, "ragged"),
      ("max_rows", MAX_ROWS // 8, 8, 48, "ragged"))
  def test_equals_the_jnp_sort(self, n, k, e, kind):
    rng = np.random.default_rng(n * k + e)
    if kind == "one":
      ids = np.full((n, k), e - 1)
    elif kind == "few":
      ids = rng.choice([0, 17, 63], size=(n, k))
    else:  # skewed, as a router's choices are
      ids = rng.choice(e, size=(n, k), p=rng.dirichlet(np.ones(e) * 0.3))
    ids, w = put(np.asarray(ids, np.int32), rng.random((n, k)).astype(np.float32))
    got = sort_by_expert(ids, w, e, backend="interpret")
    want = sort_ref(ids, w, e)
    for name, g, r in zip(("token_of", "row_weights", "slot", "cum"), got, want):
      self.assertEqual((g.shape, g.dtype), (r.shape, r.dtype), name)
      np.testing.assert_array_equal(g, r, err_msg=name)
    # What the rows mean: sorted by expert, each (token, choice) once, at its slot.
    token_of, row_w, slot, cum = map(np.asarray, got)
    flat = np.asarray(ids).reshape(-1)
    np.testing.assert_array_equal(np.sort(np.asarray(slot).reshape(-1)), np.arange(n * k))
    np.testing.assert_array_equal(token_of[slot.reshape(-1)], np.arange(n * k) // k)
    np.testing.assert_array_equal(row_w[slot.reshape(-1)], np.asarray(w).reshape(-1))
    np.testing.assert_array_equal(np.diff(cum), np.bincount(flat, minlength=e))
    self.assertEqual(cum[0], 0)

  def test_bad_input_raises(self):
    ids_np, w_np = np.zeros((4, 2), np.int32), np.zeros((4, 2), np.float32)
    ids, w = put(ids_np, w_np)
    for args, msg in (((put(ids_np.astype(np.float32)), w, 8), "expert_ids must be int32"),
                      ((put(ids_np[0]), w, 8), "expert_ids must be int32"),
                      ((ids, put(w_np[:3]), 8), r"weights must be float32 \(4, 2\)"),
                      ((ids, put(w_np.astype(jnp.bfloat16)), 8), "weights must be float32"),
                      ((ids, w, 0), "n_experts must be positive")):
      with self.assertRaisesRegex(ValueError, msg):
        sort_by_expert(*args, backend="interpret")
    # Past MAX_ROWS pairs (a prefill's) or MAX_EXPERTS, the kernel backends run the
    # reference: no Pallas call, the same rows.
    rng = np.random.default_rng(2)
    for n, e in ((MAX_ROWS // 8 + 1, 8), (4, MAX_EXPERTS + 1)):
      ids, w = put(rng.integers(0, e, (n, 8)).astype(np.int32),
                   rng.random((n, 8)).astype(np.float32))
      run = lambda ids, w, e=e: sort_by_expert(ids, w, e, backend="interpret")  # noqa: E731
      self.assertNotIn("pallas_call", str(jax.make_jaxpr(run)(ids, w)))
      # Run in one program (no Pallas call: the reference's operations).
      for g, r in zip(jax.jit(run)(ids, w), sort_ref(ids, w, e)):
        np.testing.assert_array_equal(g, r)
    small = np.zeros((4, 8), np.int32)
    self.assertIn("pallas_call", str(jax.make_jaxpr(
        lambda i, w: sort_by_expert(i, w, 8, backend="interpret"))(
            small, small.astype(np.float32))))


class RouterKernelsH200Test(h200_compile_cases.H200CompilerTest):
  """Compiles for sm_90a at the routers' decode and prefill shapes."""

  @parameterized.named_parameters(
      ("kimi_decode_split_k", (16, 64, 384), 8, 1, 1), ("glm_decode", (64, 256), 8, 1, 1),
      ("kimi_prefill", (8192, 384), 8, 1, 1), ("deepseek_v3_groups", (64, 256), 8, 8, 4))
  def test_one_launch_without_spills(self, shape, top_k, n_group, topk_group):
    from pallas_kernels.h200 import compile as hc
    # The experts and weights need no slice (k = 8); the unread scores are dropped.
    self.assert_one_launch_without_spills(
        lambda logits, bias: select_experts(logits, bias, top_k=top_k, n_group=n_group,
                                            topk_group=topk_group, backend="pallas")[:2],
        hc.spec(shape, jnp.float32), hc.spec((shape[-1],), jnp.float32),
        kernel="select_experts")

  @parameterized.named_parameters(("kimi_decode", 64, 384), ("glm_decode", 64, 256),
                                  ("max_rows", MAX_ROWS // 8, 384))
  def test_sort_one_launch_without_spills(self, n, e):
    from pallas_kernels.h200 import compile as hc
    self.assert_one_launch_without_spills(
        lambda ids, w: sort_by_expert(ids, w, e, backend="pallas"),
        hc.spec((n, 8), jnp.int32), hc.spec((n, 8), jnp.float32), kernel="sort_by_expert")

if __name__ == "__main__":
  absltest.main()
