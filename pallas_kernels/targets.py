"""The kernel shapes the report's deployments run on one H200, as data.

One list serves the deviceless compile tests (every case through ptxas with zero
spills, ``pallas_kernels.h200.kernel_readings``), the roofline sheet
(``pallas_kernels.roofline``), the INT4 block-size derivation
(``pallas_kernels.int4_matmul.tune``), the ``kernels`` experiment and
``scripts/gpu_check.py`` (target shapes first): the kernels' own list of the shapes
they are for, as tokamax keeps its ``arg_specs`` beside each kernel. Every dimension
comes from the model presets and the deployment's parallelism. pallas_kernels sits
below ``configs`` and mlkit, so it cannot import the presets: :class:`TargetModel`
holds the fields of ``configs.KIMI_K2_6`` and ``configs.GLM_5_2`` that the shapes
read, and tests/test_kernel_compile.py checks them against the presets field for
field, so a preset change fails there until the targets move with it:

* **MLA decode** (absorbed form: latent ``kv_lora_rank`` + rope key
  ``qk_rope_head_dim``, page 64): heads per device under tensor parallelism 8
  (64 / 8 = 8) and under data-parallel attention (all 64 heads); batch 1-64,
  contexts 4K-128K, bf16 and fp8 pages. Both models have 64 heads, 512 + 64
  entries, so their decode kernels are the same shapes.
* **INT4 dense**: the attention and dense-FFN projections per device at TP 8
  (replicated ``wq_a``/``wkv_a``, column-split ``wq_b``/``wkv_b``/gate/up,
  row-split ``wo``/down), decode and prefill token counts, groups 32 and 128.
* **INT4 grouped**: the routed experts per device at expert parallelism 8
  (Kimi 384 / 8 = 48, GLM 256 / 8 = 32), gate/up and down, 1-64 rows per expert
  (decode) and a prefill chunk's rows, groups 32 and 128.
* **Tag check**: a full H200's KV budget in pages (the report's ~1.37M fp8
  tokens of Kimi at page 64), 64 requests of 128K tokens.
* **GQA decode**: head_dim 128, groups 1-16, bf16 and fp8 (the GQA path of the
  model; not in the report's models).
* **Sparse MLA decode** (GLM 5's DeepSeek Sparse Attention, absorbed form over the
  ``index_topk`` = 2048 positions the indexer selected, page 64): heads per device
  under TP 8 (8) and data-parallel attention (64), batch 1-64, contexts 32K and 128K
  (at least ``index_topk``, so the selection is sparse), bf16 and fp8 pages.
* **Indexer scoring** (GLM 5's lightning indexer over the paged index keys): all
  ``index_n_heads`` = 32 heads of ``index_head_dim`` = 128 under either parallelism
  (the indexer is replicated), the same batches, contexts and page dtypes.
* **Top-k selection** (the indexer's scores to ``index_topk`` = 2048 positions per
  request): the same batches and contexts.

A case holds shapes and static arguments only; callers make abstract inputs
(``jax.ShapeDtypeStruct``) for compiles or random arrays for timed runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TargetModel:
  """The fields of a model preset (``configs.models``) that the target shapes read.

  Attributes:
    name: the preset's name (part of the INT4 case names, e.g. "int4/kimi-k2.6/...").
    The others: as in ``mlkit.config.ModelConfig``.
  """

  name: str
  d_model: int
  n_heads: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  dense_ffn_dim: int
  moe_ffn_dim: int
  n_routed_experts: int
  top_k: int
  index_n_heads: int = 0
  index_head_dim: int = 0
  index_topk: int = 0
  indexer_types: tuple[str, ...] = ()


# configs.KIMI_K2_6 and configs.GLM_5_2, as far as the shapes read them.
KIMI_K2_6 = TargetModel(
    name="kimi-k2.6", d_model=7168, n_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, dense_ffn_dim=18432,
    moe_ffn_dim=2048, n_routed_experts=384, top_k=8)
GLM_5_2 = dataclasses.replace(
    KIMI_K2_6, name="glm-5.2", d_model=6144, q_lora_rank=2048, qk_nope_head_dim=192,
    v_head_dim=256, dense_ffn_dim=12288, n_routed_experts=256, index_n_heads=32,
    index_head_dim=128, index_topk=2048, indexer_types=("full",) * 78)

FP8 = jnp.float8_e4m3fn
PAGE_SIZE = 64  # MLA page: 64 tokens (one wgmma N tile per page)
TP = 8  # tensor parallelism of the report's 8x H200 deployments
EP = 8  # expert parallelism of the same
KV_TOKENS_PER_H200 = 1_372_000  # the report's fp8 KV capacity of Kimi K2.6 on one H200

KERNELS = ("paged_mla_decode", "paged_gqa_decode", "int4_matmul", "int4_grouped_matmul",
           "tag_check", "paged_mla_sparse_decode", "paged_index_scores", "topk_positions",
           "fp8_grouped_matmul")


@dataclasses.dataclass(frozen=True)
class KernelCase:
  """One kernel at one target shape.

  Attributes:
    kernel: one of KERNELS (the public op in pallas_kernels).
    name: unique, readable id, e.g. "mla/tp8/fp8/b64/ctx131072".
    model: which deployment the shape comes from ("Kimi K2.6", "GLM 5.2", "both", "GQA").
    dims: the shape parameters (kernel-specific keys, see ``arg_shapes``).
  """

  kernel: str
  name: str
  model: str
  dims: tuple[tuple[str, object], ...]

  @property
  def d(self) -> dict:
    return dict(self.dims)

  def arg_shapes(self) -> list[tuple[tuple[int, ...], object] | None]:
    """(shape, dtype) of each positional argument of the op (None for an absent scale)."""
    d = self.d
    if self.kernel == "paged_mla_decode":
      b, h, c, r, ps, n, p = (d[k] for k in ("batch", "heads", "c", "r", "page_size",
                                              "num_pages", "max_pages"))
      dt = FP8 if d["kv"] == "fp8" else jnp.bfloat16
      sc = ((n, ps), jnp.float32) if d["kv"] == "fp8" else None
      return [((b, h, c), jnp.bfloat16), ((b, h, r), jnp.bfloat16), ((n, ps, c), dt),
              ((n, ps, r), dt), sc, sc, ((b, p), jnp.int32), ((b,), jnp.int32)]
    if self.kernel == "paged_gqa_decode":
      b, kv, g, hd, ps, n, p = (d[k] for k in ("batch", "kv_heads", "group", "head_dim",
                                               "page_size", "num_pages", "max_pages"))
      dt = FP8 if d["kv"] == "fp8" else jnp.bfloat16
      sc = ((n, ps, kv), jnp.float32) if d["kv"] == "fp8" else None
      return [((b, kv * g, hd), jnp.bfloat16), ((n, ps, kv, hd), dt), ((n, ps, kv, hd), dt),
              sc, sc, ((b, p), jnp.int32), ((b,), jnp.int32)]
    if self.kernel == "int4_matmul":
      m, k, n, g = d["m"], d["k"], d["n"], d["group_size"]
      return [((m, k), jnp.bfloat16), ((k // 2, n), jnp.uint8), ((k // g, n), jnp.bfloat16)]
    if self.kernel == "int4_grouped_matmul":
      m, k, n, g, e = d["m"], d["k"], d["n"], d["group_size"], d["experts"]
      return [((m, k), jnp.bfloat16), ((e, k // 2, n), jnp.uint8), ((e, k // g, n), jnp.bfloat16),
              ((e,), jnp.int32)]
    if self.kernel == "fp8_grouped_matmul":
      m, k, n, e = d["m"], d["k"], d["n"], d["experts"]
      b = 128  # one f32 scale per 128 x 128 block (fp8_matmul.reference checks the shape)
      return [((m, k), jnp.bfloat16), ((e, k, n), FP8), ((e, -(-k // b), -(-n // b)), jnp.float32),
              ((e,), jnp.int32)]
    if self.kernel == "tag_check":
      b, p, n = d["batch"], d["max_pages"], d["num_pages"]
      return [((n,), jnp.int32), ((b, p), jnp.int32), ((b, p), jnp.int32), ((b,), jnp.int32)]
    if self.kernel == "paged_mla_sparse_decode":
      b, h, c, r, ps, n, p, k = (d[x] for x in ("batch", "heads", "c", "r", "page_size",
                                                 "num_pages", "max_pages", "topk"))
      dt = FP8 if d["kv"] == "fp8" else jnp.bfloat16
      sc = ((n, ps), jnp.float32) if d["kv"] == "fp8" else None
      return [((b, h, c), jnp.bfloat16), ((b, h, r), jnp.bfloat16), ((n, ps, c), dt),
              ((n, ps, r), dt), sc, sc, ((b, p), jnp.int32), ((b,), jnp.int32),
              ((b, k), jnp.int32)]
    if self.kernel == "paged_index_scores":
      b, hi, di, ps, n, p = (d[x] for x in ("batch", "index_heads", "index_dim", "page_size",
                                             "num_pages", "max_pages"))
      dt = FP8 if d["kv"] == "fp8" else jnp.bfloat16
      sc = ((n, ps), jnp.float32) if d["kv"] == "fp8" else None
      return [((b, hi, di), jnp.bfloat16), ((b, hi), jnp.float32), ((n, ps, di), dt), sc,
              ((b, p), jnp.int32), ((b,), jnp.int32)]
    if self.kernel == "topk_positions":
      return [((d["batch"], d["context"]), jnp.float32)]
    raise ValueError(f"unknown kernel {self.kernel!r}")

  def static_kwargs(self) -> dict:
    """Static keyword arguments of the op other than backend and block sizes."""
    d = self.d
    if self.kernel in ("paged_mla_decode", "paged_mla_sparse_decode"):
      return {"scale": 1.0 / math.sqrt(d["qk_head_dim"])}
    if self.kernel == "paged_index_scores":
      return {}
    if self.kernel == "topk_positions":
      return {"k": d["topk"]}
    if self.kernel == "paged_gqa_decode":
      return {"scale": 1.0 / math.sqrt(d["head_dim"])}
    if self.kernel in ("int4_matmul", "int4_grouped_matmul"):
      return {"group_size": d["group_size"]}
    if self.kernel == "fp8_grouped_matmul":
      return {}
    return {"page_size": d["page_size"]}


def kernel_case(kernel, name, model, **dims) -> KernelCase:
  """A KernelCase of ``kernel`` named ``name`` for ``model``, its dims in keyword order."""
  return KernelCase(kernel, name, model, tuple(dims.items()))


MLA_BATCHES = (1, 8, 64)
MLA_CONTEXTS = (4096, 32768, 131072)


def mla_cases() -> list[KernelCase]:
  """MLA decode per device: TP 8 and data-parallel heads x batch x context x bf16/fp8."""
  for cfg in (KIMI_K2_6, GLM_5_2):  # the kernels below cover both only while this holds
    assert (cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (64, 512, 64), cfg.name
  c, r = KIMI_K2_6.kv_lora_rank, KIMI_K2_6.qk_rope_head_dim
  cases = []
  for (par, heads), kv, b, ctx in itertools.product(
      (("tp8", KIMI_K2_6.n_heads // TP), ("dp", KIMI_K2_6.n_heads)), ("bf16", "fp8"),
      MLA_BATCHES, MLA_CONTEXTS):
    p = ctx // PAGE_SIZE
    cases.append(kernel_case("paged_mla_decode", f"mla/{par}/{kv}/b{b}/ctx{ctx}", "both",
                       batch=b, heads=heads, c=c, r=r, page_size=PAGE_SIZE, context=ctx,
                       max_pages=p, num_pages=b * p + 1, kv=kv,
                       qk_head_dim=KIMI_K2_6.qk_nope_head_dim + r))
  return cases


DECODE_TOKENS = (1, 8, 64)
PREFILL_TOKENS = 4096
GROUPS = (32, 128)


def _dense_projections(cfg) -> list[tuple[str, int, int]]:
  """(name, K, N) of the attention and dense-FFN projections on one device at TP 8."""
  h = cfg.n_heads // TP
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  return [
      ("wq_a", cfg.d_model, cfg.q_lora_rank),  # replicated
      ("wq_b", cfg.q_lora_rank, h * qk),
      ("wkv_a", cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim),  # replicated
      ("wkv_b", cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
      ("wo", h * cfg.v_head_dim, cfg.d_model),
      ("ffn_up", cfg.d_model, cfg.dense_ffn_dim // TP),
      ("ffn_down", cfg.dense_ffn_dim // TP, cfg.d_model),
  ]


def int4_dense_cases() -> list[KernelCase]:
  """INT4 dense projections per device, decode and prefill, groups 32 and 128."""
  cases = []
  for cfg, model in ((KIMI_K2_6, "Kimi K2.6"), (GLM_5_2, "GLM 5.2")):
    for (proj, k, n), m, g in itertools.product(_dense_projections(cfg),
                                                DECODE_TOKENS + (PREFILL_TOKENS,), GROUPS):
      if k % g:
        continue
      cases.append(kernel_case("int4_matmul", f"int4/{cfg.name}/{proj}/m{m}/g{g}", model,
                         m=m, k=k, n=n, group_size=g))
  return cases


ROWS_PER_EXPERT = (1, 8, 64)


def int4_grouped_cases() -> list[KernelCase]:
  """Routed experts per device at EP 8: gate/up and down, decode and prefill rows, g 32/128."""
  cases = []
  for cfg, model in ((KIMI_K2_6, "Kimi K2.6"), (GLM_5_2, "GLM 5.2")):
    e = cfg.n_routed_experts // EP
    # A prefill chunk of PREFILL_TOKENS tokens routes top_k rows each, spread over EP devices.
    prefill_rows = PREFILL_TOKENS * cfg.top_k // EP
    rows = [(f"r{r}", r * e) for r in ROWS_PER_EXPERT] + [("prefill", prefill_rows)]
    for (proj, k, n), (rname, m), g in itertools.product(
        (("up", cfg.d_model, cfg.moe_ffn_dim), ("down", cfg.moe_ffn_dim, cfg.d_model)),
        rows, GROUPS):
      cases.append(kernel_case("int4_grouped_matmul", f"int4g/{cfg.name}/{proj}/{rname}/g{g}", model,
                         m=m, k=k, n=n, group_size=g, experts=e))
  return cases


def fp8_grouped_cases() -> list[KernelCase]:
  """GLM 5.2's routed experts with FP8 weights (its published checkpoint, the report's
  prefill pool) per device at EP 8: gate/up and down, decode and prefill rows."""
  cfg = GLM_5_2
  e = cfg.n_routed_experts // EP
  rows = [(f"r{r}", r * e) for r in ROWS_PER_EXPERT] + [("prefill", PREFILL_TOKENS * cfg.top_k // EP)]
  return [kernel_case("fp8_grouped_matmul", f"fp8g/{cfg.name}/{proj}/{rname}", "GLM 5.2",
                      m=m, k=k, n=n, experts=e)
          for (proj, k, n), (rname, m) in itertools.product(
              (("up", cfg.d_model, cfg.moe_ffn_dim), ("down", cfg.moe_ffn_dim, cfg.d_model)), rows)]


def tag_check_cases() -> list[KernelCase]:
  """The tag check over a full H200 KV budget of pages, 64 requests of 128K tokens."""
  n = KV_TOKENS_PER_H200 // PAGE_SIZE
  cases = []
  for b in (1, 64):
    p = 131072 // PAGE_SIZE
    cases.append(kernel_case("tag_check", f"tag/b{b}/pool{n}", "both", batch=b, max_pages=p,
                       num_pages=n, page_size=PAGE_SIZE))
  return cases


GQA_GROUPS = (1, 2, 4, 8, 16)


def gqa_cases() -> list[KernelCase]:
  """GQA decode, head_dim 128, 8 KV heads, groups 1-16, page 16, bf16 and fp8."""
  cases = []
  kv_heads, hd, ps = 8, 128, 16
  for g, kv, (b, ctx) in itertools.product(GQA_GROUPS, ("bf16", "fp8"),
                                           ((1, 32768), (64, 4096))):
    p = ctx // ps
    cases.append(kernel_case("paged_gqa_decode", f"gqa/g{g}/{kv}/b{b}/ctx{ctx}", "GQA",
                       batch=b, kv_heads=kv_heads, group=g, head_dim=hd, page_size=ps,
                       context=ctx, max_pages=p, num_pages=b * p + 1, kv=kv))
  return cases


SPARSE_CONTEXTS = (32768, 131072)  # both above GLM 5.2's index_topk: the selection is sparse


def _sparse_config():
  """GLM 5.2, checked to run DeepSeek Sparse Attention at the shapes the cases assume."""
  cfg = GLM_5_2
  assert cfg.indexer_types and "full" in cfg.indexer_types, cfg.name
  assert cfg.index_topk <= min(SPARSE_CONTEXTS), cfg.index_topk
  return cfg


def sparse_mla_cases() -> list[KernelCase]:
  """GLM 5.2's sparse MLA decode per device: TP 8 and data-parallel heads x batch x
  context x bf16/fp8, over K = index_topk selected positions."""
  cfg = _sparse_config()
  c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
  cases = []
  for (par, heads), kv, b, ctx in itertools.product(
      (("tp8", cfg.n_heads // TP), ("dp", cfg.n_heads)), ("bf16", "fp8"), MLA_BATCHES,
      SPARSE_CONTEXTS):
    p = ctx // PAGE_SIZE
    cases.append(kernel_case("paged_mla_sparse_decode", f"sparse_mla/{par}/{kv}/b{b}/ctx{ctx}",
                       "GLM 5.2", batch=b, heads=heads, c=c, r=r, page_size=PAGE_SIZE,
                       context=ctx, max_pages=p, num_pages=b * p + 1, kv=kv,
                       topk=cfg.index_topk, qk_head_dim=cfg.qk_nope_head_dim + r))
  return cases


def indexer_cases() -> list[KernelCase]:
  """GLM 5.2's indexer scoring per device: all index heads (the indexer is replicated
  under either parallelism) x batch x context x bf16/fp8 index keys."""
  cfg = _sparse_config()
  cases = []
  for kv, b, ctx in itertools.product(("bf16", "fp8"), MLA_BATCHES, SPARSE_CONTEXTS):
    p = ctx // PAGE_SIZE
    cases.append(kernel_case("paged_index_scores", f"indexer/{kv}/b{b}/ctx{ctx}", "GLM 5.2",
                       batch=b, index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim,
                       page_size=PAGE_SIZE, context=ctx, max_pages=p, num_pages=b * p + 1,
                       kv=kv))
  return cases


def topk_cases() -> list[KernelCase]:
  """GLM 5.2's top-k selection per device: a request's index scores to index_topk
  positions, batch x context."""
  cfg = _sparse_config()
  return [kernel_case("topk_positions", f"topk/b{b}/ctx{ctx}", "GLM 5.2", batch=b, context=ctx,
                topk=cfg.index_topk)
          for b, ctx in itertools.product(MLA_BATCHES, SPARSE_CONTEXTS)]


def target_cases(kernels: tuple[str, ...] = KERNELS) -> list[KernelCase]:
  """Every target case of the given kernels, in KERNELS order."""
  builders = {"paged_mla_decode": mla_cases, "paged_gqa_decode": gqa_cases,
              "int4_matmul": int4_dense_cases, "int4_grouped_matmul": int4_grouped_cases,
              "tag_check": tag_check_cases, "paged_mla_sparse_decode": sparse_mla_cases,
              "paged_index_scores": indexer_cases, "topk_positions": topk_cases,
              "fp8_grouped_matmul": fp8_grouped_cases}
  unknown = [k for k in kernels if k not in builders]
  if unknown:
    raise ValueError(f"unknown kernel(s) {unknown}; known: {KERNELS}")
  return [c for k in kernels for c in builders[k]()]
