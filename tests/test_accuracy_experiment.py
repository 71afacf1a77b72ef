"""The accuracy experiment: its smoke run (through the command line, with the other
experiments' in test_experiments.SmokeRunsTest) trains TINY_MLA, evaluates three recipes
through the engine and the disaggregated recipe through the two-pool engine, and writes
well-formed JSON, markdown and PNGs; the trained model is cached by fingerprint
(mlkit.evals.setups), so this process loads what the run trained."""

import dataclasses
import os

import jax
import numpy as np
from absl.testing import absltest

from mlkit.evals import setups
from mlkit.evals.precision import DISAGG


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class AccuracySmokeChecks:
  """Checks of the accuracy smoke run. Not a TestCase: test_experiments.SmokeRunsTest mixes
  it in, which runs every experiment's smoke mode in one process (the accuracy run trains
  the smoke model there, into the run's ``MLKIT_CACHE``, which that class sets in this
  process too, and the speculative run loads it)."""

  @property
  def record(self):
    return self.records["accuracy"]

  def test_accuracy_files_well_formed(self):
    rec = self.record
    self.assertEqual(rec["experiment"], "accuracy")
    self.assertEqual(rec["mode"], "smoke")
    for key in ("backend", "jax", "device_kind", "time_utc"):
      self.assertIn(key, rec["machine"])
    self.assertIn(rec["kernel_backend"], ("xla", "pallas"))
    with open(os.path.join(self.out, "accuracy.md")) as f:
      md = f.read()
    self.assertTrue(md.startswith("# accuracy"), md[:80])
    self.assertIn("|---|", md)
    for png in ("accuracy.png", "accuracy_loss.png"):
      self.assertIn(f"]({png})", md)
      with open(os.path.join(self.out, png), "rb") as f:
        self.assertEqual(f.read(8), PNG_MAGIC)

  def test_accuracy_scores_every_recipe_on_every_task(self):
    names = set(setups.EVAL_SETUPS["smoke"].recipes) | {DISAGG}
    self.assertEqual(set(self.record["recipes"]), names)
    for name, r in self.record["recipes"].items():
      self.assertEqual(set(r["tasks"]), {"arithmetic", "retrieval", "tool_call"}, name)
      for t, s in r["tasks"].items():
        self.assertEqual(s["n"], setups.EVAL_SETUPS["smoke"].n_per_task)
        self.assertLessEqual(s["ci95"][0], s["accuracy"])
        self.assertLessEqual(s["accuracy"], s["ci95"][1])
    lo, hi = setups.EVAL_SETUPS["smoke"].tasks.retrieval_pairs
    for name, r in self.record["recipes"].items():
      by = r["retrieval_by_pairs"]
      self.assertTrue(by and all(lo <= int(n) <= hi for n in by), name)
    ref = self.record["recipes"]["w-bf16/kv-bf16"]
    self.assertEqual(ref["kl_mean"], 0.0)
    self.assertGreater(self.record["recipes"]["w-bf16/kv-fp8"]["kl_mean"], 0.0)
    self.assertIsNone(self.record["recipes"][DISAGG]["kl_mean"])
    # Every request of the disaggregated recipe moved its KV between the pools.
    n = 3 * setups.EVAL_SETUPS["smoke"].n_per_task
    transfers = self.record["recipes"][DISAGG]["transfers"]
    self.assertEqual(transfers["transfers"], n)
    self.assertEqual(transfers["transfer_failures"], 0)

  def test_accuracy_claims_cover_kv_weights_and_disagg(self):
    claims = {c["claim"] for c in self.record["claims"]}
    self.assertIn("fp8 KV within ~1 point", claims)
    self.assertIn("disaggregated within ~1 point of bf16", claims)
    for c in self.record["claims"]:
      self.assertIn(c["holds"], ("yes", "no", "not resolved"))
      lo, hi = c["ci95_points"]
      self.assertLessEqual(lo, c["delta_points"] + 1e-9)
      self.assertLessEqual(c["delta_points"], hi + 1e-9)

  def test_accuracy_model_is_cached_and_reloaded(self):
    self.assertFalse(self.record["train"]["cached"])
    setup = setups.TRAIN_SETUPS["smoke"]
    params, info = setups.train_or_load(setup)
    self.assertTrue(info["cached"])
    self.assertEqual(info["fingerprint"], setup.fingerprint())
    self.assertEqual(len(info["history"]), len(self.record["train_history"]))
    leaves = jax.tree_util.tree_leaves(params)
    self.assertTrue(all(np.all(np.isfinite(np.asarray(x))) for x in leaves))

  def test_accuracy_stage_continues_its_parent(self):
    setup = setups.TRAIN_SETUPS["smoke"]
    parent = self.record["train"]["parent"]
    self.assertEqual(parent["steps"], setup.parent.train.steps)
    self.assertEqual(parent["fingerprint"], setup.parent.fingerprint())
    # The parent's final model is where this stage started: the stage's first logged loss
    # (taken before its first update) is the parent model's loss on the stage's first batch.
    from mlkit.train import compute_config, loss_fn
    parent_params, _ = setups.train_or_load(setup.parent)
    tokens, weights, segments = setups.batch_fn(setup)(0)  # the smoke stages pack segments
    _, m = jax.jit(loss_fn, static_argnames=("cfg", "tcfg"))(
        parent_params, tokens, weights, segments, cfg=compute_config(setup.model, setup.train),
        tcfg=setup.train)
    # "loss" is the main next-token loss (the total adds the MTP loss the smoke stages train).
    self.assertAlmostEqual(self.record["train_history"][0]["loss"], float(m["loss"]), delta=0.02)
    self.assertIn("mtp", parent_params)
    fresh = setups.TrainSetup(model=setup.model, train=setup.train, tasks=setup.tasks)
    self.assertNotEqual(fresh.fingerprint(), setup.fingerprint())
    mismatched = dataclasses.replace(
        setup, parent=dataclasses.replace(setup.parent,
                                          model=dataclasses.replace(setup.model, n_layers=3)))
    with self.assertRaisesRegex(ValueError, "same model"):
      setups.train_or_load(mismatched)


class TrainSetupTest(absltest.TestCase):

  def test_fingerprint_tracks_every_field(self):
    setup = setups.TRAIN_SETUPS["smoke"]
    other = [dataclasses.replace(setup, train=dataclasses.replace(setup.train, steps=7)),
             dataclasses.replace(setup, prompt_weight=0.5),
             dataclasses.replace(setup, model=dataclasses.replace(setup.model, n_layers=3)),
             dataclasses.replace(setup, segments=not setup.segments)]
    fps = {setup.fingerprint()} | {o.fingerprint() for o in other}
    self.assertLen(fps, 5)
    self.assertEqual(setup.fingerprint(), dataclasses.replace(setup).fingerprint())

  def test_short_rows_rejected(self):
    setup = setups.TRAIN_SETUPS["smoke"]
    bad = dataclasses.replace(setup, train=dataclasses.replace(setup.train, seq_len=16))
    with self.assertRaisesRegex(ValueError, "seq_len 16"):
      setups.batch_fn(bad)


class DisaggBackendTest(absltest.TestCase):

  def test_needs_two_devices(self):
    from configs import TINY_MLA
    from mlkit.evals.backends import DisaggBackend
    with self.assertRaisesRegex(ValueError, "two devices"):  # checked before the weights are read
      DisaggBackend(None, TINY_MLA, devices=jax.devices()[:1])


if __name__ == "__main__":
  absltest.main()
