"""Preference pairs (toolkit/data/preference.py): records and synthetic tasks to (pairs, 2,
seq_len) rows whose completion weights cover exactly each side's completion, the batches a pure
function of (seed, step) with whole pairs on the leading axis, and every bad record one error
naming its file and line."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import sharding
from experiments import sft
from tests import extras
from toolkit.data import preference, text
from toolkit.data.chat_template import ChatTemplate, ChatTokenizer
from toolkit.errors import ConfigError

BYTES = ChatTokenizer(ChatTemplate(sft.BYTE_TEMPLATE))  # "U: ...\nA: ...\n"


def _completion(pairs: preference.Pairs, index: int, side: int) -> str:
  arrays = pairs.arrays
  return text.decode(arrays["targets"][index, side][arrays["completion_weights"][index, side] > 0])


def _write(tmp_path, records, name="pairs.jsonl"):
  path = tmp_path / name
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


def test_synthetic_pairs_prefer_the_right_answer_over_another_instructions():
  train = preference.read_pairs("synthetic:repeat:64")
  held_out = preference.read_pairs("synthetic:repeat", split="held_out")
  assert len(train) == 64 and len(held_out) == 256
  assert not {p.prompt[0]["content"] for p in train} & {p.prompt[0]["content"] for p in held_out}
  answers = {p.chosen[0]["content"] for p in held_out}
  for pair in held_out:
    word = pair.prompt[0]["content"].removeprefix("repeat ")
    assert pair.chosen == [{"role": "assistant", "content": word}]
    assert pair.rejected[0]["content"] != word and pair.rejected[0]["content"] in answers
  rows = preference.tokenize(train, BYTES, 28, "train")
  assert rows.arrays["inputs"].shape == (64, 2, 28) and rows.truncated == rows.dropped == 0
  for i, pair in enumerate(train):
    # Both sides share the prompt's tokens; each side's weights cover its answer and the
    # template's end of turn, nothing of the prompt or the padding.
    chosen, rejected = (text.decode(rows.arrays["inputs"][i, s]).rstrip("\0") for s in (0, 1))
    prompt = f"U: {pair.prompt[0]['content']}\nA: "
    assert chosen == prompt + pair.chosen[0]["content"]
    assert rejected == prompt + pair.rejected[0]["content"]
    assert _completion(rows, i, 0) == pair.chosen[0]["content"] + "\n"
    assert _completion(rows, i, 1) == pair.rejected[0]["content"] + "\n"
    for side, shown in enumerate((chosen, rejected)):  # target t is input t + 1
      n = len(shown)
      np.testing.assert_array_equal(rows.arrays["targets"][i, side, :n - 1],
                                    rows.arrays["inputs"][i, side, 1:n])
      assert text.decode(rows.arrays["targets"][i, side, n - 1:n]) == "\n"


def test_only_the_last_completion_is_weighted_in_a_conversation_prompt(tmp_path):
  path = _write(tmp_path, [
      {"prompt": "hi", "chosen": "yes", "rejected": "no"},
      {"prompt": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "a"}, {"role": "assistant", "content": "earlier"},
                  {"role": "user", "content": "b"}],
       "chosen": [{"role": "assistant", "content": "good"}], "rejected": "bad"}])
  rows = preference.tokenize(preference.read_pairs(path), BYTES, 64, path)
  assert [_completion(rows, i, s) for i in (0, 1) for s in (0, 1)] == \
      ["yes\n", "no\n", "good\n", "bad\n"]  # not "earlier\n": an assistant turn of the prompt


def test_overlong_pairs_are_cut_or_left_out(tmp_path):
  path = _write(tmp_path, [{"prompt": "p", "chosen": "c" * 40, "rejected": "r"},
                           {"prompt": "q" * 40, "chosen": "c", "rejected": "r"},
                           {"prompt": "p", "chosen": "c", "rejected": "r"}])
  pairs = preference.read_pairs(path)
  cut = preference.tokenize(pairs, BYTES, 16, path)
  # The first keeps the start of its long answer; the second's answer is cut away entirely.
  assert (len(cut), cut.truncated, cut.dropped) == (2, 1, 1)
  # "U: p\nA: " is 8 tokens of the 17 kept.
  assert _completion(cut, 0, 0) == "c" * 9 and _completion(cut, 0, 1) == "r\n"
  kept = preference.tokenize(pairs, BYTES, 16, path, overlong="drop")
  assert (len(kept), kept.truncated, kept.dropped) == (1, 0, 2)
  with pytest.raises(ConfigError, match=r"all 1 preference pairs .* data\.seq_len=4"):
    preference.tokenize(pairs[:1], BYTES, 4, path, overlong="drop")


@pytest.mark.parametrize("line,words", [
    ("{\"prompt\": \"p\", \"chosen\": \"c\"}", "has no 'rejected'"),
    ("[1, 2]", "not a JSON object"),
    ("{\"prompt\": \"p\"", "not valid JSON"),
    ("{\"prompt\": \"p\", \"chosen\": \"same\", \"rejected\": \"same\"}", "states no preference"),
    ("{\"prompt\": [{\"role\": \"user\"}], \"chosen\": \"c\", \"rejected\": \"r\"}",
     r"prompt\[0\]\.content is missing"),
])
def test_a_bad_record_is_one_error_naming_its_line(tmp_path, line, words):
  path = _write(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}, line])
  with pytest.raises(ConfigError, match=f"pairs.jsonl line 2: .*{words}"):
    preference.read_pairs(path)


# Templates whose generation prompt (">> ") is not how they open an assistant turn: without
# {% generation %} marks the chat-data check finds it, with them the pairs' own.
_NOT_A_PREFIX = {
    "prefixes": ("{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] + '\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}>> {% endif %}",
                 "renders the conversation differently once later turns follow"),
    "generation_marks": ("{% for m in messages %}{% if m['role'] == 'assistant' %}A: "
                         "{% generation %}{{ m['content'] + '\\n' }}{% endgeneration %}"
                         "{% else %}{{ 'U: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}>> {% endif %}",
                         "tokens for the prompt are not the first tokens"),
}


@pytest.mark.parametrize("name", sorted(_NOT_A_PREFIX))
def test_a_template_whose_prompt_is_not_a_prefix_is_refused_by_name(tmp_path, name):
  template, words = _NOT_A_PREFIX[name]
  path = _write(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}])
  with pytest.raises(ConfigError, match=f"pairs.jsonl line 1: the chat template.*{words}"):
    preference.tokenize(preference.read_pairs(path), ChatTokenizer(ChatTemplate(template)), 32,
                        path)


def _batches(seed=0, pairs_per_batch=8, eval_batches=4):
  mesh = sharding.make_mesh([("fsdp", 4), ("tensor", 2)], [], jax.devices())
  spec = sharding.Rules.preset("fsdp_tp").activation_spec(("batch", None, None), mesh)
  train = preference.tokenize(preference.read_pairs("synthetic:repeat:20"), BYTES, 28, "train")
  held_out = preference.tokenize(preference.read_pairs("synthetic:repeat", split="held_out")[:20],
                                 BYTES, 28, "held out")
  return preference.PreferenceBatches(train, held_out, seed, pairs_per_batch, eval_batches,
                                      NamedSharding(mesh, spec))


def test_batches_are_a_pure_function_of_seed_and_step_with_whole_pairs():
  batches, again = _batches(), _batches()
  # Over 5 batches of 8, two epochs of the 20 pairs: each pair once per epoch.
  seen = np.concatenate([batches.indices(step) for step in range(5)])
  assert sorted(seen[:20]) == sorted(seen[20:40]) == list(range(20))
  assert list(seen[:20]) != list(seen[20:40])  # a new permutation each epoch
  assert list(seen) != list(np.concatenate([_batches(seed=1).indices(s) for s in range(5)]))
  for step in (0, 3):
    batch, same = batches.batch(step), again.batch(step)
    assert set(batch) == set(preference.KEYS)
    for key, value in batch.items():
      assert value.shape == (8, 2, 28) and value.sharding.spec[0] == "fsdp"
      np.testing.assert_array_equal(value, batches.train.arrays[key][batches.indices(step)])
      np.testing.assert_array_equal(value, same[key])
  abstract = batches.abstract()
  assert {k: (v.shape, v.dtype) for k, v in abstract.items()} == \
      {k: (v.shape, v.dtype) for k, v in batches.batch(0).items()}
  # The held-out batches: the pairs in order, the same at every evaluation; as many as fit.
  assert batches.eval_batches == 2
  np.testing.assert_array_equal(batches.eval_batch(1)["inputs"],
                                batches.held_out.arrays["inputs"][8:16])
  # A resumed run's iterator starts at its step with that step's batch.
  iterator = batches.iterator(3)
  try:
    np.testing.assert_array_equal(next(iterator)["targets"], batches.batch(3)["targets"])
    assert iterator.position() == {"step": 4}
  finally:
    iterator.close()
  with pytest.raises(ConfigError, match="holds 20 pair"):
    _batches(pairs_per_batch=24)


def test_parquet_rows_read_like_jsonl_lines(tmp_path):
  extras.require("pyarrow")
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  records = [{"prompt": "hi", "chosen": "yes", "rejected": "no"},
             {"prompt": "a", "chosen": "b", "rejected": "b"}]
  pq.write_table(pa.Table.from_pylist(records[:1]), tmp_path / "pairs.parquet")
  assert preference.read_pairs(str(tmp_path / "pairs.parquet")) == [preference.Pair(
      [{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "yes"}],
      [{"role": "assistant", "content": "no"}], f"{tmp_path / 'pairs.parquet'} row 1")]
  pq.write_table(pa.Table.from_pylist(records), tmp_path / "bad.parquet")
  with pytest.raises(ConfigError, match=r"bad.parquet row 2: .*states no preference"):
    preference.read_pairs(str(tmp_path / "bad.parquet"))


def test_a_runs_pairs_from_its_data_section(tmp_path):
  from experiments import dpo  # pylint: disable=g-import-not-at-top
  records = [{"prompt": f"say {i}", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(10)]
  config = dpo.get_config("tiny")
  config.data.update(path=_write(tmp_path, records), eval_fraction=0.2)
  data = preference.PreferenceData.from_config(config.data)
  assert (len(data.train), len(data.held_out)) == (8, 2)
  assert "8 training" in data.notes[0] and "data.eval_fraction=0.2 of data.path" in data.notes[0]
  config.data.eval_path = _write(tmp_path, records[:3], "held_out.jsonl")
  data = preference.PreferenceData.from_config(config.data)
  assert (len(data.train), len(data.held_out)) == (10, 3)
  config.data.update(path=_write(tmp_path, records[:1], "one.jsonl"), eval_path="")
  with pytest.raises(ConfigError, match=r"holds 1 preference pair\(s\): too few to hold out"):
    preference.PreferenceData.from_config(config.data)
