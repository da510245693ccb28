"""Offline batch generation from a checkpoint: the library call and the command line."""
import json
import os
import pathlib

import pytest

from tests import preloaded
from tests.tiny_runs import tiny_config
from toolkit import training
from toolkit.inference import offline, restore
from toolkit.errors import ConfigError
from toolkit.inference.sampling import SamplingParams

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("lm")
  config = tiny_config(steps=2)
  config.train.checkpoint_every = 1  # steps 1 and 2: an earlier step to restore
  training.run(config, str(path))
  return path


def test_prompts_file_to_output_file_in_order(workdir, tmp_path):
  prompts = tmp_path / "in.jsonl"
  lines = [{"id": "a", "prompt": "The "}, {"tokens": [72, 105]},
           {"id": 3, "prompt": "def f(x):", "max_tokens": 2},
           {"prompt": "The ", "temperature": 1.0, "top_k": 5, "seed": 11}]
  prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
  out = tmp_path / "out.jsonl"
  records = offline.run(tiny_config(), str(workdir), prompts_file=str(prompts), output=str(out),
                         defaults=SamplingParams(max_tokens=6), batch_size=4, cache_length=32)
  written = [json.loads(line) for line in out.read_text().splitlines()]
  assert written == records and len(written) == 4
  assert [r.get("id") for r in written] == ["a", None, 3, None]
  assert [r["completion_tokens"] for r in written] == [6, 6, 2, 6]
  assert all(r["finish_reason"] == "length" for r in written)
  assert written[1]["prompt_tokens"] == 2 and written[2]["prompt_tokens"] == 9
  # Greedy is deterministic, and a seeded sample is reproducible on its own.
  alone = offline.run(tiny_config(), str(workdir), prompt="The ",
                       defaults=SamplingParams(max_tokens=6), batch_size=4, cache_length=32)
  assert alone[0]["tokens"] == written[0]["tokens"]
  again = offline.run(tiny_config(), str(workdir), prompt="The ", batch_size=4,
                       cache_length=32, defaults=SamplingParams(max_tokens=6, temperature=1.0,
                                                                top_k=5, seed=11))
  assert again[0]["tokens"] == written[3]["tokens"]


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a"}\n{"prompt": "b"\n', "in.jsonl line 2 is not valid JSON"),
    ('{"prompt": "a", "top_p": 2}\n', "in.jsonl line 1: top_p=2 must be in (0, 1]"),
    ('{"text": "a"}\n', "in.jsonl line 1: unknown field 'text'; give \"prompt\" (text) or "
                       '"tokens"'),
    ('{"prmpt": "a"}\n', "in.jsonl line 1: unknown field 'prmpt' (did you mean 'prompt'?)"),
    ('{"prompt": "a", "tokens": [1]}\n', 'line 1: give exactly one of "prompt" (text) or "tokens"'),
    ('{"prompt": "a", "temp": 1}\n', "in.jsonl line 1: unknown field 'temp'"),
    ('{"prompt": "' + "x" * 40 + '"}\n', "exceeds the cache length 32"),
    ("\n", "holds no prompts"),
])
def test_bad_prompt_files_name_the_line(workdir, tmp_path, content, message):
  path = tmp_path / "in.jsonl"
  path.write_text(content)
  with pytest.raises(ConfigError) as error:
    offline.run(tiny_config(), str(workdir), prompts_file=str(path), cache_length=32,
                 defaults=SamplingParams(max_tokens=4))
  assert message in str(error.value)


def test_missing_checkpoint_and_arguments_are_clear_errors(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    offline.run(tiny_config(), str(tmp_path / "nope"), prompt="a")
  with pytest.raises(ConfigError, match="holds no checkpoint"):
    offline.run(tiny_config(), str(tmp_path), prompt="a")
  with pytest.raises(ConfigError, match="exactly one of --prompt or --prompts_file"):
    offline.run(tiny_config(), str(tmp_path), prompt="a", prompts_file="x.jsonl")


def _cli(*args):
  env = dict(os.environ)  # the suite's: 8 CPU devices, its cache (tests/conftest.py)
  return preloaded.run("toolkit.generate", args, env=env, timeout=300)


def test_command_line(workdir, tmp_path):
  done = _cli("--config=experiments/lm.py:tiny", f"--checkpoint={workdir}", "--prompt=The ",
              "--max_tokens=5", "--cache_length=32")
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.startswith("The ")
  assert "requests 1/1 (100%)" in done.stderr and "tokens/s" in done.stderr
  bad = _cli("--config=experiments/lm.py:tiny", f"--checkpoint={workdir}", "--prompt=x",
             "--top_p=1.5")
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines()[-1] == (
      "error: --top_p=1.5 must be in (0, 1] (1 turns it off)")


def test_params_only_restore_equals_the_full_state_restore(workdir):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from toolkit.training.checkpoints import checkpoint  # pylint: disable=g-import-not-at-top
  params, _, mesh, _, step = restore.restore_params(tiny_config(), str(workdir))
  setup = training.build(tiny_config())
  manager = checkpoint.Checkpoints(checkpoint.checkpoints_dir(str(workdir)), read_only=True)
  state, _ = manager.restore(step, setup.layout.abstract)
  manager.close()
  assert jax.tree.structure(params) == jax.tree.structure(state["params"])
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"])):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_earlier_step_restores_and_a_missing_one_names_the_steps(workdir):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from toolkit.training.checkpoints import checkpoint  # pylint: disable=g-import-not-at-top
  params, *_, step = restore.restore_params(tiny_config(), str(workdir), step=1)
  latest, *_, latest_step = restore.restore_params(tiny_config(), str(workdir))
  assert (step, latest_step) == (1, 2)
  setup = training.build(tiny_config())
  manager = checkpoint.Checkpoints(checkpoint.checkpoints_dir(str(workdir)), read_only=True)
  state, _ = manager.restore(1, setup.layout.abstract)
  manager.close()
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(np.asarray(a), np.asarray(c))
             for a, c in zip(jax.tree.leaves(params), jax.tree.leaves(latest)))
  with pytest.raises(ConfigError, match=r"^step 7: .* holds steps 1, 2; give one of them$"):
    restore.restore_params(tiny_config(), str(workdir), step=7)
