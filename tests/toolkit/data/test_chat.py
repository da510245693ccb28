"""Chat data (toolkit/data/chat.py): conversations from JSONL and Parquet in both forms, every
bad line named by file and line, overlong conversations truncated or dropped and counted, the
loss weights on the assistant's tokens (or on all), batches that resume exactly from a saved
Grain state, and experiments/sft.py's tiny variant training end to end."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from experiments import sft
from tests import extras
from toolkit import training
from toolkit.data import chat, instruct
from toolkit.errors import ConfigError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]


def _jsonl(path, records) -> str:
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


def _tokenizer() -> chat.ChatTokenizer:
  return chat.ChatTokenizer.load("bytes", sft.BYTE_TEMPLATE)


def test_jsonl_and_parquet_in_both_forms(tmp_path):
  pyarrow = extras.require("pyarrow")
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  records = [{"messages": MESSAGES}, {"prompt": "2+2?", "completion": "4"},
             {"prompt": MESSAGES[:2], "completion": MESSAGES[2:]}]
  first = _jsonl(tmp_path / "a.jsonl", records[:2])
  pq.write_table(pyarrow.Table.from_pylist([{"prompt": "x", "completion": "y"}]),
                 tmp_path / "b.parquet")
  _jsonl(tmp_path / "c.jsonl", records[2:])
  found = chat.read_conversations(f"{first},{tmp_path}/b.parquet,{tmp_path}/c*.jsonl")
  assert [c.messages for c in found] == [
      MESSAGES, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
      [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], MESSAGES]
  assert [c.where for c in found] == [f"{first} line 1", f"{first} line 2",
                                      f"{tmp_path}/b.parquet row 1", f"{tmp_path}/c.jsonl line 1"]


BAD_LINES = [
    ("[1, 2]", "line 2: not a JSON object"),
    ("{\"messages\": [", "line 2: not valid JSON"),
    # The column of an error at the line's end once read 1 (the line break's next line).
    ('{"prompt": "x", "completion": "y"', "line 2: not valid JSON (Expecting ',' delimiter at "
     "column 34 (the end of the line: a closing brace or quote missing?))"),
    ({"text": "hi"}, "line 2: has neither \"messages\" nor \"prompt\" and \"completion\" "
                     "(keys: text)"),
    ({"messages": []}, "line 2: messages must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "line 2: messages[0].content is missing; give a string"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0].content is a list"),
    ({"prompt": "x", "completion": 3}, "line 2: completion must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "only a question"}]},
     "line 2: has no assistant turn to train on"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m.split(":")[-1][:30] for _, m in
                                                          BAD_LINES])
def test_each_bad_line_is_one_error_naming_file_and_line(tmp_path, line, message):
  path = _jsonl(tmp_path / "train.jsonl", [{"messages": MESSAGES}, line])
  with pytest.raises(ConfigError) as e:
    chat.tokenize(chat.read_conversations(path), _tokenizer(), 64, "train")
  assert str(e.value).startswith(f"{path} line 2: ") and message in str(e.value), str(e.value)
  assert "\n" not in str(e.value)


def test_missing_files_bad_utf8_and_unknown_tasks(tmp_path):
  with pytest.raises(ConfigError, match="'nope.jsonl' names no file"):
    chat.read_conversations("nope.jsonl")
  (tmp_path / "bad.jsonl").write_bytes(b"{\"prompt\": \"\xff\"}\n")
  with pytest.raises(ConfigError, match=r"bad.jsonl line 1 is not UTF-8"):
    chat.read_conversations(str(tmp_path / "bad.jsonl"))
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ConfigError, match="holds no conversations"):
    chat.read_conversations(str(tmp_path / "empty.jsonl"))
  with pytest.raises(ConfigError, match="no synthetic task 'sort'; choose one of "
                                        "synthetic:reverse, synthetic:repeat, "
                                        "synthetic:upper, synthetic:add"):
    chat.read_conversations("synthetic:sort")


def test_overlong_conversations_are_truncated_or_dropped_and_counted():
  tokenizer = _tokenizer()
  short = chat.Conversation([{"role": "user", "content": "a"},
                             {"role": "assistant", "content": "b"}], "short")  # 10 bytes
  long = chat.Conversation([{"role": "user", "content": "x" * 10},
                            {"role": "assistant", "content": "y" * 30}], "long")  # 48 bytes
  late = chat.Conversation([{"role": "user", "content": "x" * 60},
                            {"role": "assistant", "content": "y"}], "late")
  cut = chat.tokenize([short, long, late], tokenizer, 40, "t", overlong="truncate")
  assert (len(cut), cut.truncated, cut.dropped) == (2, 1, 1)  # `late` keeps no answer
  assert cut.document(1)["inputs"].size == 40
  assert bytes(cut.tokens[cut.starts[1]:cut.starts[2]].tolist()) == (
      b"U: " + b"x" * 10 + b"\nA: " + b"y" * 24)
  dropped = chat.tokenize([short, long, late], tokenizer, 40, "t", overlong="drop")
  assert (len(dropped), dropped.truncated, dropped.dropped) == (1, 0, 2)
  with pytest.raises(ConfigError, match="all 1 conversations of t are longer than "
                                        "data.seq_len=8"):
    chat.tokenize([long], tokenizer, 8, "t", overlong="drop")


def test_loss_weights_on_the_assistant_or_on_everything():
  tokenizer = _tokenizer()
  conversation = chat.Conversation(MESSAGES + [{"role": "user", "content": "Bye"},
                                               {"role": "assistant", "content": "Ciao"}], "c")
  docs = chat.tokenize([conversation], tokenizer, 128, "t")
  document = docs.document(0)
  text = bytes(docs.tokens.tolist())
  assert text == b"S: Be brief.\nU: Hi\nA: Hello!\nU: Bye\nA: Ciao\n"
  np.testing.assert_array_equal(document["inputs"], docs.tokens[:-1])
  np.testing.assert_array_equal(document["targets"], docs.tokens[1:])
  trained = bytes(document["targets"][document["loss_weights"] == 1].tolist())
  assert trained == b"Hello!\nCiao\n"
  assert document["loss_weights"].dtype == np.float32
  everything = chat.tokenize([conversation], tokenizer, 128, "t", train_on="all").document(0)
  assert everything["loss_weights"].all()


def test_the_synthetic_tasks_hold_out_unseen_instructions():
  for name in instruct.TASKS:
    train = {m[0]["content"] for m in instruct.conversations(name, "train")}
    held_out = instruct.conversations(name, "held_out")
    assert len(held_out) == instruct.HELD_OUT
    assert not train & {m[0]["content"] for m in held_out}
  prompt, answer = instruct.prompt_and_answer(instruct.conversations("reverse", "held_out")[0])
  assert prompt[0]["content"] == "reverse " + answer[::-1]


def _host(batch) -> dict[str, np.ndarray]:
  return {key: np.asarray(value) for key, value in jax.device_get(batch).items()}


ONE_DEVICE = jax.devices()[:1]  # the CPU variants' mesh


@pytest.fixture(scope="module")
def tiny_setup():
  return training.build(sft.get_config("tiny"), ONE_DEVICE)


def test_batches_resume_exactly_and_equal_random_access(tiny_setup):
  """Batch s from a Grain iterator restored at a saved position equals the uninterrupted
  iterator's batch s and random access's; the weights fall on the answers only."""
  batches = tiny_setup.batches
  config = sft.get_config("tiny")
  assert {k: (v.shape, v.dtype) for k, v in batches.abstract().items()} == {
      k: ((16, config.data.seq_len), np.dtype(np.float32 if k == "loss_weights" else np.int32))
      for k in ("inputs", "targets", "loss_weights")}
  iterator = batches.iterator(0)
  straight = [_host(next(iterator)) for _ in range(2)]
  position = iterator.position()
  straight += [_host(next(iterator)) for _ in range(2)]
  iterator.close()
  resumed = batches.iterator(2, position)
  for step in (2, 3):
    got = _host(next(resumed))
    for key, want in straight[step].items():
      np.testing.assert_array_equal(got[key], want, err_msg=f"{key} at step {step}")
      np.testing.assert_array_equal(_host(batches.batch(step))[key], want)
  resumed.close()
  first = straight[0]
  weighted = first["targets"][first["loss_weights"] > 0]
  assert set(weighted.tolist()) <= set(b"abcdefghijklmnopqrstuvwxyz\n")
  assert (first["loss_weights"].sum(axis=1) > 0).all()
  assert config.data.path == "synthetic:repeat:256"
  assert "256 training conversations" in batches.describe()


@pytest.mark.smoke
def test_the_tiny_variant_trains(tmp_path):
  config = sft.get_config("tiny")
  result = training.run(config, str(tmp_path), devices=ONE_DEVICE)
  assert result.final_step == config.train.steps
  assert np.isfinite(list(result.train_losses.values())).all()
  assert set(result.eval_losses) == {0, config.train.steps}


def test_config_mistakes_are_one_error():
  for field, value, message in [("train_on", "user", "data.train_on='user'; use one of "
                                                     "assistant, all"),
                                ("overlong", "wrap", "data.overlong='wrap'; use one of "
                                                     "truncate, drop"),
                                ("path", "", "data.source='chat' needs data.path")]:
    config = sft.get_config("tiny")
    config.data[field] = value
    with pytest.raises(ConfigError, match=message):
      training.build(config, ONE_DEVICE)
