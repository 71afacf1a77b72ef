"""Configuration of a paged KV pool: page count, page size and storage dtype."""

from __future__ import annotations

import dataclasses

from mlkit.config import ModelConfig

# Storage dtypes a pool may use. float32 exists only for exactness tests.
KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float32")
# Page sizes used when KVCacheConfig.page_size is None.
DEFAULT_PAGE_SIZE = {"mla": 64, "gqa": 16}


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
  """A paged KV pool's shape and storage format.

  Raises:
    ValueError: on a non-positive page count / page size or an unknown dtype.
  """

  # Physical pages in the pool (shared by all layers: page i of every layer belongs together).
  num_pages: int
  # Tokens per page; None picks DEFAULT_PAGE_SIZE for the model's attention kind.
  page_size: int | None = None
  # Storage dtype of the pages: "bfloat16", "float8_e4m3fn" (with per-token f32 scales) or "float32".
  dtype: str = "bfloat16"

  def __post_init__(self):
    if not isinstance(self.num_pages, int) or isinstance(self.num_pages, bool) or self.num_pages <= 0:
      raise ValueError(f"KVCacheConfig.num_pages must be a positive int, got {self.num_pages!r}")
    if self.page_size is not None and (not isinstance(self.page_size, int)
                                       or isinstance(self.page_size, bool) or self.page_size <= 0):
      raise ValueError(f"KVCacheConfig.page_size must be a positive int or None, got {self.page_size!r}")
    if self.dtype not in KV_DTYPES:
      raise ValueError(f"KVCacheConfig.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")

  @property
  def is_fp8(self) -> bool:
    """Whether pages are float8 with per-token scales beside them."""
    return self.dtype == "float8_e4m3fn"

  def resolve(self, cfg: ModelConfig) -> "KVCacheConfig":
    """This config with page_size filled in from the model's attention kind."""
    if self.page_size is not None:
      return self
    return dataclasses.replace(self, page_size=DEFAULT_PAGE_SIZE[cfg.attention])

  def page_size_for(self, cfg: ModelConfig) -> int:
    """The page size this pool uses for ``cfg`` (the default when page_size is None)."""
    return self.resolve(cfg).page_size
