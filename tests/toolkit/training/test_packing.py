"""Training on rows packed with several documents (segment ids, per-document positions, loss
weights): the loss and its gradients equal the same documents run one per row, unpacked, for
each attention implementation, on one device, sharded and with the positions split, and with
micro-batches; one document's loss has exactly no gradient from another document's tokens;
the eval summary weighs batches by their weights; the packed step with splash attention
compiles for a TPU without a score array."""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from experiments import lm
from models import attention
from tests import extras
from tests.tiny_runs import TOLERANCE, assert_trees_close, tiny_config
from toolkit import training
from toolkit.data import shards
from toolkit.training import state as state_lib, step as step_lib

# Tokens per document, and the documents of each row of LENGTH (input, target) positions: a
from toolkit.training.objectives import tasks
# document of n tokens fills n - 1; the rest of a row is padding.
DOCUMENTS = (9, 14, 5, 20, 12, 7, 17, 11, 33)
ROWS = ((0, 1, 2), (3, 4), (5, 6, 7), (8,))
LENGTH = 32
PROMPT = (1, 6)  # document 1's first 6 targets weigh 0, as a prompt in fine-tuning does
Z_LOSS = 1e-2


def _documents():
  """(tokens, per-target weights) of each document."""
  rng = np.random.default_rng(0)
  tokens = [rng.integers(1, 256, n).astype(np.int32) for n in DOCUMENTS]
  weights = [np.ones(n - 1, np.float32) for n in DOCUMENTS]
  weights[PROMPT[0]][:PROMPT[1]] = 0.0
  return tokens, weights


def packed_batch(tokens, weights, rows=ROWS) -> dict[str, np.ndarray]:
  """The documents packed as `rows` say, in the LM batch's keys (toolkit/training/step.py);
  padding as Grain's packer leaves it: every key 0."""
  batch = {key: np.zeros((len(rows), LENGTH), dtype)
           for key, dtype in (("inputs", np.int32), ("targets", np.int32),
                              ("segment_ids", np.int32), ("positions", np.int32),
                              ("loss_weights", np.float32))}
  for r, row in enumerate(rows):
    start = 0
    for segment, d in enumerate(row, 1):
      n = len(tokens[d]) - 1
      place = slice(start, start + n)
      batch["inputs"][r, place], batch["targets"][r, place] = tokens[d][:-1], tokens[d][1:]
      batch["segment_ids"][r, place], batch["positions"][r, place] = segment, np.arange(n)
      batch["loss_weights"][r, place] = weights[d]
      start += n
  return batch


def _config(implementation="xla", ici="fsdp:1", preset="fsdp", loss_chunk=0,
            pipeline_microbatches=0):
  config = tiny_config(preset, ici)
  config.model.update(attention=implementation, loss_chunk=loss_chunk, z_loss=Z_LOSS,
                      pipeline_microbatches=pipeline_microbatches)
  config.data.update(seq_len=LENGTH, global_batch_size=len(ROWS))
  return config


@pytest.fixture(scope="module")
def reference():
  """The documents one per row, unpacked (right-padded to LENGTH, which causal attention keeps
  from every real token), on one device: sum over them of sum(weights x (cross-entropy +
  z_loss x logsumexp^2)) / sum(weights), from the model's logits and optax; its value and
  gradients, and the host parameters."""
  setup = training.build(_config(), jax.devices()[:1])
  params = jax.device_get(state_lib.create(setup.spec.model, setup.optimizer, setup.layout,
                                           0)["params"])
  tokens, weights = _documents()
  rows = np.zeros((len(tokens), LENGTH + 1), np.int32)
  row_weights = np.zeros((len(tokens), LENGTH), np.float32)
  for r, (doc, w) in enumerate(zip(tokens, weights)):
    rows[r, :doc.size], row_weights[r, :w.size] = doc, w
  graphdef = setup.layout.graphdef

  def loss(params):
    logits = nnx.merge(graphdef, params)(jnp.asarray(rows[:, :-1]))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:])
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(row_weights * (ce + Z_LOSS * lse * lse)) / row_weights.sum()

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return params, float(value), jax.device_get(grads)


def _packed_loss_and_grads(config, params, microbatches=1, devices=None):
  """batch loss and gradients of the packed documents through `loss_and_grads` on the
  config's mesh, the parameters and the batch placed as a run places them."""
  setup = training.build(config, devices)
  mesh, rules, graphdef = setup.spec.mesh, setup.spec.rules, setup.layout.graphdef
  params = jax.device_put(params, setup.layout.shardings["params"])
  rows = NamedSharding(mesh, rules.activation_spec(("batch", None), mesh))
  batch = {k: jax.device_put(v, rows) for k, v in packed_batch(*_documents()).items()}

  @jax.jit
  def run(params, batch):
    with sharding.activation_rules(rules, mesh):
      return step_lib.loss_and_grads(lambda p, b: step_lib.lm_loss(graphdef, p, b), params,
                                     batch, microbatches)

  (loss, _), grads = jax.device_get(run(params, batch))
  return float(loss), grads


# (attention, mesh, preset, loss_chunk, micro-batches): one device; fsdp 4 x tensor 2 (the
# chunked loss there: vocabulary-parallel with weights); the positions split 4 and 2 ways; a
# pipeline of 2 stages on 2 devices (2 pipeline micro-batches: the segment ids travel with
# their rows). The default suite runs the first (micro-batches) and blockwise with the
# positions split (the per-device skips, the balanced order); the rest ~5-9 s each.
_SLOW = pytest.mark.slow
CASES = [
    ("xla", "fsdp:1", "fsdp", 0, 2),
    pytest.param("blockwise", "fsdp:1", "fsdp", 0, 1, marks=_SLOW),
    pytest.param("xla", "fsdp:4,tensor:2", "fsdp_tp", 64, 1, marks=_SLOW),
    pytest.param("blockwise", "fsdp:4,tensor:2", "fsdp_tp", 0, 1, marks=_SLOW),
    pytest.param("xla", "fsdp:2,sequence:4", "fsdp_cp", 0, 1, marks=_SLOW),
    ("blockwise", "fsdp:2,sequence:4", "fsdp_cp", 0, 1),
    pytest.param("ring", "fsdp:2,sequence:2,tensor:2", "fsdp_tp", 64, 1, marks=_SLOW),
    pytest.param("xla", "stage:2", "fsdp_pp", 0, 1, marks=_SLOW),
]


@pytest.mark.parametrize("implementation,ici,preset,loss_chunk,microbatches", CASES,
                         ids=lambda c: str(c))
def test_packed_loss_and_gradients_equal_documents_one_per_row(
    reference, implementation, ici, preset, loss_chunk, microbatches, monkeypatch):
  """Blocks of 8 for blockwise (several per document, the rest skipped); two micro-batches
  (rows 0, 2 and 1, 3: unequal weights) normalized by the whole batch's weights."""
  monkeypatch.setattr(attention, "BLOCK", 8)
  params, expected_loss, expected_grads = reference
  stages = "stage" in ici
  config = _config(implementation, ici, preset, loss_chunk, 2 if stages else 0)
  devices = jax.devices()[:2] if stages else jax.devices()[:1] if ici == "fsdp:1" else None
  loss, grads = _packed_loss_and_grads(config, params, microbatches, devices)
  np.testing.assert_allclose(loss, expected_loss, **TOLERANCE)
  assert_trees_close(grads, expected_grads, **TOLERANCE)


@pytest.mark.parametrize("implementation", [
    "xla", pytest.param("blockwise", marks=pytest.mark.slow)])  # ~7-10 s each
def test_no_gradient_crosses_documents(reference, implementation, monkeypatch):
  """The loss of row 0's last document only: its gradient with respect to the embeddings of
  the tokens of the documents before it in the row is exactly 0.0 (their ids appear nowhere
  else in the row); without segment ids (the documents run into each other) it is not."""
  monkeypatch.setattr(attention, "BLOCK", 8)
  params = reference[0]
  config = _config(implementation)
  setup = training.build(config, jax.devices()[:1])
  graphdef = setup.layout.graphdef
  earlier, last = np.arange(1, 128), np.arange(128, 256)
  rng = np.random.default_rng(1)
  tokens = [rng.choice(earlier, 9), rng.choice(earlier, 14), rng.choice(last, 5)]
  weights = [np.zeros(8, np.float32), np.zeros(13, np.float32), np.ones(4, np.float32)]
  row = packed_batch(tokens, weights, rows=((0, 1, 2),))

  @jax.jit
  def embedding_grads(params, batch):
    return jax.grad(lambda p: step_lib.lm_loss(graphdef, p, batch)[0])(params)["embed"]

  grads = np.asarray(jax.device_get(embedding_grads(params, row)))
  seen_earlier = np.unique(row["inputs"][row["segment_ids"] < 3])
  seen_earlier = seen_earlier[seen_earlier > 0]  # 0: padding's id
  assert (grads[seen_earlier] == 0.0).all()
  assert np.abs(grads[np.unique(tokens[2][:-1])]).max() > 0  # its own tokens do get one
  unpacked = {k: v for k, v in row.items() if k not in ("segment_ids", "positions")}
  leaked = np.asarray(jax.device_get(embedding_grads(params, unpacked)))
  assert np.abs(leaked[seen_earlier]).max() > 0


def test_eval_summary_weighs_batches_by_their_weights():
  """Two eval batches, one of 3 weighted tokens and one of 1: their losses weigh 3 : 1."""
  results = [{"loss": np.float32(2.0), "weight": np.float32(3.0)},
             {"loss": np.float32(6.0), "weight": np.float32(1.0)}]
  assert tasks.lm_summary(results)["loss"] == pytest.approx(3.0)
  assert tasks.lm_summary([{"loss": 2.0}, {"loss": 6.0}])["loss"] == pytest.approx(4.0)


@pytest.mark.slow  # ~50 s on 2 busy cores; tests/models/test_segments.py's is its short form
@pytest.mark.tpu_aot
def test_packed_splash_step_compiles_for_a_tpu_without_a_score_tensor(tmp_path):
  """The CPU LM on packed token shards at 512 tokens, compiled for a v5p-8: attention auto
  is splash with the rows' segment ids, the compiled step calls the kernel (a Mosaic custom
  call) and holds no (512 queries, 512 keys) array (tests/toolkit/planning/test_compile.py's check
  for the unpacked step)."""
  extras.require("libtpu")
  from toolkit.planning import aot, target as target_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  text = lambda: "".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(1, 700))))
  tokenizer = shards.Tokenizer("bytes")
  folder = str(tmp_path / "shards")
  os.makedirs(folder)
  shards.write_meta(folder, tokenizer, {
      split: shards.write_split(folder, split, [text() for _ in range(count)], tokenizer, 10**6)
      for split, count in (("train", 64), ("val", 16))})
  config = lm.get_config("cpu,data=tokens")
  config.model.vocab_size = 384
  config.data.update(path=folder, packing=True, seq_len=512)
  hlo = tmp_path / "step.hlo"
  report = aot.compile_report(config, target_lib.target_for("v5p-8"), hlo_path=str(hlo))
  assert report.verdict == "fits" and report.run["attention"] == "splash"
  text = hlo.read_text()
  assert "tpu_custom_call" in text
  assert not re.search(r"\[(\d+,)+512,512\]", text)
