"""Model presets.

``KIMI_K2_6`` and ``GLM_5_2`` carry the full published shapes (docs/report.md) and are
used for capacity, weight-byte and roofline math and for deviceless H200 compiles
(abstract weights): they are never allocated. The small presets are for tests, CPU
experiments and one-H200 runs; ``TINY_GLM`` and ``H200_GLM`` have GLM 5's
architecture (sparse attention).
"""

import dataclasses

from mlkit.config import ModelConfig, RopeScaling

# Kimi K2.6: DeepSeek-V3 layout, 64 heads, 384 experts, YaRN x32 from a 4K base. Its public
# config declares no multi-token-prediction layer (num_nextn_predict_layers 0).
KIMI_K2_6 = ModelConfig(
    name="kimi-k2.6",
    vocab_size=163840,
    d_model=7168,
    n_layers=61,
    n_heads=64,
    attention="mla",
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    dense_ffn_dim=18432,
    moe_ffn_dim=2048,
    n_routed_experts=384,
    n_shared_experts=1,
    top_k=8,
    first_k_dense=1,
    router="sigmoid",
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    rope_theta=50000.0,
    rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=4096,
                             beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    max_seq_len=262144,
)

# GLM 5.2: Kimi's layout with its own widths, 78 layers (3 dense), 256 experts, plus a
# sparse-attention indexer whose per-token key cache (128 values per layer) counts toward KV
# capacity. The dense FFN width (12288) is not published (docs/report.md); it is the value
# that, with the published shapes, reproduces the published ~744B total.
GLM_5_2 = dataclasses.replace(
    KIMI_K2_6, name="glm-5.2", vocab_size=154880, d_model=6144, n_layers=78, q_lora_rank=2048,
    qk_nope_head_dim=192, v_head_dim=256, dense_ffn_dim=12288, n_routed_experts=256,
    first_k_dense=3, routed_scaling_factor=2.5, index_n_heads=32, index_head_dim=128,
    index_topk=2048,
    # transformers' default schedule for glm_moe_dsa (index_topk_freq 1): every layer runs
    # its own indexer.
    indexer_types=("full",) * 78, rope_theta=1000000.0, rope_scaling=None, max_seq_len=202752,
    rms_norm_eps=1e-5,
    latent_norm_eps=1e-6,  # GLM's query / KV latent norms (docs/sparse_attention.md)
    # The checkpoint ships one multi-token-prediction layer (counted in weight bytes).
    n_mtp_layers=1)

# The small presets' shared base: Kimi's layout (MLA, sigmoid router over routed experts
# plus one shared expert, the first layer dense) with a plain 10K rope and scaling 2.5.
_SMALL_BASE = dataclasses.replace(KIMI_K2_6, name="small-base", routed_scaling_factor=2.5,
                                  rope_theta=10000.0, rope_scaling=None)

# Tiny MLA model for unit tests: f32, 3 layers, grouped routing, YaRN over a 64-token base.
TINY_MLA = dataclasses.replace(
    _SMALL_BASE, name="tiny-mla", vocab_size=256, d_model=64, n_layers=3, n_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    dense_ffn_dim=128, moe_ffn_dim=32, n_routed_experts=8, top_k=2, n_group=2, topk_group=1,
    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    max_seq_len=256, dtype="float32", param_dtype="float32",
    # One multi-token-prediction layer as DeepSeek-V3 ships (run by mlkit.model.mtp and trained
    # when TrainConfig.mtp_loss_weight > 0; nothing else runs it).
    n_mtp_layers=1)

# Tiny GQA model for unit tests: 2 layers, first dense, softmax router, tied embeddings.
TINY_GQA = ModelConfig(
    name="tiny-gqa",
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    attention="gqa",
    n_kv_heads=2,
    head_dim=16,
    dense_ffn_dim=128,
    moe_ffn_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    top_k=2,
    first_k_dense=1,
    router="softmax",
    routed_scaling_factor=1.0,
    rope_interleave=False,
    tie_embeddings=True,
    rope_theta=10000.0,
    max_seq_len=256,
    dtype="float32",
    param_dtype="float32",
)

# ~30M-parameter MLA model for CPU experiments and training.
SMALL_MLA = dataclasses.replace(
    _SMALL_BASE, name="small-mla", vocab_size=512, d_model=256, n_layers=6, n_heads=8,
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    dense_ffn_dim=1024, moe_ffn_dim=256, n_routed_experts=32, top_k=4, max_seq_len=2048)

# ~7M-parameter MLA MoE (one dense layer, then 16 routed experts top-2 plus a shared expert)
# for the accuracy ablation: small enough to learn the generated tasks in minutes on 2 CPU
# cores. The vocabulary covers the character tokenizer (98 ids).
MINI_MLA = dataclasses.replace(
    SMALL_MLA, name="mini-mla", vocab_size=128, d_model=192, n_layers=4, n_heads=6,
    q_lora_rank=96, kv_lora_rank=64, dense_ffn_dim=768, moe_ffn_dim=192, n_routed_experts=16,
    top_k=2, max_seq_len=512,
    # One multi-token-prediction layer, trained with the accuracy model (mlkit.evals.setups).
    n_mtp_layers=1)

# Kimi-shaped (MLA 512+64, 64 heads) but smaller, so the report's capacity and
# throughput curves run on one H200 in minutes.
H200_MLA = dataclasses.replace(
    KIMI_K2_6, name="h200-mla", vocab_size=32768, d_model=2048, n_layers=12, q_lora_rank=768,
    dense_ffn_dim=8192, moe_ffn_dim=1024, n_routed_experts=64, rope_scaling=None,
    max_seq_len=32768)

# GLM 5.x architecture at test size: sparse attention (DeepSeek Sparse Attention) with a
# full / shared indexer schedule, interleaved indexer rope, one dense layer then MoE,
# index_topk below a short prompt so the selection matters (docs/sparse_attention.md).
TINY_GLM = dataclasses.replace(
    TINY_MLA, name="tiny-glm", n_layers=4, n_group=1, topk_group=1, rope_scaling=None,
    norm_topk_prob=True, index_n_heads=4, index_head_dim=16, index_topk=8,
    indexer_types=("full", "shared", "full", "shared"), rms_norm_eps=1e-5, latent_norm_eps=1e-6,
    # No MTP layer (TINY_MLA has one): a sparse-attention MTP layer needs its own indexer.
    n_mtp_layers=0)

# H200_MLA's widths with GLM 5's indexer on every layer (32 heads of 128, top 2048):
# the GLM cache entry (512 latent + 64 rope + 128 index key per layer) for pools
# allocated on one device (the capacity experiment).
H200_GLM = dataclasses.replace(H200_MLA, name="h200-glm", index_n_heads=32, index_head_dim=128,
                               index_topk=2048, indexer_types=("full",) * H200_MLA.n_layers)

MODEL_PRESETS = {c.name: c for c in (KIMI_K2_6, GLM_5_2, TINY_MLA, TINY_GQA, TINY_GLM, MINI_MLA,
                                      SMALL_MLA, H200_MLA, H200_GLM)}
