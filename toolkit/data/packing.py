"""Packing documents into rows: several whole documents per training row, each attending only
within itself (models/attention.py), through Grain's first-fit packer.

A document is an example of three 1-D arrays of one length n <= seq_len:
  inputs        int32: the tokens the model reads
  targets       int32: the next token of each
  loss_weights  float32: each target's weight in the loss (1 trains on it; 0 on the prompt
                tokens of supervised fine-tuning)
(`lm_document` makes one from plain tokens.) `pack` fills rows of seq_len with them, each row:
  inputs, targets   (seq_len,) int32: the row's documents one after another, then 0 (padding)
  segment_ids       (seq_len,) int32: which document of the row, 1, 2, ...; 0 on padding
  positions         (seq_len,) int32: each token's position in its own document, from 0
  loss_weights      (seq_len,) float32: the documents' weights, 0 on padding
Each document brings its own (input, target) pairs, so no target crosses a document boundary
and padding carries no weight. Efficiency = real tokens / row tokens (`PackingStats`).

Why Grain's packer (`grain.experimental.FirstFitPackIterDataset`, grain 0.2.18): it emits
exactly this (`<feature>_segment_ids` and `<feature>_positions` per packed feature, padding 0),
and its iterator state (the documents' iterator at the packed batch being handed out, and the
rows of it already handed out) restores exactly, so a resumed run reads the same rows. First
fit: each document goes to the first of `bins` rows with room for it; when one fits none, all
`bins` rows are emitted (in an order shuffled by the seed) and the next `bins` start with it.
More bins fill rows better; the default is one global batch. One document per row
(`documents_per_row=1`, Grain's `max_sequences_per_bin`) is the unpacked layout: padding only,
and the rows then carry no segment ids or positions (the model's plain causal path).

`DocumentBatches` is the batches class of such data (the interface of `grain_batches.
GrainBatches`): documents in the seed's order (Grain's `MapDataset.shuffle`, reshuffled every
epoch), packed, then cut into global batches of `global_batch_size` rows. Every process runs
the same global packing and keeps its own rows (`feed.local_rows`), so batch s holds the same
rows whatever the process count. The packing runs in the loop's process (Grain's packer is
stateful: worker processes would each pack their own share, and the rows would change with
their count), Grain's read threads load the documents, and a thread prepares `prefetch`
batches ahead. The position saved after each batch holds the pipeline's Grain state; without
one (a checkpoint of an unpacked run) the iterator replays the batches from step 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import sharding
from toolkit.data.feed import Batch, BatchIterator, Position, local_rows
from toolkit.data.grain_batches import order_seed
from toolkit.errors import ConfigError

DOCUMENT_KEYS = ("inputs", "targets", "loss_weights")
ROW_DTYPES = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
              "positions": np.int32, "loss_weights": np.float32}
# Documents packed at start-up to measure the efficiency the log reports (at most one epoch).
STATS_DOCUMENTS = 4096


def lm_document(tokens: np.ndarray, loss_weights: np.ndarray | None = None) -> dict:
  """The document of tokens t0..tn: inputs t0..tn-1, targets t1..tn, weights 1 (or
  `loss_weights`, one per target)."""
  tokens = np.asarray(tokens, np.int32)
  weights = (np.ones(tokens.size - 1, np.float32) if loss_weights is None
             else np.asarray(loss_weights, np.float32))
  return {"inputs": tokens[:-1], "targets": tokens[1:], "loss_weights": weights}


class _ToRow(grain.transforms.Map):
  """Grain's packed element -> a row with this module's keys."""

  def map(self, element: dict) -> dict:
    return {"inputs": element["inputs"], "targets": element["targets"],
            "segment_ids": element["inputs_segment_ids"],
            "positions": element["inputs_positions"], "loss_weights": element["loss_weights"]}


def pack(documents: grain.IterDataset, seq_len: int, bins: int, seed: int,
         documents_per_row: int | None = None) -> grain.IterDataset:
  """Rows (module docstring) of `documents`, first fit over `bins` rows at once; at most
  `documents_per_row` in a row (None: as many as fit). A document longer than seq_len is a
  ValueError from Grain: cut or drop such documents before."""
  packed = grain.experimental.FirstFitPackIterDataset(
      documents, length_struct={key: seq_len for key in DOCUMENT_KEYS}, num_packing_bins=bins,
      seed=seed, shuffle_bins=True, max_sequences_per_bin=documents_per_row)
  return packed.map(_ToRow())


@dataclasses.dataclass(frozen=True)
class PackingStats:
  """What packing made of some documents: how many, in how many rows of seq_len tokens."""
  documents: int
  rows: int
  real_tokens: int
  seq_len: int

  @property
  def efficiency(self) -> float:
    """Real tokens / row tokens: the share of the rows the documents fill."""
    return self.real_tokens / max(self.rows * self.seq_len, 1)

  @classmethod
  def of(cls, segment_ids: np.ndarray) -> "PackingStats":
    """From rows' segment ids (rows, seq_len): a row holds max(segment id) documents."""
    return cls(documents=int(segment_ids.max(axis=1).sum()), rows=int(segment_ids.shape[0]),
               real_tokens=int((segment_ids > 0).sum()), seq_len=int(segment_ids.shape[1]))

  def line(self, packed: bool = True) -> str:
    """The start-up log's line."""
    what = "packing" if packed else "one document per row"
    return (f"{what}: {self.documents} documents in {self.rows} rows, efficiency "
            f"{100 * self.efficiency:.1f}% (real tokens / row tokens)")


class DocumentBatches:
  """Training and eval batches of packed documents (module docstring). `train_source` and
  `held_out_source` are Grain data sources (len, getitem) of documents; the held-out ones are
  packed in order, the first `eval_batches` batches (fewer if they run out; the last padded
  with empty rows) kept for every evaluation. `bins`: rows packed at once (0: one global
  batch); `documents_per_row` 1 for the unpacked layout."""

  def __init__(self, train_source, held_out_source, seq_len: int, seed: int,
               global_batch_size: int, mesh: Mesh, rules: sharding.Rules, eval_batches: int,
               prefetch: int = 2, bins: int = 0, documents_per_row: int | None = None):
    self.train_source, self.held_out_source = train_source, held_out_source
    self.seq_len, self.seed, self.global_batch_size = seq_len, seed, global_batch_size
    self.prefetch, self.documents_per_row = prefetch, documents_per_row
    self.bins = bins or global_batch_size
    self.keys = (tuple(ROW_DTYPES) if documents_per_row != 1
                 else ("inputs", "targets", "loss_weights"))
    self.shape = (global_batch_size, seq_len)
    self.sharding = NamedSharding(mesh, rules.activation_spec(("batch", None), mesh))
    self.rows = local_rows(self.sharding, self.shape)
    if len(train_source) < 1 or len(held_out_source) < 1:
      empty = train_source if len(train_source) < 1 else held_out_source
      raise ConfigError(f"{empty!r} holds no documents; give more data")
    self._eval = self._eval_rows(eval_batches)
    self.eval_batches = len(self._eval)
    self._stats: PackingStats | None = None

  def __repr__(self) -> str:  # saved with each position: a state restores only into its match
    return (f"DocumentBatches({self.train_source!r}, seq_len={self.seq_len}, seed={self.seed}, "
            f"batch={self.global_batch_size}, bins={self.bins}, "
            f"per_row={self.documents_per_row})")

  def _packed(self, documents: grain.MapDataset) -> grain.IterDataset:
    rows = pack(documents.to_iter_dataset(grain.ReadOptions(num_threads=2,
                                                            prefetch_buffer_size=64)),
                self.seq_len, self.bins, order_seed(self.seed, 3), self.documents_per_row)
    return rows.batch(self.global_batch_size, drop_remainder=False)

  def _train_pipeline(self) -> grain.DatasetIterator:
    documents = grain.MapDataset.source(self.train_source).shuffle(
        seed=order_seed(self.seed, 0)).repeat()
    return iter(self._packed(documents))

  def _eval_rows(self, count: int) -> list[dict[str, np.ndarray]]:
    """This process's rows of the first `count` held-out batches, the last padded."""
    with contextlib.closing(iter(self._packed(grain.MapDataset.source(
        self.held_out_source)))) as pipeline:
      return [self._local(self._padded(element))
              for element in itertools.islice(pipeline, count)]

  def _padded(self, element: dict) -> dict[str, np.ndarray]:
    """A batch of fewer rows (the held-out documents ran out) with empty rows added."""
    missing = self.global_batch_size - element["inputs"].shape[0]
    return {key: np.pad(element[key], ((0, missing), (0, 0))) if missing else element[key]
            for key in ROW_DTYPES}

  def _local(self, element: dict) -> dict[str, np.ndarray]:
    return {key: np.ascontiguousarray(element[key][self.rows], ROW_DTYPES[key])
            for key in ROW_DTYPES}

  def _place(self, rows: dict[str, np.ndarray]) -> Batch:
    make = lambda key: jax.make_array_from_process_local_data(self.sharding, rows[key],
                                                              self.shape)
    with jax.transfer_guard_host_to_device("allow"):  # deliberate, as in text.Batches
      return {key: make(key) for key in self.keys}

  def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
    return {key: jax.ShapeDtypeStruct(self.shape, ROW_DTYPES[key], sharding=self.sharding)
            for key in self.keys}

  def iterator(self, start_step: int, position: Position | None = None,
               prefetch: int | None = None) -> BatchIterator:
    """Batches from `start_step` on, restored from a checkpoint's `position` when it holds
    this pipeline's state (else replayed from step 0); `prefetch` batches prepared ahead in a
    thread (default: the constructor's)."""
    pipeline = self._train_pipeline()
    saved = (position or {}).get("packed")
    if saved and saved.get("pipeline") == repr(self):
      pipeline.set_state(json.loads(saved["state"]))
    else:
      for _ in range(start_step):
        next(pipeline)
    steps = iter(range(start_step, 2**62))

    def produce():
      step, element = next(steps), next(pipeline)
      state = {"pipeline": repr(self), "state": json.dumps(pipeline.get_state(), default=int)}
      return step, self._local(element), {"step": step + 1, "packed": state}
    return BatchIterator(produce, self._place, start_step,
                         self.prefetch if prefetch is None else prefetch,
                         release=getattr(pipeline, "close", None))

  def batch(self, step: int) -> Batch:
    """Training batch `step`, by packing from the start (benchmarks take step 0)."""
    with contextlib.closing(self._train_pipeline()) as pipeline:
      for _ in range(step):
        next(pipeline)
      return self._place(self._local(next(pipeline)))

  def eval_batch(self, index: int) -> Batch:
    """Held-out batch `index`: the same rows at every evaluation."""
    return self._place(self._eval[index])

  def stats(self) -> PackingStats:
    """The packing of the first STATS_DOCUMENTS training documents (at most one epoch), in the
    training order, measured once."""
    if self._stats is None:
      documents = grain.MapDataset.source(self.train_source).shuffle(
          seed=order_seed(self.seed, 0))
      documents = documents[:min(len(documents), STATS_DOCUMENTS)]
      with contextlib.closing(iter(self._packed(documents))) as pipeline:
        segments = [element["segment_ids"] for element in pipeline]
      self._stats = PackingStats.of(np.concatenate(segments))
    return self._stats

  def describe(self) -> str:
    """The start-up log's line: "packing: N documents in M rows, efficiency X% (...)"."""
    return self.stats().line(packed=self.documents_per_row != 1)
