"""Grain input pipelines: order a function of (seed, step) only, exact resume in a new process
with Grain workers on and off, and bad input files named in one error line."""
from __future__ import annotations

import json
import os
import re
import subprocess

import jax
import numpy as np
import pytest

from tests import preloaded
from experiments import lm, vit
from toolkit.training.checkpoints import checkpoint
from toolkit import data as data_lib, training
from toolkit.data import preparation, shards
from toolkit.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
N, K = 6, 3  # straight runs train N steps; interrupted ones stop at K and resume to N


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> str:
  """A byte-level shard folder from CPython's docs, in 3 train shards of 40,000 tokens."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  folder = tmp_path_factory.mktemp("tokens")
  inputs = []
  for i, key in enumerate(sorted(topics.topics)[:60]):
    path = folder / f"doc{i}.txt"
    path.write_text(topics.topics[key])
    inputs.append(str(path))
  out = str(folder / "shards")
  preparation.prepare(inputs, out, shards.Tokenizer("bytes"), val_fraction=0.2,
                       shard_tokens=40_000, log=lambda _: None)
  return out


def lm_config(token_dir: str, workers: int = 0):
  config = lm.get_config("tiny,data=tokens")
  config.model.vocab_size = 384
  config.data.update(path=token_dir, worker_count=workers)
  config.optimizer.schedule_steps = N
  config.train.update(steps=N, checkpoint_every=K, log_every=1)
  return config


def vit_config(workers: int = 0):
  config = vit.get_config("tiny")
  config.data.worker_count = workers
  config.optimizer.schedule_steps = N
  config.train.update(steps=N, checkpoint_every=K, log_every=1, eval_every=N)
  return config


def _cli_overrides(config, name: str) -> list[str]:
  experiment = ("experiments/lm.py:tiny,data=tokens" if name == "lm"
                else "experiments/vit.py:tiny")
  flags = [f"--config={experiment}", f"--config.optimizer.schedule_steps={N}",
           f"--config.train.steps={N}", f"--config.train.checkpoint_every={K}",
           "--config.train.log_every=1", f"--config.data.worker_count={config.data.worker_count}"]
  if name == "lm":
    flags += ["--config.model.vocab_size=384", f"--config.data.path={config.data.path}"]
  else:
    flags += [f"--config.train.eval_every={N}"]
  return flags


def _train_cli(workdir: str, flags: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
  env = dict(os.environ)  # the suite's: 8 CPU devices, its cache (tests/conftest.py)
  return preloaded.run("toolkit.train", [f"--workdir={workdir}", *flags], env=env,
                       timeout=timeout)


def _losses(workdir: str) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _host(batch) -> dict[str, np.ndarray]:
  return {key: np.asarray(value) for key, value in jax.device_get(batch).items()}


# --- data order -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [pytest.param("lm", marks=pytest.mark.smoke), "vit"])
def test_iterator_matches_random_access_with_and_without_workers(token_dir, name):
  """Batch s is the same from Grain's DataLoader with 0 or 2 workers and from random access,
  and a different seed gives a different order."""
  make = (lambda w: lm_config(token_dir, w)) if name == "lm" else vit_config
  batches = training.build(make(0)).batches
  assert isinstance(batches, data_lib.GrainBatches)
  want = [_host(batches.batch(s)) for s in range(4)]
  for workers in (0, 2):
    other = training.build(make(workers)).batches
    iterator = other.iterator(0)
    got = [_host(next(iterator)) for _ in range(4)]
    iterator.close()
    for w, g in zip(want, got):
      for key in w:
        np.testing.assert_array_equal(g[key], w[key], err_msg=f"{key}, {workers} workers")
  reseeded = make(0)
  reseeded.seed = 1
  assert not np.array_equal(_host(training.build(reseeded).batches.batch(0))[
      "targets" if name == "lm" else "images"], want[0]["targets" if name == "lm" else "images"])


def test_windows_pack_documents_with_end_tokens(token_dir):
  """Windows cut the concatenated stream (across shard files) every seq_len tokens; documents
  are separated by the end-of-document id."""
  stream = shards.TokenStream(token_dir, "train")
  assert len(stream.files) > 1
  windows = shards.TokenWindows(stream, 32)
  whole = np.concatenate([np.fromfile(f, np.uint16) for f in stream.files]).astype(np.int32)
  for i in (0, len(windows) // 2, len(windows) - 1):
    np.testing.assert_array_equal(windows[i]["tokens"], whole[i * 32:i * 32 + 33])
  assert (whole == shards.BYTE_EOT).sum() >= 40


def test_images_held_out_is_never_augmented():
  config = vit_config()
  config.data.update(crop_padding=2, flip=True)
  batches = training.build(config).batches
  first = _host(batches.eval_batch(0))
  assert np.array_equal(first["images"], _host(batches.eval_batch(0))["images"])
  held = batches.held_out_source
  raw = np.stack([held[i]["image"] for i in range(len(first["labels"]))])
  np.testing.assert_allclose(first["images"], (raw - config.data.mean) / config.data.std)
  # ...while training rows are padded-and-cropped or flipped: most differ from the originals.
  augmented = batches.local_batch(0)["images"]
  originals = np.stack([batches.examples[int(p)]["image"] for p in batches.rows])
  normalized = (originals - config.data.mean) / config.data.std
  changed = [not np.allclose(a, o) for a, o in zip(augmented, normalized)]
  assert sum(changed) > len(changed) // 2


def test_eval_covers_the_held_out_split_once():
  batches = training.build(vit_config()).batches
  total = sum(float(_host(batches.eval_batch(i))["weights"].sum())
              for i in range(batches.eval_batches))
  assert total == len(batches.held_out_source) == 359


# --- exact resume in a new process ------------------------------------------------------------

@pytest.fixture(scope="module")
def straight(token_dir, tmp_path_factory):
  """N steps uninterrupted, in this process, no workers: the reference for each pipeline."""
  runs = {}
  for name, config in (("lm", lm_config(token_dir)), ("vit", vit_config())):
    workdir = str(tmp_path_factory.mktemp(f"straight_{name}"))
    runs[name] = training.run(config, workdir).train_losses
  return runs


# Both pipelines and both worker modes run by default; the other two pairings are slow.
@pytest.mark.parametrize("name,workers", [
    ("lm", 0), pytest.param("lm", 2, marks=pytest.mark.slow),
    pytest.param("vit", 0, marks=pytest.mark.slow), ("vit", 2)])
def test_resume_in_a_new_process_sees_the_same_batches(straight, token_dir, tmp_path, name,
                                                       workers):
  config = lm_config(token_dir, workers) if name == "lm" else vit_config(workers)
  workdir = str(tmp_path / "w")
  config.train.steps = K
  first = training.run(config, workdir)
  assert first.final_step == K
  # The checkpoint holds Grain's iterator state, after the batch of step K - 1.
  manager = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
  setup = training.build(config)
  _, position = manager.restore(K, setup.layout.abstract)
  manager.close()
  assert position["step"] == K and position["grain"]["worker_count"] == workers
  assert json.loads(position["grain"]["state"])["worker_count"] == workers

  proc = _train_cli(workdir, _cli_overrides(config, name))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f"restored step {K}" in proc.stdout
  # Bitwise: the same batches in the same order (with workers or without) and the same math.
  assert _losses(workdir) == straight[name]


def test_restore_with_another_worker_count_restarts_at_the_step(token_dir):
  """Grain refuses a state saved with another worker count; the batches are a function of
  the step, so the pipeline restarts there and yields the same batches."""
  two = training.build(lm_config(token_dir, 2)).batches
  iterator = two.iterator(0)
  for _ in range(3):
    next(iterator)
  position = iterator.position()
  iterator.close()
  zero = training.build(lm_config(token_dir, 0)).batches
  resumed = zero.iterator(3, position)
  np.testing.assert_array_equal(_host(next(resumed))["inputs"], _host(zero.batch(3))["inputs"])
  resumed.close()


# --- bad inputs -------------------------------------------------------------------------------

def _build_error(config) -> str:
  with pytest.raises(ConfigError) as e:
    batches = training.build(config).batches
    batches.batch(0)
  return str(e.value)


def test_missing_shard_file_is_named(token_dir, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  folder = tmp_path / "copy"
  shutil.copytree(token_dir, folder)
  os.remove(folder / "train_00001.bin")
  message = _build_error(lm_config(str(folder)))
  assert "train_00001.bin is missing" in message and "prepare_text.py" in message


def test_truncated_shard_file_is_named(token_dir, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  folder = tmp_path / "copy"
  shutil.copytree(token_dir, folder)
  with open(folder / "val_00000.bin", "r+b") as f:
    f.truncate(10)
  assert "val_00000.bin is corrupt" in _build_error(lm_config(str(folder)))


def test_token_ids_beyond_the_vocabulary(token_dir, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  config = lm_config(token_dir)
  config.model.vocab_size = 256
  message = _build_error(config)
  assert "vocabulary has 257 ids but model.vocab_size=256" in message
  assert "--config.model.vocab_size=384" in message
  # A file holding an id its meta.json does not allow: named when read.
  folder = tmp_path / "copy"
  shutil.copytree(token_dir, folder)
  tokens = np.fromfile(folder / "train_00000.bin", np.uint16)
  tokens[5] = 60_000
  tokens.tofile(folder / "train_00000.bin")
  stream = shards.TokenStream(str(folder), "train")
  with pytest.raises(ConfigError, match=r"train_00000.bin holds token id 60000, beyond"):
    stream.read(0, 100)


def test_missing_meta_and_empty_split(tmp_path):
  assert "meta.json is missing" in _build_error(lm_config(str(tmp_path)))
  (tmp_path / "doc.txt").write_text("only one document. " * 100)
  out = str(tmp_path / "out")
  preparation.prepare([str(tmp_path / "doc.txt")], out, shards.Tokenizer("bytes"), 0.0, 1000,
                       log=lambda _: None)
  assert "lists no 'val' tokens" in _build_error(lm_config(out))


def test_images_of_the_wrong_shape_and_empty_datasets(tmp_path):
  config = vit_config()
  config.data.update(source="npz", path=str(tmp_path / "d.npz"))
  assert "d.npz' does not exist" in _build_error(config)
  np.savez(tmp_path / "d.npz", images=np.zeros((10, 28, 28), np.uint8), labels=np.zeros(10))
  message = _build_error(config)
  assert "d.npz: images have shape (10, 28, 28, 1), expected (N, 8, 8, 1)" in message
  np.savez(tmp_path / "d.npz", images=np.zeros((0, 8, 8), np.uint8), labels=np.zeros(0))
  assert "d.npz: the dataset is empty" in _build_error(config)
  (tmp_path / "bad.npz").write_bytes(b"not a zip")
  config.data.path = str(tmp_path / "bad.npz")
  assert "bad.npz is not a readable .npz file" in _build_error(config)
  config.data.update(source="image_folder", path=str(tmp_path / "folder"))
  (tmp_path / "folder" / "cat").mkdir(parents=True)
  assert "folder: the dataset is empty" in _build_error(config)
  for i in range(4):
    (tmp_path / "folder" / "cat" / f"broken{i}.png").write_bytes(b"not a png")
  assert re.search(r"image .*broken\d.png cannot be decoded", _build_error(config))


def test_image_folder_trains_on_its_images(tmp_path):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  for label in ("a", "b"):
    (tmp_path / label).mkdir()
    for i in range(20):
      Image.fromarray(rng.integers(0, 255, (12, 12), np.uint8)).save(tmp_path / label / f"{i}.png")
  config = vit_config()
  config.data.update(source="image_folder", path=str(tmp_path), eval_fraction=0.2,
                     global_batch_size=8)
  batches = training.build(config).batches
  batch = _host(batches.batch(0))
  assert batch["images"].shape == (8, 8, 8, 1) and set(batch["labels"]) <= {0, 1}
  assert batches.eval_batches == 1


def test_bad_input_is_one_error_line_from_the_command_line(tmp_path):
  proc = _train_cli(str(tmp_path / "w"), ["--config=experiments/lm.py:tiny,data=tokens",
                                          f"--config.data.path={tmp_path / 'none'}"])
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: data.path=")
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "w")
