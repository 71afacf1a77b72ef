"""Writes the Hugging Face parity fixtures under tests/fixtures/ (torch + transformers only).

Run in a throwaway virtual environment, never the project's (the tests must not
import torch):

    python3.12 -m venv /tmp/peervenv
    /tmp/peervenv/bin/pip install torch "transformers>=5"
    /tmp/peervenv/bin/python scripts/make_hf_fixtures.py

For each fixture it builds a tiny random model with transformers, saves it with
``save_pretrained`` (so config.json is in the layout current transformers
writes: ``rope_parameters``, ``dtype``, ...) and records, in ``reference.npz``:

- ``tokens`` [B, T] int32 and ``logits`` [B, T, V] float32: a cache-free forward
  over the whole sequence;
- ``prompt_len``, ``decode_logits`` [B, T - prompt_len, V]: the logits of a
  prefill of the first ``prompt_len`` tokens then one token at a time through
  transformers' KV cache (teacher forced with ``tokens``);
- ``greedy`` [B, N] int32 and ``greedy_logits`` [B, N, V]: ``generate`` with
  greedy decoding from the prompt, and the logits each token was chosen from.

The weights are drawn with a fixed seed at a scale where the logits are far from
uniform (the default 0.02 init makes every layer nearly an identity), and the
router's correction bias is random, so routing differs from a plain top-k.
``tests/test_hf_parity.py`` holds the project's model to these in float32.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures")


def randomise(model: torch.nn.Module, seed: int) -> None:
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
      else:  # fan-in scaled, so activations keep their size through the layers
        fan_in = p.shape[-1] if p.ndim > 1 else 1
        p.copy_(torch.randn(p.shape, generator=g) * (0.7 / fan_in ** 0.5 if p.ndim > 1 else 0.1))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn(b.shape, generator=g))


def reference(model, tokens: np.ndarray, prompt_len: int, new_tokens: int) -> dict:
  ids = torch.tensor(tokens, dtype=torch.long)
  with torch.inference_mode():
    full = model(ids, use_cache=False).logits.float().numpy()
    out = model(ids[:, :prompt_len], use_cache=True)
    cache, steps = out.past_key_values, []
    for t in range(prompt_len, tokens.shape[1]):
      out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
      cache = out.past_key_values
      steps.append(out.logits[:, -1].float().numpy())
    gen = model.generate(ids[:, :prompt_len], attention_mask=torch.ones_like(ids[:, :prompt_len]),
                         do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
  return {"tokens": tokens.astype(np.int32), "logits": full, "prompt_len": np.int32(prompt_len),
          "decode_logits": np.stack(steps, axis=1),
          "greedy": gen.sequences[:, prompt_len:].numpy().astype(np.int32),
          "greedy_logits": torch.stack(gen.logits, dim=1).float().numpy()}


def deepseek_v3(out_dir: str) -> None:
  """A 3-layer DeepSeek-V3 (one dense layer, two MoE with grouped routing), YaRN rope."""
  cfg = transformers.DeepseekV3Config(
      vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
      n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
      qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
      num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
      rms_norm_eps=1e-6, tie_word_embeddings=False,
      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                       "mscale": 1.0, "mscale_all_dim": 1.0})
  cfg._attn_implementation = "eager"
  torch.manual_seed(0)
  model = transformers.DeepseekV3ForCausalLM(cfg).eval()
  randomise(model, seed=1)
  model.save_pretrained(out_dir)
  tokens = np.random.default_rng(2).integers(2, cfg.vocab_size, (2, 24))
  np.savez(os.path.join(out_dir, "reference.npz"), **reference(model, tokens, 16, 8))


def _topk_margins(model, tokens: np.ndarray, rope) -> float:
  """The smallest relative gap between the k-th and (k+1)-th visible index score.

  Recomputes each full indexer's scores from its own forward inputs (transformers
  returns only the indices), so a fixture can be refused when a selection would
  hinge on rounding. ``rope`` is the modelling module's rope function for the
  indexer (GLM: interleaved pairs; DeepSeek-V3.2: halves).
  """
  import torch.nn.functional as F
  gaps = []

  def hook(mod, args, kwargs):
    hidden, q_resid, (cos, sin), mask = args[:4]  # as GlmMoeDsaAttention calls it
    B, S, _ = hidden.shape
    R = mod.qk_rope_head_dim
    q = mod.wq_b(q_resid).view(B, S, mod.n_heads, mod.head_dim)
    k = mod.k_norm(mod.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = rope(q[..., :R], k[..., :R], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., R:]], -1)
    k = torch.cat([k_rot, k[..., R:]], -1).squeeze(2)
    sc = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale)
    w = mod.weights_proj(hidden.float()) * mod.n_heads ** -0.5
    idx = torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)  # [B, S, S]
    vis = mask if mask.dtype == torch.bool else mask == 0
    for b in range(B):
      for t in range(S):
        v = idx[b, t][vis[b, t]].sort(descending=True).values
        if v.numel() > mod.index_topk:
          kth, nxt = v[mod.index_topk - 1], v[mod.index_topk]
          gaps.append(float((kth - nxt) / (v.abs().max() + 1e-12)))

  hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
           if type(m).__name__.endswith("Indexer")]
  with torch.inference_mode():
    model(torch.tensor(tokens, dtype=torch.long), use_cache=False)
  for h in hooks:
    h.remove()
  return min(gaps)


def _sparse_fixture(out_dir: str, name: str, model_cls, cfg, rope) -> None:
  """Saves the first seed's model whose top-k choices all have clear margins, with its reference.

  Greedy generation is checked too, so the generated continuation needs them as
  well (a selection that hinges on the last bits of a score would make a 1e-4
  comparison meaningless).
  """
  cfg._attn_implementation = "eager"
  tokens = np.random.default_rng(2).integers(2, cfg.vocab_size, (2, 24))
  for seed in range(1, 200):
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    randomise(model, seed=seed)
    if _topk_margins(model, tokens, rope) <= 2e-4:
      continue
    ref = reference(model, tokens, 16, 8)
    margin = min(_topk_margins(model, tokens, rope),
                 _topk_margins(model, np.concatenate([tokens[:, :16], ref["greedy"]], 1), rope))
    if margin > 2e-4:  # float32 rounding moves a score by ~1e-6 of its scale
      break
  else:
    raise RuntimeError("no seed gave clear top-k margins")
  print(f"{name}: seed {seed}, smallest relative top-k margin {margin:.2e}")
  model.save_pretrained(out_dir)
  np.savez(os.path.join(out_dir, "reference.npz"), **ref, topk_margin=np.float32(margin))


def deepseek_v32(out_dir: str) -> None:
  """A 3-layer DeepSeek-V3.2 (the indexer on every layer, its rope in halves), YaRN rope,
  one dense and two MoE layers, index_topk 6 below the 24-token sequence."""
  from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m
  cfg = transformers.DeepseekV32Config(
      vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
      n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
      qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
      num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
      rms_norm_eps=1e-6, tie_word_embeddings=False, index_topk=6, index_head_dim=16,
      index_n_heads=8,
      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                       "mscale": 1.0, "mscale_all_dim": 1.0})
  _sparse_fixture(out_dir, "deepseek_v32", transformers.DeepseekV32ForCausalLM, cfg,
                  m.apply_rotary_pos_emb)


def glm_moe_dsa(out_dir: str) -> None:
  """A 4-layer GLM 5 (DeepSeek Sparse Attention): full/shared/full/shared indexer layers,
  one dense and three MoE layers, index_topk 6 below the 24-token sequence."""
  from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m
  cfg = transformers.GlmMoeDsaConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
      n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
      qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
      num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
      rms_norm_eps=1e-5, tie_word_embeddings=False, index_topk=6, index_head_dim=16,
      index_n_heads=8, indexer_types=["full", "shared", "full", "shared"],
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  _sparse_fixture(out_dir, "glm_moe_dsa", transformers.GlmMoeDsaForCausalLM, cfg,
                  m.apply_rotary_pos_emb_interleave)


FIXTURE_BUILDERS = {"deepseek_v3_tf5": deepseek_v3, "deepseek_v32": deepseek_v32,
                    "glm_moe_dsa": glm_moe_dsa}


def run(builders: dict, script: str, argv=None, **versions: str) -> int:
  """Writes the fixtures named in ``argv`` (default all of ``builders``), each with a
  MADE_BY.json naming ``script`` and the package versions that made it."""
  ap = argparse.ArgumentParser(description=f"Writes fixtures under tests/fixtures/ ({script}).")
  ap.add_argument("names", nargs="*", help=f"fixtures to write (default all: {sorted(builders)})")
  args = ap.parse_args(argv)
  torch.set_num_threads(1)
  for name in args.names or sorted(builders):
    out = os.path.join(FIXTURES, name)
    os.makedirs(out, exist_ok=True)
    builders[name](out)
    with open(os.path.join(out, "MADE_BY.json"), "w") as f:
      json.dump({"script": script, "transformers": transformers.__version__,
                 "torch": torch.__version__, **versions}, f, indent=1)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out} ({size} bytes)")
  return 0


def main(argv=None) -> int:
  return run(FIXTURE_BUILDERS, "scripts/make_hf_fixtures.py", argv)


if __name__ == "__main__":
  raise SystemExit(main())
