"""Packing documents into rows (toolkit/data/packing.py) and token shards' documents
(shards.TokenDocuments): rows hold every document exactly once, in order, positions restarting,
no weight on padding; the efficiency line; exact resume of the packed pipeline from a saved
position; `data.packing` in a run and in the config check."""
from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from experiments import lm
from toolkit import training
from toolkit.data import packing, shards
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib, loop

SEQ_LEN = 32


def _documents(count=200, seed=0):
  rng = np.random.default_rng(seed)
  return [packing.lm_document(rng.integers(1, 250, int(n)), rng.random(int(n) - 1) > 0.3)
          for n in rng.integers(2, SEQ_LEN + 2, count)]


def _segments_of(row: dict) -> list[dict]:
  """A packed row back into its documents, checking the layout on the way: segments 1..k
  one after another, then only padding, positions 0..n-1 within each."""
  ids = row["segment_ids"]
  count = int(ids.max())
  assert list(np.unique(ids[ids > 0])) == list(range(1, count + 1))
  real = int((ids > 0).sum())
  assert (ids[:real] > 0).all() and (ids[real:] == 0).all()
  assert (np.diff(ids[:real]) >= 0).all()
  for key in ("inputs", "targets", "positions", "loss_weights"):
    assert (row[key][real:] == 0).all(), key  # padding: nothing, and no weight
  found = []
  for segment in range(1, count + 1):
    where = ids == segment
    np.testing.assert_array_equal(row["positions"][where], np.arange(where.sum()))
    found.append({key: row[key][where] for key in packing.DOCUMENT_KEYS})
  return found


def test_rows_hold_every_document_once_in_order():
  documents = _documents()
  rows = list(packing.pack(grain.MapDataset.source(documents).to_iter_dataset(), SEQ_LEN,
                           bins=8, seed=0))
  found = [d for row in rows for d in _segments_of(row)]
  key = lambda d: (tuple(d["inputs"]), tuple(d["targets"]), tuple(d["loss_weights"]))
  assert sorted(map(key, found)) == sorted(map(key, documents))
  stats = packing.PackingStats.of(np.stack([r["segment_ids"] for r in rows]))
  real = sum(d["inputs"].size for d in documents)
  assert (stats.documents, stats.rows, stats.real_tokens) == (len(documents), len(rows), real)
  assert stats.efficiency == real / (len(rows) * SEQ_LEN) > 0.8
  assert stats.line() == (f"packing: {len(documents)} documents in {len(rows)} rows, "
                          f"efficiency {100 * stats.efficiency:.1f}% (real tokens / row tokens)")
  one_each = list(packing.pack(grain.MapDataset.source(documents).to_iter_dataset(), SEQ_LEN,
                               bins=8, seed=0, documents_per_row=1))
  assert len(one_each) == len(documents)
  assert all(r["segment_ids"].max() == 1 for r in one_each)


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> str:
  """Byte-level shards of 300 documents of 0 to 80 bytes (some longer than SEQ_LEN) in
  train shards of 2,000 tokens, and 40 held out."""
  rng = np.random.default_rng(0)
  text = lambda: "".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(0, 80))))
  folder = str(tmp_path_factory.mktemp("tokens"))
  tokenizer = shards.Tokenizer("bytes")
  splits = {"train": shards.write_split(folder, "train", [text() for _ in range(300)],
                                        tokenizer, 2000),
            "val": shards.write_split(folder, "val", [text() for _ in range(40)], tokenizer,
                                      2000)}
  shards.write_meta(folder, tokenizer, splits)
  return folder


def test_token_documents_make_every_token_a_target_once(token_dir):
  """Documents end at the end-of-document id; each piece reads the token before it; a
  document longer than SEQ_LEN comes in pieces of at most SEQ_LEN targets."""
  stream = shards.TokenStream(token_dir, "train")
  documents = shards.TokenDocuments(stream, SEQ_LEN)
  everything = stream.read(0, len(stream))
  targets = np.concatenate([documents[i]["targets"] for i in range(len(documents))])
  np.testing.assert_array_equal(targets, everything)
  inputs = np.concatenate([documents[i]["inputs"] for i in range(len(documents))])
  np.testing.assert_array_equal(inputs, np.concatenate([[shards.BYTE_EOT], everything[:-1]]))
  assert documents.documents == 300 < len(documents)  # some came in two or three pieces
  assert max(documents[i]["inputs"].size for i in range(len(documents))) == SEQ_LEN
  ends = [i for i in range(len(documents)) if documents[i]["targets"][-1] == shards.BYTE_EOT]
  assert len(ends) == 300


def _config(token_dir: str, **data):
  config = lm.get_config("tiny,data=tokens")
  config.model.vocab_size = 384
  config.data.update(path=token_dir, packing=True, seq_len=SEQ_LEN, global_batch_size=8,
                     eval_batches=2, **data)
  config.train.update(steps=4, log_every=1, eval_every=4, checkpoint_every=4)
  return config


def test_packed_pipeline_resumes_exactly_from_a_saved_position(token_dir):
  """Batches 3..5 from a position saved after batch 2 (through JSON, as a checkpoint keeps
  it), and replayed without one, equal the straight iterator's; the batch carries the packed
  keys and the efficiency line reads as documented."""
  batches = training.build(_config(token_dir)).batches
  assert isinstance(batches, packing.DocumentBatches)
  host = lambda batch: {k: np.asarray(v) for k, v in batch.items()}
  straight = batches.iterator(0)
  first = [host(next(straight)) for _ in range(3)]
  position = json.loads(json.dumps(straight.position()))
  later = [host(next(straight)) for _ in range(3)]
  straight.close()
  assert set(first[0]) == set(packing.ROW_DTYPES)
  for start in (position, None):
    resumed = batches.iterator(3, start)
    again = [host(next(resumed)) for _ in range(3)]
    resumed.close()
    for a, b in zip(again, later):
      for key in a:
        np.testing.assert_array_equal(a[key], b[key])
  for key in first[0]:
    np.testing.assert_array_equal(host(batches.batch(1))[key], first[1][key])
  assert batches.describe().startswith("packing: ")
  assert batches.stats().efficiency > 0.8


def test_the_start_up_log_reports_the_packing_efficiency(token_dir, capsys):
  config = _config(token_dir)
  setup = training.build(config)
  loop.log_setup(config, setup)
  line = next(text for text in capsys.readouterr().out.splitlines()
              if text.startswith("packing: "))
  stats = setup.batches.stats()
  assert line == (f"packing: {stats.documents} documents in {stats.rows} rows, efficiency "
                  f"{100 * stats.efficiency:.1f}% (real tokens / row tokens)")
  # At start-up: the first training documents of the epoch (all of them here), in order.
  assert stats.documents == len(setup.batches.train_source) and stats.rows >= 1


@pytest.mark.slow  # ~17 s on 2 busy cores: compiles the train and eval steps
def test_a_packed_run_trains_and_evaluates(token_dir, tmp_path):
  result = training.run(_config(token_dir), str(tmp_path / "run"))
  losses = list(result.train_losses.values())
  assert len(losses) == 4 and np.isfinite(losses).all()
  assert np.isfinite(list(result.eval_losses.values())).all()


def test_packing_config_is_checked(token_dir):
  config = _config(token_dir)
  config.data.source, config.data.path = "stdlib_docs", ""
  with pytest.raises(ConfigError, match="data.packing=True packs the documents of data.source"):
    config_lib.resolve(config)
  with pytest.raises(ConfigError, match="set data.worker_count=0"):
    config_lib.resolve(_config(token_dir, worker_count=2))
  with pytest.raises(ConfigError, match=r"data.packing_bins=-1 must be an integer in \[0"):
    config_lib.resolve(_config(token_dir, packing_bins=-1))
