"""``python -m mlkit.convert``: HF checkpoint -> quantised orbax checkpoint, resumable.

The checkpoints are written here from fresh random params (nothing is downloaded).
"""

import contextlib
import dataclasses
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
from absl.testing import absltest

from configs import TINY_MLA
from mlkit import convert as cli
from mlkit.checkpoint import convert as conv
from mlkit.checkpoint import load_checkpoint, load_hf_checkpoint, save_hf_checkpoint
from mlkit.checkpoint.hf import INDEX_FILE
from mlkit.parallel import MeshConfig, make_mesh
from mlkit.quant import BF16, FP8_ALL, INT4_EXPERTS, INT4_EXPERTS_FP8_REST
from numpy_params import init_params_np

_BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")


class _Interrupt(Exception):
  """Stands for a kill in the middle of a conversion."""


def _run(argv) -> tuple[int, str]:
  """mlkit.convert's main(argv) in this process: (exit status, stderr)."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      rc = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help, bad command lines
      rc = e.code
  return rc, err.getvalue()


class ConvertTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = tempfile.mkdtemp(prefix="convert_")
    cls.cfg = dataclasses.replace(TINY_MLA, **_BF16)
    cls.src = os.path.join(cls.root, "src")
    save_hf_checkpoint(cls.src, init_params_np(cls.cfg, seed=int.from_bytes(os.urandom(2), "little")),
                       cls.cfg, shards=2)
    cls.names = conv.open_hf_checkpoint(cls.src).names

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.root, ignore_errors=True)
    super().tearDownClass()

  def dst(self) -> str:
    return tempfile.mkdtemp(prefix="dst_", dir=self.root) + "/ckpt"

  def assertIdentical(self, got, want, shardings=False):
    self.assertEqual(jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      self.assertEqual(a.dtype, b.dtype)
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
      if shardings:
        self.assertEqual(a.sharding, b.sharding)

  def test_round_trip_is_bit_identical_to_quantising_on_load(self):
    for recipe in (INT4_EXPERTS_FP8_REST, FP8_ALL, BF16):
      with self.subTest(recipe=recipe.name):
        dst = self.dst()
        rc, err = _run([self.src, dst, "--recipe", recipe.name])
        self.assertEqual(rc, 0, err)
        self.assertRegex(err, r"\[49/49\] lm_head: .* read, .* MB/s")
        self.assertFalse(os.path.exists(conv.staging_dir(dst)))  # removed once complete
        got, cfg = load_checkpoint(dst)  # the recorded recipe gives the structure
        self.assertEqual(cfg, self.cfg)
        self.assertIdentical(got, load_hf_checkpoint(self.src, recipe=recipe)[0])

  def test_tokenizer_files_travel_with_the_weights(self):
    import tokenizer_fixtures
    from mlkit.text import load_tokenizer
    src = tempfile.mkdtemp(prefix="src_tok_", dir=self.root)
    for name in os.listdir(self.src):
      os.symlink(os.path.join(self.src, name), os.path.join(src, name))
    tokenizer_fixtures.write_byte_level_checkpoint(src)
    dst = self.dst()
    rc, err = _run([src, dst, "--recipe", BF16.name])
    self.assertEqual(rc, 0, err)
    self.assertIn("copied the tokenizer files tokenizer.json, tokenizer_config.json, "
                  "generation_config.json", err)
    got, want = load_tokenizer(dst), load_tokenizer(src)
    self.assertEqual((got.vocab_size, got.eos_token_ids, got.chat_template),
                     (want.vocab_size, want.eos_token_ids, want.chat_template))
    self.assertEqual(load_checkpoint(dst)[1], self.cfg)

  def test_on_a_mesh_too(self):
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[:4])
    dst = self.dst()
    result = conv.convert_hf_checkpoint(self.src, dst, recipe=INT4_EXPERTS.name, mesh=mesh)
    self.assertGreater(result.per_device_bytes, 0)
    got, _ = load_checkpoint(dst, mesh=mesh)
    want, _ = load_hf_checkpoint(self.src, recipe=INT4_EXPERTS, mesh=mesh)
    self.assertIdentical(got, want, shardings=True)

  def test_a_glm5_checkpoint_with_its_sparse_attention_indexer(self):
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "glm_moe_dsa")
    dst = self.dst()
    rc, err = _run([src, dst, "--recipe", INT4_EXPERTS.name])
    self.assertEqual(rc, 0, err)
    got, cfg = load_checkpoint(dst)
    want, want_cfg = load_hf_checkpoint(src, recipe=INT4_EXPERTS)
    self.assertEqual(cfg, want_cfg)
    self.assertTrue(cfg.sparse_attention)
    self.assertIn("indexer_weights_proj", got["layers"][0]["attn"])
    self.assertIdentical(got, want)

  def test_resume_after_an_interruption_converts_only_the_rest(self):
    dst, k = self.dst(), 7

    def stop(i, name):
      if i == k - 1:
        raise _Interrupt(name)
    with self.assertRaises(_Interrupt):
      conv.convert_hf_checkpoint(self.src, dst, recipe=INT4_EXPERTS.name, after_leaf=stop)
    # Nothing that looks like a checkpoint: dst does not exist, the staging is no checkpoint.
    self.assertFalse(os.path.exists(dst))
    with self.assertRaises(FileNotFoundError):
      load_checkpoint(dst)
    with self.assertRaisesRegex(ValueError, "not an mlkit checkpoint"):
      load_checkpoint(conv.staging_dir(dst))
    # A kill mid-write leaves a .tmp file; one staged leaf is damaged; one lost its record.
    leaves = os.path.join(conv.staging_dir(dst), "leaves")
    with open(os.path.join(leaves, self.names[k] + ".0.bin.tmp"), "wb") as f:
      f.write(b"half")
    with open(os.path.join(leaves, self.names[2] + ".0.bin"), "r+b") as f:
      f.seek(3)
      byte = f.read(1)
      f.seek(3)
      f.write(bytes([byte[0] ^ 0x40]))
    os.remove(os.path.join(leaves, self.names[4] + ".json"))

    result = conv.convert_hf_checkpoint(self.src, dst, recipe=INT4_EXPERTS.name)
    intact = [n for i, n in enumerate(self.names[:k]) if i not in (2, 4)]
    self.assertEqual(list(result.reused), intact)
    self.assertEqual(list(result.converted),
                     [self.names[2], self.names[4]] + self.names[k:])
    self.assertIdentical(load_checkpoint(dst)[0], load_hf_checkpoint(self.src, recipe=INT4_EXPERTS)[0])

  def test_staging_for_another_recipe_is_not_reused(self):
    dst = self.dst()

    def stop(i, name):
      raise _Interrupt(name)
    with self.assertRaises(_Interrupt):
      conv.convert_hf_checkpoint(self.src, dst, recipe=FP8_ALL.name, after_leaf=stop)
    result = conv.convert_hf_checkpoint(self.src, dst, recipe=INT4_EXPERTS.name)
    self.assertEqual(result.reused, ())
    self.assertEqual(list(result.converted), self.names)

  def test_full_disk_fails_clearly_and_the_rerun_resumes(self):
    dst, calls = self.dst(), []
    real = conv._write_file

    def full_after_some(path, data):
      calls.append(path)
      if len(calls) > 9:
        raise OSError(errno.ENOSPC, "No space left on device", path)
      real(path, data)
    with absltest.mock.patch.object(conv, "_write_file", full_after_some):
      rc, err = _run([self.src, dst, "--recipe", INT4_EXPERTS.name])
    self.assertEqual(rc, 1)
    self.assertIn("no space left on device", err)
    self.assertIn("run the same conversion again to resume", err)
    self.assertFalse(os.path.exists(dst))
    rc, err = _run([self.src, dst, "--recipe", INT4_EXPERTS.name])
    self.assertEqual(rc, 0, err)
    self.assertRegex(err, r"49 tensors, [1-9]\d* already converted")

  def test_existing_complete_destination_needs_overwrite(self):
    dst = self.dst()
    self.assertEqual(_run([self.src, dst, "--recipe", "bf16", "-q"])[0], 0)
    rc, err = _run([self.src, dst, "--recipe", INT4_EXPERTS.name])
    self.assertEqual(rc, 1)
    self.assertRegex(err, "already exists and holds a complete checkpoint.*--overwrite")
    self.assertFalse(os.path.exists(conv.staging_dir(dst)))  # refused before anything is written
    rc, err = _run([self.src, dst, "--recipe", INT4_EXPERTS.name, "--overwrite"])
    self.assertEqual(rc, 0, err)
    self.assertIdentical(load_checkpoint(dst)[0], load_hf_checkpoint(self.src, recipe=INT4_EXPERTS)[0])

  def test_bad_source_fails_before_anything_is_written(self):
    def broken(edit) -> str:
      path = tempfile.mkdtemp(prefix="bad_", dir=self.root)
      shutil.rmtree(path)
      shutil.copytree(self.src, path)
      edit(path)
      return path

    def drop_shard(path):
      with open(os.path.join(path, INDEX_FILE)) as f:
        os.remove(os.path.join(path, sorted(set(json.load(f)["weight_map"].values()))[-1]))

    def edit_config(**fields):
      def edit(path):
        with open(os.path.join(path, "config.json")) as f:
          hf = json.load(f)
        hf.update(fields)
        with open(os.path.join(path, "config.json"), "w") as f:
          json.dump(hf, f)
      return edit
    cases = [
        (drop_shard, r"shard model-00002-of-00002\.safetensors listed in .* is missing"),
        # (no MTP layer: one would take index 2 and be reported missing instead)
        (edit_config(num_hidden_layers=2, num_nextn_predict_layers=0),
         r"tensor model\.layers\.2\..* belongs to layer 2"),
        (edit_config(moe_intermediate_size=64), r"tensor model\.layers\..*experts.* has shape"),
    ]
    for edit, pattern in cases:
      with self.subTest(pattern=pattern):
        dst = self.dst()
        rc, err = _run([broken(edit), dst, "--recipe", INT4_EXPERTS.name])
        self.assertEqual(rc, 1)
        self.assertRegex(err, "mlkit.convert: error: .*" + pattern)
        self.assertFalse(os.path.exists(dst))
        self.assertFalse(os.path.exists(conv.staging_dir(dst)))

  def test_bad_command_lines(self):
    dst = self.dst()
    rc, err = _run([self.src, dst, "--recipe", "int5-everything"])
    self.assertEqual(rc, 2)
    self.assertRegex(err, r"unknown recipe 'int5-everything'; choose one of: .*int4-experts-g32")
    rc, err = _run([self.src, dst, "--recipe", "int4-experts-g32-gptq"])
    self.assertEqual(rc, 2)
    self.assertRegex(err, "GPTQ, which needs calibration activations")
    rc, err = _run([self.src, dst, "--recipe", "fp8-all", "--mesh", "tensr=2"])
    self.assertEqual(rc, 2)
    self.assertIn("expected AXIS=N", err)
    self.assertFalse(os.path.exists(dst))

  def test_help(self):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as ctx:
      cli.main(["--help"])
    self.assertEqual(ctx.exception.code, 0)
    text = out.getvalue()
    for want in ("--recipe", "--dtype", "--mesh", "--overwrite", "Resumable", "int4-experts-g32",
                 "fp8-all", "GPTQ (int4-experts-g32-gptq) is not offered", "calibration"):
      self.assertIn(want, text)

  def test_the_command_on_a_machine_without_a_gpu(self):
    # `python -m mlkit.convert` as a user runs it: no JAX_PLATFORMS from the test set-up.
    # The CUDA plugin is installed (deviceless H200 compiles), and without the command's
    # own set-up jax would probe for a driver and print a cuDNN traceback.
    from pallas_kernels.h200 import env as h200_env
    if h200_env.gpu_present():
      self.skipTest("a GPU is present: the CUDA plugin is meant to load")
    dst = self.dst()
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "mlkit.convert", self.src, dst, "--recipe", "bf16"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    self.assertEqual(r.returncode, 0, r.stderr[-2000:])
    self.assertTrue(os.listdir(dst))  # the checkpoint was written
    for noise in ("plugin configuration error", "cuDNN", "Traceback"):
      self.assertNotIn(noise, r.stderr)


if __name__ == "__main__":
  absltest.main()
