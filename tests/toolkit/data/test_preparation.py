"""toolkit/data/preparation.py and scripts/data/prepare_text.py: text and JSONL -> shards that
decode back to the documents."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from toolkit.data import preparation, shards
from toolkit.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOKENIZER = os.path.join(REPO, "tests", "fixtures", "tokenizer.json")
DOCUMENTS = ["Hello wörld — ünïcode 😀\n\ttabs and\r\nCRLF", "a", "def f(x):\n    return x\n",
             "Ω" * 300, "the last one."]


def _inputs(tmp_path):
  (tmp_path / "one.txt").write_text(DOCUMENTS[0], encoding="utf-8", newline="")
  with open(tmp_path / "rest.jsonl", "w", encoding="utf-8") as f:
    for text in DOCUMENTS[1:]:
      f.write(json.dumps({"text": text, "id": 1}) + "\n\n")
  return [str(tmp_path / "one.txt"), str(tmp_path / "rest.jsonl")]


def _documents(directory: str, tokenizer: shards.Tokenizer) -> list[str]:
  """Every document of both splits, decoded, split at the end-of-document id."""
  texts = []
  for split in ("train", "val"):
    stream = shards.TokenStream(directory, split)
    tokens = stream.read(0, len(stream))
    assert tokens[-1] == tokenizer.eot_id
    ends = np.flatnonzero(tokens == tokenizer.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    texts += [tokenizer.decode(tokens[a:b]) for a, b in zip(starts, ends)]
  return texts


@pytest.mark.parametrize("tokenizer_path", ["bytes", TOKENIZER])
def test_round_trip(tmp_path, tokenizer_path):
  tokenizer = shards.Tokenizer(tokenizer_path)
  out = str(tmp_path / "out")
  meta = preparation.prepare(_inputs(tmp_path), out, tokenizer, val_fraction=0.3,
                              shard_tokens=64, log=lambda _: None)
  assert len(meta["splits"]["train"]) > 2  # small shards: documents span files
  assert meta["dtype"] == "uint16"
  # Each document's last 30 % (of its characters, rounded) is held out; "a" keeps no tail.
  heads = [d[:len(d) - round(0.3 * len(d))] for d in DOCUMENTS]
  tails = [d[len(d) - round(0.3 * len(d)):] for d in DOCUMENTS]
  assert tails[1] == "" and tails[3] == "Ω" * 90
  assert sorted(_documents(out, tokenizer)) == sorted(p for p in heads + tails if p)
  if tokenizer_path == "bytes":
    assert (meta["vocab_size"], meta["eot_id"]) == (257, 256)
    assert shards.Tokenizer().decode(shards.Tokenizer().encode(DOCUMENTS[0])) == DOCUMENTS[0]
  else:  # the shipped fixture: a 400-token byte-level BPE with <|endoftext|> = 0
    assert (meta["vocab_size"], meta["eot_id"]) == (400, 0)
    assert len(tokenizer.encode(DOCUMENTS[2])) < len(DOCUMENTS[2].encode())


def test_one_file_gives_both_splits_with_the_fraction_of_its_tokens(tmp_path):
  """The README's one-book case: byte tokens, so val holds 5 % of the text's bytes (+1 for
  its end-of-document token) and train the rest."""
  text = "It was the best of times, it was the worst of times. " * 400  # 21,200 bytes
  (tmp_path / "book.txt").write_text(text)
  meta = preparation.prepare([str(tmp_path / "book.txt")], str(tmp_path / "out"),
                              shards.Tokenizer(), val_fraction=0.05, shard_tokens=10**6,
                              log=lambda _: None)
  counts = {split: sum(e["tokens"] for e in entries) for split, entries in meta["splits"].items()}
  assert counts == {"train": 20_140 + 1, "val": 1_060 + 1}


def test_bad_inputs(tmp_path):
  tokenizer = shards.Tokenizer()
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "no text"}\n')
  with pytest.raises(ConfigError, match=r"bad.jsonl line 2 has no string field 'text'"):
    preparation.prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "o"), tokenizer, 0.1, 100)
  (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
  with pytest.raises(ConfigError, match=r"latin1.txt is not UTF-8"):
    preparation.prepare([str(tmp_path / "latin1.txt")], str(tmp_path / "o"), tokenizer, 0.1, 100)
  # Each of these once ended in a traceback or wrote a dataset of one end-of-document token.
  (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
  with pytest.raises(ConfigError, match=r"latin1.jsonl line 2 is not UTF-8 \(invalid "
                                        r"continuation byte at byte 13\); save the file"):
    preparation.prepare([str(tmp_path / "latin1.jsonl")], str(tmp_path / "o"), tokenizer, 0.1,
                         100)
  (tmp_path / "surrogate.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
  with pytest.raises(ConfigError, match=r"surrogate.jsonl line 2: field 'text' is not valid "
                                        r"UTF-8 text \(lone surrogate U\+D800 at character 1"):
    preparation.prepare([str(tmp_path / "surrogate.jsonl")], str(tmp_path / "o"), tokenizer,
                         0.1, 100)
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "blank.jsonl").write_text("\n\n")
  for empty in ("empty.txt", "blank.jsonl"):
    with pytest.raises(ConfigError, match=r"hold no text.*give files with text in them"):
      preparation.prepare([str(tmp_path / empty)], str(tmp_path / "o"), tokenizer, 0.1, 100)
  assert not (tmp_path / "o").exists()  # nothing written for refused inputs
  (tmp_path / "texts").mkdir()  # once "does not exist"
  with pytest.raises(ConfigError, match=r"input .*texts is a folder; give the text or \.jsonl "
                                        r"files in it, e\.g\. .*texts/\*\.txt"):
    preparation.prepare([str(tmp_path / "texts")], str(tmp_path / "o"), tokenizer, 0.1, 100)
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(ConfigError, match=r"--out='.*a_file' is a file; give a folder"):
    preparation.prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "a_file"), tokenizer, 0.1,
                         100)
  with pytest.raises(ConfigError, match=r"is not a valid tokenizer.json"):
    shards.Tokenizer(str(tmp_path / "latin1.txt"))
  with pytest.raises(ConfigError, match=r"no end-of-document token <eot>"):
    shards.Tokenizer(TOKENIZER, eot_token="<eot>")


def test_command_line(tmp_path):
  inputs = _inputs(tmp_path)
  run = lambda *args: subprocess.run([sys.executable, "scripts/data/prepare_text.py", *args], cwd=REPO,
                                     capture_output=True, text=True, timeout=120)
  proc = run(f"--out={tmp_path / 'out'}", "--val_fraction=0.2", *inputs)
  assert proc.returncode == 0, proc.stderr
  assert "9/9 document parts (train and val parts of 5 documents)" in proc.stdout
  assert "wrote" in proc.stdout
  assert os.path.isfile(tmp_path / "out" / "meta.json")
  proc = run(f"--out={tmp_path / 'o2'}", str(tmp_path / "missing.txt"))
  assert proc.returncode == 1
  assert proc.stderr.strip() == f"error: input {tmp_path / 'missing.txt'} does not exist; give " \
                                "text or .jsonl files"
  proc = run(f"--out={inputs[0]}", *inputs)  # --out an existing file
  assert proc.returncode == 1
  assert proc.stderr.strip() == f"error: --out={inputs[0]!r} is a file; give a folder (created " \
                                "if missing)"


def test_one_document_at_the_largest_val_fraction_still_trains(tmp_path):
  """The held-out tail never takes a whole document: at --val_fraction's upper bound (0.5) one
  short document still leaves its head to train on (the document split once left train
  empty)."""
  text = "the only document"  # 17 characters: 9 train, 8 held out (round(8.5) = 8)
  (tmp_path / "one.txt").write_text(text)
  meta = preparation.prepare([str(tmp_path / "one.txt")], str(tmp_path / "o"),
                              shards.Tokenizer(), 0.5, 100, log=lambda _: None)
  assert sum(e["tokens"] for e in meta["splits"]["train"]) == 9 + 1  # + end-of-document
  assert sum(e["tokens"] for e in meta["splits"]["val"]) == 8 + 1
