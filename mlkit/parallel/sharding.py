"""Logical-axis rules and the placement of params and paged KV state on a mesh.

Every parameter axis gets a *logical* name from the parameter's path (see
:func:`param_logical_axes`); :class:`ShardingRules` maps logical names to mesh
axes. Defaults:

* tensor parallel: attention heads (``wq``/``wq_b``/``wkv_b`` columns, ``wo``
  rows), GQA KV heads, dense/shared FFN width and the vocabulary;
* expert parallel: the routed experts' leading axis;
* replicated: norms, routers, MLA's low-rank down projections (``wq_a``,
  ``wkv_a``: tiny, and every head needs their whole output).

Quantised weights shard like the dense weight they replace. ``Int4Weight``'s
``packed`` [..., K//2, N] and ``scales`` [..., K//g, N] get the same spec (layout
"nk", packed [..., N, K], the same with its last two entries swapped), and
K is only split when every shard holds whole groups (so a shard's packed rows
and its scale rows describe the same input rows). ``Fp8Weight`` with 128x128
block scales only splits an axis whose shards hold whole blocks; per-channel
scales drop the K entry. An axis that cannot be split that way, or whose size the
mesh axis does not divide, is replicated instead: placement only changes
communication, never results, since GSPMD keeps every computation exact.

Paged KV state: MLA pages (one latent + rope key per token, shared by all heads,
plus the sparse-attention index key on a layer that runs the indexer) are
replicated across the tensor axis, as SGLang does, which is why KV capacity
is per device; with ``data_parallel=True`` the page axis is split over ``data``.
GQA pages are split over KV heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mlkit.kvcache import PagedKVState
from mlkit.parallel.mesh import AXES, axis_size
from mlkit.quant import Fp8Weight, Int4Weight
from mlkit.quant.tree import flatten_params

# A mesh-axis assignment: one axis name, a tuple of names (split over their product), or None.
MeshAxes = Union[str, tuple, None]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis name -> mesh axes.

  Raises:
    ValueError: naming the field if it names an axis outside ("data", "tensor", "expert").
  """

  # Attention heads: columns of wq / wq_b / wkv_b, rows of wo.
  heads: MeshAxes = "tensor"
  # GQA KV heads: columns of wk / wv, and the head axis of GQA KV pages.
  kv_heads: MeshAxes = "tensor"
  # Dense-layer and shared-expert FFN width.
  mlp: MeshAxes = "tensor"
  # The routed experts' leading axis.
  experts: MeshAxes = "expert"
  # FFN width inside each routed expert (None: each expert lives whole on its devices).
  expert_mlp: MeshAxes = None
  # Vocabulary: embedding rows, lm_head columns.
  vocab: MeshAxes = "tensor"
  # Model width (the residual stream); replicated by default.
  embed: MeshAxes = None
  # KV page axis under data-parallel attention (used only with data_parallel=True).
  pages: MeshAxes = "data"

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      names = () if v is None else (v,) if isinstance(v, str) else tuple(v)
      bad = [a for a in names if a not in AXES]
      if bad or not all(isinstance(a, str) for a in names):
        raise ValueError(f"ShardingRules.{f.name} must name mesh axes from {AXES}, got {v!r}")

  def mesh_axes(self, logical: str | None) -> MeshAxes:
    """The mesh axes for a logical axis name (None for None or an unknown name)."""
    if logical is None or logical not in self.__dataclass_fields__:
      return None
    return getattr(self, logical)

  def as_rules(self) -> tuple[tuple[str, MeshAxes], ...]:
    """The rules as (logical, mesh axes) pairs, flax's logical-axis-rules form."""
    return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


DEFAULT_RULES = ShardingRules()

# Attention projections by name: logical axes of the dense [in, out] weight.
_ATTN_AXES = {
    "wq": (None, "heads"), "wq_b": (None, "heads"), "wkv_b": (None, "heads"),
    "wq_a": (None, None), "wkv_a": (None, None), "wo": ("heads", None),
    "wk": (None, "kv_heads"), "wv": (None, "kv_heads"),
}


def logical_axes_for(path: str, ndim: int) -> tuple:
  """Logical axis names of one parameter's dense shape, from its path and rank.

  Args:
    path: "/"-joined parameter path, e.g. "layers/2/ffn/w_down".
    ndim: rank of the dense weight.

  Returns:
    A tuple of ndim logical names (None = never split).
  """
  parts = path.split("/")
  name = parts[-1]
  # A multi-token-prediction layer's own embedding and head ("mtp/0/embed") split like the model's.
  top = path if parts[0] != "mtp" or len(parts) != 3 else name
  if top == "embed":
    return ("vocab", "embed")
  if top == "lm_head":
    return ("embed", "vocab")
  if ndim == 1 or name.startswith("router"):
    return (None,) * ndim
  if "attn" in parts and name in _ATTN_AXES and ndim == 2:
    return _ATTN_AXES[name]
  if "ffn" in parts and name in ("w_gate", "w_up", "w_down"):
    if ndim == 3:  # routed experts [E, in, out]
      return ("experts", None, "expert_mlp") if name != "w_down" else ("experts", "expert_mlp", None)
    return (None, "mlp") if name != "w_down" else ("mlp", None)
  return (None,) * ndim


def param_logical_axes(params) -> Any:
  """{path: logical axes} for every parameter (quantised weights as one entry)."""
  flat, _ = flatten_params(params)
  return {p: logical_axes_for(p, len(leaf.shape)) for p, leaf in flat}


def _axis_ok(size: int, n: int, unit: int = 1) -> bool:
  """Whether ``size`` splits into n shards that each hold whole ``unit``s."""
  return n == 1 or size % (n * unit) == 0


def _dense_spec(shape, logical, rules: ShardingRules, mesh: Mesh, units=None, counts=None) -> list:
  """Per-axis mesh axes for a dense shape; axes that cannot split cleanly stay None.

  ``units[i]``: each shard of axis i must hold whole multiples of it (int4 groups,
  fp8 blocks). ``counts[logical]``: the axis holds that many equal items (heads,
  experts), and each shard must hold whole items.
  """
  units = units or (1,) * len(shape)
  counts = counts or {}
  used: set = set()
  spec = []
  for size, name, unit in zip(shape, logical, units):
    axes = rules.mesh_axes(name)
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    n = axis_size(mesh, axes)
    whole_items = name not in counts or counts[name] % n == 0
    if (not names or used & set(names) or not _axis_ok(size, n, unit) or n == 1
        or not whole_items):
      spec.append(None)
      continue
    used |= set(names)
    spec.append(axes)
  return spec


def leaf_partition_spec(leaf, logical: tuple, rules: ShardingRules, mesh: Mesh,
                        counts: dict | None = None):
  """The PartitionSpec(s) for one parameter (a matching Int4Weight / Fp8Weight of specs for quantised ones).

  Args:
    leaf: an array, a ShapeDtypeStruct, or an Int4Weight / Fp8Weight.
    logical: its dense logical axes (see :func:`logical_axes_for`).
    rules: the sharding rules.
    mesh: the mesh (axis sizes decide what divides).
    counts: optional {logical name: items along it} (e.g. {"heads": 64}); such an
      axis is only split when every shard holds whole items.

  Returns:
    A PartitionSpec, or for quantised weights the same dataclass holding one
    PartitionSpec per array.
  """
  shape = tuple(leaf.shape)  # the dense shape for quantised weights too
  nd = len(shape)
  if isinstance(leaf, Int4Weight):
    # K (axis -2) splits only into shards of whole groups, so packed rows and scale rows agree.
    units = [1] * nd
    units[-2] = leaf.group_size
    spec = _dense_spec(shape, logical, rules, mesh, units, counts)
    ps = PartitionSpec(*spec)
    # Layout "nk" holds the codes transposed ([..., N, K]): the same split, K and N swapped.
    packed = PartitionSpec(*spec[:-2], spec[-1], spec[-2]) if leaf.layout == "nk" else ps
    return Int4Weight(packed=packed, scales=ps, group_size=leaf.group_size, layout=leaf.layout)
  if isinstance(leaf, Fp8Weight):
    if leaf.block_size is None:
      spec = _dense_spec(shape, logical, rules, mesh, counts=counts)
      scale_spec = spec[:-2] + spec[-1:]  # per-channel scales [..., N] have no K axis
      return Fp8Weight(values=PartitionSpec(*spec), scales=PartitionSpec(*scale_spec),
                       block_size=None)
    units = [1] * nd
    units[-2] = units[-1] = leaf.block_size  # whole 128x128 blocks per shard
    spec = _dense_spec(shape, logical, rules, mesh, units, counts)
    ps = PartitionSpec(*spec)
    return Fp8Weight(values=ps, scales=ps, block_size=leaf.block_size)
  return PartitionSpec(*_dense_spec(shape, logical, rules, mesh, counts=counts))


def model_counts(cfg) -> dict:
  """{logical axis: items along it} for a ModelConfig: heads, KV heads and experts stay whole."""
  counts = {"heads": cfg.n_heads, "experts": cfg.n_routed_experts}
  if cfg.attention == "gqa":
    counts["kv_heads"] = cfg.n_kv_heads
  return counts


def param_partition_specs(params, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, cfg=None):
  """A tree like ``params`` with a PartitionSpec per array (see :func:`leaf_partition_spec`).

  Args:
    params: params tree (arrays, ShapeDtypeStructs or quantised weights).
    mesh: the mesh.
    rules: logical-axis rules.
    cfg: optional ModelConfig; with it, head and expert axes are only split into
      whole heads / experts (without it, any even split is taken: still exact,
      but a head cut in two costs communication).
  """
  counts = model_counts(cfg) if cfg is not None else None
  flat, treedef = flatten_params(params)
  specs = [leaf_partition_spec(leaf, logical_axes_for(p, len(leaf.shape)), rules, mesh, counts)
           for p, leaf in flat]
  return jax.tree_util.tree_unflatten(treedef, specs)


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def param_shardings(params, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, cfg=None):
  """A tree like ``params`` with a NamedSharding per array (e.g. for jit's in/out_shardings)."""
  specs = param_partition_specs(params, mesh, rules, cfg)
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def put(x, sharding: NamedSharding) -> jax.Array:
  """Places one array with ``sharding``, also when the mesh spans several processes.

  ``jax.device_put`` cannot target devices of other processes; there every
  process builds its own shards from the (identical) host value instead.
  """
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  host = np.asarray(jax.device_get(x) if isinstance(x, jax.Array) else x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _put_tree(tree, shardings):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  shard_leaves = jax.tree_util.tree_leaves(shardings)
  if len(leaves) != len(shard_leaves):
    raise ValueError(f"sharding tree has {len(shard_leaves)} leaves, the value tree {len(leaves)}")
  return jax.tree_util.tree_unflatten(treedef, [put(x, s) for x, s in zip(leaves, shard_leaves)])


def shard_params(params, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, cfg=None):
  """Places a params tree (dense and/or quantised leaves) on ``mesh``.

  Args:
    params: the params pytree (as from init_params / quantize_params).
    mesh: a mesh with axes ("data", "tensor", "expert").
    rules: logical-axis rules (see the module docstring for the defaults).
    cfg: optional ModelConfig, so that heads and experts are never cut (see
      :func:`param_partition_specs`).

  Returns:
    The same tree with every array a jax.Array sharded by the rules (values unchanged).
  """
  return _put_tree(params, param_shardings(params, mesh, rules, cfg))


# ----------------------------------------------------------------------------- KV state

def kv_state_partition_specs(state: PagedKVState, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                             *, data_parallel: bool = False) -> PagedKVState:
  """PartitionSpecs for a paged KV state, as a PagedKVState of specs.

  Args:
    state: the pool (arrays or ShapeDtypeStructs).
    mesh: the mesh.
    rules: ``pages`` and ``kv_heads`` are used.
    data_parallel: split the page axis over ``rules.pages`` (data-parallel attention).

  Returns:
    A PagedKVState whose leaves are PartitionSpecs. MLA: pages (latent, rope key,
    sparse-attention index keys) and scales replicated across tensor (page axis over data when data_parallel); GQA:
    additionally the KV-head axis (axis 2) over ``rules.kv_heads``. ``page_tags``
    is always replicated (every row's check reads any page's tag).
  """
  N = state.num_pages
  page_axes = rules.pages if data_parallel else None
  if page_axes is not None and not _axis_ok(N, axis_size(mesh, page_axes)):
    raise ValueError(f"data-parallel attention: {N} pages do not split over mesh axis "
                     f"{page_axes!r} of size {axis_size(mesh, page_axes)}")
  layers = []
  for layer in state.layers:
    specs = {}
    for name, x in layer.items():
      spec = [page_axes] + [None] * (x.ndim - 1)
      if state.attention == "gqa" and x.ndim >= 3:
        kv_axes = rules.kv_heads
        n = axis_size(mesh, kv_axes)
        if kv_axes is not None and n > 1 and x.shape[2] % n == 0 and kv_axes != page_axes:
          spec[2] = kv_axes
      specs[name] = PartitionSpec(*spec)
    layers.append(specs)
  return PagedKVState(layers=layers, page_tags=PartitionSpec())


def kv_state_shardings(state: PagedKVState, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, *,
                       data_parallel: bool = False) -> PagedKVState:
  """NamedShardings for a paged KV state (see :func:`kv_state_partition_specs`)."""
  specs = kv_state_partition_specs(state, mesh, rules, data_parallel=data_parallel)
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_kv_state(state: PagedKVState, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, *,
                   data_parallel: bool = False) -> PagedKVState:
  """Places a paged KV state on ``mesh`` (see :func:`kv_state_partition_specs`).

  Raises:
    ValueError: with data_parallel, if the page count does not split over the data axis.
  """
  return _put_tree(state, kv_state_shardings(state, mesh, rules, data_parallel=data_parallel))


def replicate(tree, mesh: Mesh):
  """Places every array of ``tree`` fully replicated on ``mesh``."""
  return jax.tree_util.tree_map(lambda x: put(x, NamedSharding(mesh, PartitionSpec())), tree)


def expert_sharding(params) -> NamedSharding | None:
  """How the routed experts' leading axis is placed, for expert-parallel dispatch.

  Reads the sharding of the first routed-expert weight (a 3-D ``w_gate``) of a
  params tree of sharded arrays or ShapeDtypeStructs.

  Args:
    params: the params pytree (dense or quantised leaves).

  Returns:
    ``NamedSharding(mesh, PartitionSpec(axes))`` when the experts' axis is split over
    mesh axes ``axes``; None for a model without routed experts, unplaced or
    single-device params, or experts that are not split.
  """
  for layer in params.get("layers", ()):
    w = layer.get("ffn", {}).get("w_gate")
    if w is None or len(w.shape) != 3:
      continue
    sharding = getattr(jax.tree_util.tree_leaves(w)[0], "sharding", None)
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
      return None
    lead = sharding.spec[0]
    if lead is None or axis_size(sharding.mesh, lead) == 1:
      return None
    return NamedSharding(sharding.mesh, PartitionSpec(lead))
  return None


@dataclasses.dataclass(frozen=True)
class DecodeSharding:
  """How a sharded serving step runs the paged decode-attention kernels: inside a
  ``shard_map`` over the attention heads, each device on its own heads.

  A Pallas kernel is one custom call that XLA cannot split; called on a query whose
  heads are split over devices, XLA all-gathers the query and every device runs the
  kernel for all heads. Under a ``shard_map`` each device hands the kernel its own
  heads (MLA under tensor parallelism: 8 of Kimi K2.6's 64) and its own part of
  the pages (MLA pages are replicated; GQA pages are split over the same axes as
  the query heads), and the output stays split over the heads, as the output
  projection wants it.

  Attributes:
    mesh: the mesh the params and the KV state live on.
    heads: the mesh axes the query heads are split over.
    pages: (entry name, PartitionSpec) of every page and scale array a decode
      step's attention reads, as the KV state is placed.
  """

  mesh: Mesh
  heads: MeshAxes
  pages: tuple

  @property
  def head_shards(self) -> int:
    """Devices the query heads are split over: each holds 1/head_shards of them (the
    model sizes a prefill's attention query blocks by one device's heads)."""
    return axis_size(self.mesh, self.heads)

  def run(self, fn, queries: tuple, pages: tuple, others: tuple):
    """fn(*queries, *page arrays, *others) -> [B, H, ...], per device on its heads.

    Args:
      fn: the op (the paged decode kernel with its static arguments bound).
      queries: [B, H, ...] arrays, split over ``heads`` on axis 1.
      pages: (name, array or None) pairs, in fn's order; None passes through.
      others: arrays every device reads whole (block tables, lengths, selections).

    Returns:
      fn's [B, H, ...] output, split over ``heads`` on axis 1.
    """
    specs = dict(self.pages)
    present = [(n, x) for n, x in pages if x is not None]

    def head_spec(x):
      return PartitionSpec(None, self.heads, *(None,) * (x.ndim - 2))

    def local(qs, ps, os_):
      it = iter(ps)
      full = [None if x is None else next(it) for _, x in pages]
      return fn(*qs, *full, *os_)

    in_specs = (tuple(head_spec(q) for q in queries), tuple(specs[n] for n, _ in present),
                tuple(PartitionSpec() for _ in others))
    run = jax.shard_map(local, mesh=self.mesh, in_specs=in_specs,
                        out_specs=head_spec(queries[0]), check_vma=False)
    return run(tuple(queries), tuple(x for _, x in present), tuple(others))


def _dense_spec_of(leaf) -> PartitionSpec | None:
  """The PartitionSpec of a (possibly quantised) weight in its dense axis order."""
  if isinstance(leaf, Fp8Weight):
    leaf = leaf.values
  elif isinstance(leaf, Int4Weight):
    leaf = leaf.scales  # [..., K // g, N]: the dense order, K split like the codes
  sharding = getattr(leaf, "sharding", None)
  return sharding.spec if isinstance(sharding, NamedSharding) else None


def decode_sharding(params, state) -> DecodeSharding | None:
  """How the serving step should run paged decode attention on the params' and the KV
  state's mesh (see :class:`DecodeSharding`), read from their placement.

  Args:
    params: placed params (arrays or sharded ShapeDtypeStructs).
    state: the placed PagedKVState (the same), or None.

  Returns:
    A DecodeSharding when the query heads are split over mesh axes (from the
    columns of the first layer's ``wq_b`` / ``wq``) and the pages allow it: the
    page axis whole on every device (not data-parallel attention) and, for GQA,
    the KV-head axis split over the same axes as the query heads (so each
    device's query heads find their KV heads locally). None otherwise (single
    device, unplaced arrays, or a placement the kernels cannot take per device):
    the op then runs as one call on whole arrays.
  """
  if state is None:
    return None
  layers = params.get("layers", ())
  if not layers:
    return None
  attn = layers[0].get("attn", {})
  w = attn.get("wq_b", attn.get("wq"))
  spec = None if w is None else _dense_spec_of(w)
  if spec is None or len(spec) < 2 or spec[-1] is None:
    return None
  heads = spec[-1]
  mesh = jax.tree_util.tree_leaves(w)[0].sharding.mesh
  if axis_size(mesh, heads) == 1:
    return None
  layer0 = state.layers[0]
  pages = []
  for name in state.names:
    for key in (name, name + "_scale"):
      if key not in layer0:
        continue
      s = getattr(layer0[key], "sharding", None)
      if not isinstance(s, NamedSharding) or s.mesh != mesh:
        return None
      ps = tuple(s.spec) + (None,) * (layer0[key].ndim - len(s.spec))
      if ps[0] is not None:  # pages split (data-parallel attention): not per device
        return None
      want_kv = heads if state.attention == "gqa" else None
      if len(ps) > 2 and ps[2] != want_kv or any(a is not None for i, a in enumerate(ps)
                                                  if i not in (0, 2)):
        return None
      pages.append((key, PartitionSpec(*ps)))
  return DecodeSharding(mesh=mesh, heads=heads, pages=tuple(pages))
