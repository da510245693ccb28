"""gs:// paths beyond the workdir, against the local Cloud Storage emulator
(scripts/dev/gcs_emulator.py): a Hugging Face folder in a bucket imports the same parameters as the local folder (read from
a local cache copy, reused on the next read); an export to a bucket (and an import into one)
gives the same files byte for byte as the local ones; a failed upload leaves no objects; a plan
file round-trips through a bucket; toolkit.compile writes its --json and --hlo there; token
shards in a bucket give the same batches as the local shards; and a missing bucket is one
ConfigError line wherever a path is given.

The Hugging Face folders are built by transformers (torch): only the tests that read or write
one (`converted`, `_hf_reference`) need the test extra's torch; the rest run without it."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import hf as hf_experiment
from tests.toolkit.data.test_pipeline import REPO, lm_config, token_dir  # noqa: F401  (fixture)
from toolkit import conversion, training
from toolkit import workdir as workdir_lib
from toolkit.compile import _check_outputs
from toolkit.conversion import output
from toolkit.data import shards
from toolkit.errors import ConfigError
from toolkit.hf import folder as folder_lib
from toolkit.planning import plan as plan_lib
from toolkit.training import config as config_lib, init_from

NAME = "gqa_untied_head_dim24_llama3"
MISSING = "gs://meshkit-no-such-bucket/path"


def _upload(folder, url: str) -> None:
  """Every file directly in the local `folder` as an object under `url`."""
  for name in sorted(os.listdir(folder)):
    workdir_lib.write_bytes(f"{url}/{name}", (folder / name).read_bytes())


def _hf_reference():
  """The Hugging Face test helpers (tests/toolkit/hf/reference.py), which import torch and
  transformers: a skip without them, a failure under CI=true (tests/extras.py)."""
  from tests.toolkit.hf import reference  # pylint: disable=g-import-not-at-top
  return reference


def _files(folder) -> dict[str, bytes]:
  """name -> bytes of every file under a local folder or every object under a gs:// URL."""
  if workdir_lib.is_url(str(folder)):
    root = workdir_lib.path(str(folder))
    return {p.name: p.read_bytes() for p in root.iterdir()}
  return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
  """Each test's cache folders in its own temporary folder."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  return tmp_path / "cache"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF folder, workdir imported from it onto fsdp_tp, HF folder exported from that), local."""
  root = tmp_path_factory.mktemp("gcs_paths")
  _hf_reference().write_folder(root / "hf", NAME)
  conversion.import_checkpoint(str(root / "hf"), str(root / "workdir"), _config())
  conversion.export_checkpoint(str(root / "workdir"), str(root / "exported"))
  return root / "hf", root / "workdir", root / "exported"


def _config():
  config = config_lib.defaults()
  config.mesh.ici, config.sharding.preset = "fsdp:4,tensor:2", "fsdp_tp"
  return config


def _assert_same_params(a, b) -> None:
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_hf_folder_in_a_bucket_reads_the_same_params_from_a_cached_copy(
    converted, gcs_bucket, cache, capsys):
  local, _, _ = converted
  url = f"gs://{gcs_bucket}/models/tiny"
  _upload(local, url)
  reference = _hf_reference()
  from_local, cfg, _ = reference.import_params(local)
  from_bucket, cfg_bucket, _ = reference.import_params(url)
  assert cfg_bucket == cfg
  _assert_same_params(from_bucket, from_local)
  copied = capsys.readouterr().err
  assert f"copying {url}/model.safetensors" in copied
  # Messages name the URL; the bytes come from the cache, copied once and then reused.
  folder = folder_lib.HFFolder(url)
  info = folder.tensors["model.embed_tokens.weight"]
  assert info.file == f"{url}/model.safetensors"
  assert info.local.startswith(str(cache / "meshkit" / "hf"))
  assert "copying" not in capsys.readouterr().err
  assert folder.special_tokens() == folder_lib.special_tokens(str(local))
  # experiments/hf.py:gs://... and train.init_from=hf:gs://... keep the URL.
  config = hf_experiment.get_config(url)
  assert config.train.init_from == f"hf:{url}"
  model = config_lib.model_config(config.model)
  assert init_from.source(config, model, str(local.parent / "fresh_workdir")).path == url


def test_import_from_and_into_a_bucket_then_export_matches_the_local_files(
    converted, gcs_bucket):
  local, _, exported = converted
  hf_url, workdir_url = f"gs://{gcs_bucket}/hf", f"gs://{gcs_bucket}/workdir"
  _upload(local, hf_url)
  written = conversion.import_checkpoint(hf_url, workdir_url, _config())
  assert written == f"{workdir_url}/checkpoints/0"
  assert workdir_lib.isfile(f"{written}/commit_success.txt")  # a committed step in place
  again = exported.parent / "exported_from_bucket"
  conversion.export_checkpoint(workdir_url, str(again))  # tokenizer files from hf_url
  assert _files(again) == _files(exported)


def test_export_to_a_bucket_is_the_local_export_byte_for_byte(converted, gcs_bucket):
  _, workdir, exported = converted
  url = f"gs://{gcs_bucket}/exported"
  written = conversion.export_checkpoint(str(workdir), url)
  assert sorted(written) == sorted(_files(exported))
  assert _files(url) == _files(exported)
  with pytest.raises(ConfigError, match="exists and is not empty; give a new folder"):
    conversion.export_checkpoint(str(workdir), url)


def test_a_failed_upload_leaves_no_objects(tmp_path, gcs_server, gcs_bucket, monkeypatch):
  for name in ("a.json", "b.json", "c.json"):
    (tmp_path / name).write_text("{}" * 1000)
  copy, calls = output.shutil.copyfileobj, []

  def fail_the_second(source, sink, length):
    calls.append(source.name)
    if len(calls) == 2:
      sink.write(source.read(10))  # half an object, which closing the file would commit
      raise OSError("connection reset")
    copy(source, sink, length)

  monkeypatch.setattr(output.shutil, "copyfileobj", fail_the_second)
  with pytest.raises(OSError, match="connection reset"):
    output.upload(str(tmp_path), f"gs://{gcs_bucket}/out")
  assert len(calls) == 2 and gcs_server.objects(gcs_bucket, "out/") == []


def test_a_plan_file_round_trips_through_a_bucket(gcs_bucket, tmp_path):
  plan = {"overrides": {"mesh.ici": "data:1,fsdp:-1", "sharding.preset": "fsdp",
                        "train.microbatches": 2}, "target": "v5p-8"}
  url, local = f"gs://{gcs_bucket}/plans/plan.json", str(tmp_path / "plan.json")
  plan_lib.write_plan(url, plan)
  plan_lib.write_plan(local, plan)
  assert workdir_lib.read_text(url) == workdir_lib.read_text(local)
  assert plan_lib.load_plan(url) == plan_lib.load_plan(local)
  config = plan_lib.apply_plan(config_lib.defaults(), url)
  assert (config.sharding.preset, config.train.microbatches) == ("fsdp", 2)
  with pytest.raises(ConfigError, match=r"--plan=gs://.*/none.json: no such file"):
    plan_lib.load_plan(f"gs://{gcs_bucket}/plans/none.json")


def test_token_shards_in_a_bucket_give_the_same_batches(token_dir, gcs_bucket, cache,  # noqa: F811
                                                        capsys):
  url = f"gs://{gcs_bucket}/tokens"
  _upload(pathlib.Path(token_dir), url)
  stream = shards.TokenStream(url, "train")
  assert stream.names[0] == f"{url}/train_00000.bin"
  assert all(f.startswith(str(cache / "meshkit" / "tokens")) for f in stream.files)
  local_batches = training.build(lm_config(token_dir)).batches
  bucket_batches = training.build(lm_config(url)).batches
  for step in range(3):
    for key, value in jax.device_get(local_batches.batch(step)).items():
      np.testing.assert_array_equal(jax.device_get(bucket_batches.batch(step))[key], value)
  assert "copying" in capsys.readouterr().err
  shards.TokenStream(url, "train")
  assert "copying" not in capsys.readouterr().err  # the cached copies are reused
  # A shard missing from the bucket is named by its URL, even with a cached copy.
  workdir_lib.path(f"{url}/train_00001.bin").unlink()
  with pytest.raises(ConfigError, match=f"shard {url}/train_00001.bin is missing"):
    shards.TokenStream(url, "train")


def test_compile_writes_its_json_and_hlo_to_a_bucket(gcs_server, gcs_bucket):
  url = f"gs://{gcs_bucket}/compile"
  env = {**os.environ, **gcs_server.env, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
      [sys.executable, "-m", "toolkit.compile", "--config=experiments/lm.py:tiny",
       "--topology=cpu:8", f"--json={url}/report.json", f"--hlo={url}/step.hlo"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
  report = json.loads(workdir_lib.read_text(f"{url}/report.json"))
  assert report["run"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
  assert workdir_lib.read_text(f"{url}/step.hlo").startswith("HloModule")


@pytest.mark.parametrize("where", ["hf", "export", "import_workdir", "plan", "tokens",
                                   "compile_json"])
def test_a_missing_bucket_is_one_config_error_line(where, gcs_server, request):
  converted = lambda: request.getfixturevalue("converted")  # only where a folder is read
  calls = {
      "hf": lambda: folder_lib.HFFolder(MISSING, "--hf"),
      "export": lambda: conversion.export_checkpoint(str(converted()[1]), MISSING),
      "import_workdir": lambda: conversion.import_checkpoint(str(converted()[0]), MISSING,
                                                             _config()),
      "plan": lambda: plan_lib.load_plan(MISSING),
      "tokens": lambda: shards.TokenStream(MISSING, "train"),
      "compile_json": lambda: _check_outputs({"json": MISSING, "hlo": None, "plan": False}),
  }
  with pytest.raises(ConfigError) as error:
    calls[where]()
  message = str(error.value)
  assert "\n" not in message
  assert f"={MISSING}: bucket 'meshkit-no-such-bucket' does not exist" in message
