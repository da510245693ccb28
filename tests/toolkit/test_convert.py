"""`python -m toolkit.convert` as users run it: import a Hugging Face folder, generate from it
with its tokenizer (the same greedy tokens as transformers' `generate`), export it back; and
the mistakes that must each end in one `error:` line, exit non-zero, and write nothing."""
from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests import preloaded
from tests.toolkit.hf import reference
from tests.toolkit.test_cli import _env, refused, side_by_side, snapshot

TIMEOUT_S = 300


def convert(*args: str) -> subprocess.CompletedProcess:
  return preloaded.run("toolkit.convert", args, env=_env(), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
  """A tiny random HF Llama (byte-level tokenizer, BOS 256, EOS 257) and its transformers
  model."""
  path = tmp_path_factory.mktemp("hf") / "tiny"
  return path, reference.write_folder(path)


def test_import_generate_export(original, tmp_path):
  folder, model = original
  workdir, out = tmp_path / "imported", tmp_path / "exported"
  done = convert("import", f"--hf={folder}", f"--workdir={workdir}")
  assert done.returncode == 0, done.stderr
  assert (workdir / "checkpoints" / "0").is_dir() and (workdir / "config.json").is_file()

  # Greedy generation with the folder's tokenizer: BOS first, the same tokens transformers picks.
  prompt = "The meaning of "
  done = preloaded.run(
      "toolkit.generate",
      [f"--config=experiments/hf.py:{folder}", f"--checkpoint={workdir}", f"--tokenizer={folder}",
       f"--prompt={prompt}", "--max_tokens=12", "--cache_length=64",
       f"--output={tmp_path / 'out.jsonl'}"], env=_env(), timeout=TIMEOUT_S)
  assert done.returncode == 0, done.stderr
  record = json.loads((tmp_path / "out.jsonl").read_text())
  prompt_ids = [reference.tiny_hf_model.BOS] + list(prompt.encode())
  assert record["prompt_tokens"] == len(prompt_ids)
  with reference.torch.no_grad():
    expected = model.generate(reference.torch.tensor([prompt_ids]), max_new_tokens=12,
                              do_sample=False)[0, len(prompt_ids):].tolist()
  if reference.tiny_hf_model.EOS in expected:  # both stop at EOS, without emitting it
    expected = expected[:expected.index(reference.tiny_hf_model.EOS)]
  assert record["tokens"] == expected
  assert record["completion"] == bytes(t for t in expected if t < 256).decode(errors="replace")
  assert done.stdout.startswith(prompt)

  done = convert("export", f"--workdir={workdir}", f"--out={out}")
  assert done.returncode == 0, done.stderr
  before, after = load_file(str(folder / "model.safetensors")), load_file(
      str(out / "model.safetensors"))
  assert sorted(before) == sorted(after) and all(
      np.array_equal(before[k], after[k]) for k in before)
  assert (out / "tokenizer.json").is_file()
  # generation_config.json: the ids transformers' generate starts and stops with.
  generation = reference.transformers.GenerationConfig.from_pretrained(str(out))
  assert generation.bos_token_id == reference.tiny_hf_model.BOS
  assert generation.eos_token_id == reference.tiny_hf_model.EOS


def _edit_config(folder, change) -> None:
  config = json.loads((folder / "config.json").read_text())
  change(config)
  (folder / "config.json").write_text(json.dumps(config))


def _drop_tensor(folder, name: str) -> None:
  tensors = load_file(str(folder / "model.safetensors"))
  del tensors[name]
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _rope(kind: str):
  def change(config):
    config["rope_parameters"]["rope_type"] = kind
  return change


# (id, how to spoil a copy of the folder, command and arguments with {H} for the folder, {W}
# for a new workdir, {O} for a new export folder and {F} for a folder that holds a file,
# fragments the error line must contain)
MISTAKES = [
    ("missing_tensor", lambda f: _drop_tensor(f, "model.layers.1.mlp.up_proj.weight"),
     ["import", "--hf={H}", "--workdir={W}"],
     ["tensor model.layers.1.mlp.up_proj.weight is missing", "incomplete"]),
    ("shape_mismatch", lambda f: _edit_config(f, lambda c: c.update(intermediate_size=160)),
     ["import", "--hf={H}", "--workdir={W}"],
     ["mlp.down_proj.weight has shape [64, 192]", "implies [64, 160]",
      "does not belong to these weights"]),
    ("unknown_architecture",
     lambda f: _edit_config(f, lambda c: c.update(architectures=["GPT2LMHeadModel"])),
     ["import", "--hf={H}", "--workdir={W}"],
     ["architecture 'GPT2LMHeadModel' is not supported", "meshkit reads LlamaForCausalLM"]),
    ("vocab_mismatch", lambda f: _edit_config(f, lambda c: c.update(vocab_size=300)),
     ["import", "--hf={H}", "--workdir={W}"],
     ["model.embed_tokens.weight has 258 rows", "vocab_size=300", "fix vocab_size"]),
    ("unsupported_rope_scaling", lambda f: _edit_config(f, _rope("yarn")),
     ["import", "--hf={H}", "--workdir={W}"],
     ["rope_type='yarn' is not supported", "'default'", "'llama3'"]),
    ("workdir_not_empty", None, ["import", "--hf={H}", "--workdir={F}"],
     ["--workdir=", "exists and is not empty", "give a new folder"]),
    ("export_out_not_empty", None, ["export", "--workdir={F}", "--out={F}"],
     ["--out=", "exists and is not empty"]),
    ("export_without_checkpoint", None, ["export", "--workdir={H}", "--out={O}"],
     ["--workdir=", "holds no checkpoint"]),
    ("no_command", None, ["--hf={H}", "--workdir={W}"],
     ["give one command first, import or export"]),
    ("flag_of_the_other_command", None, ["import", "--hf={H}", "--workdir={W}", "--out={O}"],
     ["--out applies to `export`, not `import`"]),
]


@pytest.fixture(scope="module")
def mistake_runs(original, tmp_path_factory) -> dict[str, tuple]:
  """Each mistake on its own copy of the folder, four processes at a time (each spends its
  time importing JAX). name -> (root, snapshot of the root before, result)."""
  def run_one(case):
    name, spoil, args, _ = case
    root = tmp_path_factory.mktemp(name)
    shutil.copytree(original[0], root / "hf")
    (root / "full").mkdir()
    (root / "full" / "keep.txt").write_text("not yours")
    if spoil is not None:
      spoil(root / "hf")
    before = snapshot(root)
    paths = {"{H}": root / "hf", "{W}": root / "new_workdir", "{O}": root / "new_out",
             "{F}": root / "full"}
    for key, path in paths.items():
      args = [a.replace(key, str(path)) for a in args]
    return name, (root, before, convert(*args))

  return side_by_side(run_one, MISTAKES)


@pytest.mark.parametrize("name, fragments", [(m[0], m[3]) for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_mistake_is_one_line_and_writes_nothing(mistake_runs, name, fragments):
  root, before, result = mistake_runs[name]
  # No new workdir or export folder, nothing changed.
  print(refused(result, fragments, root, before))
