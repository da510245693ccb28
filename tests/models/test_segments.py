"""Packed documents at the attention level (segment ids, models/attention.py): every
implementation against each document run alone through the XLA reference, on one device,
sharded and with the positions split; the blockwise loops skip the block pairs no document
shares; cuDNN's arguments; splash's segment ids in interpret mode and compiled for a TPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import sharding
from models import attention, blockwise
from sharding import sequence
from tests import extras
from tests.models.test_attention import _assert_same, _inputs, _value_and_grads

# Documents per row, as lengths; what is left of the row is padding (segment 0).
ROWS = [(20, 30, 10), (7, 33, 24), (64,), (5, 5, 40)]
LENGTH = 64
_SCORES = blockwise.scores  # the blockwise loops' score function, before any test wraps it


def _segments(rows=ROWS, length=LENGTH):
  """(segment ids, positions) (len(rows), length) int32 of rows packed as `rows` say."""
  ids = np.zeros((len(rows), length), np.int32)
  positions = np.zeros((len(rows), length), np.int32)
  for r, lengths in enumerate(rows):
    start = 0
    for segment, n in enumerate(lengths, 1):
      ids[r, start:start + n] = segment
      positions[r, start:start + n] = np.arange(n)
      start += n
    positions[r, start:] = np.arange(length - start)  # padding: a run of its own
  return jnp.asarray(ids), jnp.asarray(positions)


def _runs(ids_row: np.ndarray):
  """(start, end) of each run of equal segment ids in one row."""
  cut = np.flatnonzero(np.diff(ids_row)) + 1
  edges = np.concatenate([[0], cut, [ids_row.size]])
  return list(zip(edges[:-1], edges[1:]))


def _per_document(segment_ids, causal: bool):
  """Each row's documents (and its padding) attended alone with the XLA reference, the outputs
  put back in place: what packed attention must equal."""
  ids = np.asarray(segment_ids)

  def reference(q, k, v):
    rows = []
    for r in range(ids.shape[0]):
      pieces = [attention.xla(q[r:r + 1, s:e], k[r:r + 1, s:e], v[r:r + 1, s:e], causal)
                for s, e in _runs(ids[r])]
      rows.append(jnp.concatenate(pieces, axis=1))
    return jnp.concatenate(rows, axis=0)
  return reference


# (implementation, mesh, preset): one device, fsdp 4 x tensor 2, the positions split 4 ways.
# The default suite runs ring (its only packed case there) and blockwise with the positions
# split; tests/toolkit/training/test_packing.py runs xla and blockwise through the model.
_SLOW = pytest.mark.slow  # ~2-3 s each; the model-level tests cover these layouts
CASES = [
    pytest.param("xla", None, None, marks=_SLOW),
    pytest.param("blockwise", None, None, marks=_SLOW),
    pytest.param("xla", [("fsdp", 4), ("tensor", 2)], "fsdp_tp", marks=_SLOW),
    pytest.param("blockwise", [("fsdp", 4), ("tensor", 2)], "fsdp_tp", marks=_SLOW),
    pytest.param("xla", [("fsdp", 2), ("sequence", 4)], "fsdp_cp", marks=_SLOW),
    ("blockwise", [("fsdp", 2), ("sequence", 4)], "fsdp_cp"),
    ("ring", [("fsdp", 2), ("sequence", 4)], "fsdp_cp"),
]


@pytest.fixture(scope="module")
def packed_inputs():
  q, k, v, weights = _inputs(len(ROWS), LENGTH, LENGTH, 4, 2, 8, seed=5)
  ids, positions = _segments()
  expected = _value_and_grads(_per_document(ids, True), q, k, v, weights)
  return (q, k, v, weights), (ids, positions), expected


@pytest.mark.parametrize("implementation,ici,preset", CASES,
                         ids=lambda c: c if isinstance(c, str) or c is None else
                         "x".join(f"{a}{n}" for a, n in c))
def test_packed_attention_equals_each_document_alone(packed_inputs, implementation, ici, preset,
                                                     monkeypatch):
  """Causal, grouped-query heads, documents of 5 to 64 tokens and padding; output and dq, dk,
  dv. Blocks of 8: blockwise runs several blocks per document and skips the rest."""
  monkeypatch.setattr(attention, "BLOCK", 8)
  (q, k, v, weights), (ids, positions), expected = packed_inputs
  if ici is None:
    fn = lambda q, k, v: attention.attend(q, k, v, True, implementation, positions, ids)
    _assert_same(_value_and_grads(fn, q, k, v, weights), expected)
    return
  mesh = sharding.make_mesh(ici)
  rules = sharding.Rules.preset(preset)
  ways = mesh.shape.get("sequence", 1)
  order = lambda x: sequence.balance(x, ways)
  place = lambda x, axes: jax.device_put(order(x), NamedSharding(
      mesh, rules.activation_spec(axes, mesh)))
  placed = [place(q, ("batch", "length", "heads", None)),
            place(k, ("batch", "length", "kv_heads", None)),
            place(v, ("batch", "length", "kv_heads", None)),
            place(weights, ("batch", "length", "heads", None))]
  tokens = [place(x, ("batch", "length")) for x in (positions, ids)]

  def split(q, k, v):
    with sharding.activation_rules(rules, mesh):
      return attention.attend(q, k, v, True, implementation, *tokens)

  out, grads = _value_and_grads(split, *placed)
  back = lambda x: sequence.unbalance(x, ways)
  _assert_same((back(out), tuple(back(g) for g in grads)), expected)


def _count_score_blocks(monkeypatch, segment_ids, backward: bool = True):
  """(forward, backward) block pairs whose scores the blockwise loops computed, counted as
  they run (a callback inside the computed branch), causal, blocks of 8 over 64 tokens;
  backward None unless asked for."""
  calls = {"count": 0}

  def counted(q_block, k_block):
    jax.debug.callback(lambda: calls.__setitem__("count", calls["count"] + 1))
    return _SCORES(q_block, k_block)

  monkeypatch.setattr(blockwise, "scores", counted)
  q, k, v, weights = _inputs(2, LENGTH, LENGTH, 2, 2, 8, seed=6)
  pair = None if segment_ids is None else (segment_ids, segment_ids)
  fn = lambda q, k, v: attention.blockwise(q, k, v, True, 8, segment_ids=pair)
  jax.block_until_ready(jax.jit(fn)(q, k, v))
  jax.effects_barrier()  # every callback has run
  forward = calls["count"]
  if not backward:
    return forward, None
  jax.block_until_ready(jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights),
                                         argnums=(0, 1, 2)))(q, k, v))
  jax.effects_barrier()
  return forward, calls["count"] - 2 * forward  # the gradient reruns the forward pass


def test_blockwise_skips_block_pairs_that_share_no_document(monkeypatch):
  """8 blocks of 8: causally 36 (query block, key block) pairs. Four documents of 16 tokens,
  two blocks each, share 3 pairs apiece: 12 are computed, forward and backward; the other 24
  are skipped, not masked."""
  ids = jnp.asarray(np.repeat(np.arange(1, 5), 16)[None].repeat(2, axis=0), jnp.int32)
  assert _count_score_blocks(monkeypatch, ids) == (12, 12)
  assert _count_score_blocks(monkeypatch, None, backward=False) == (36, None)  # causal alone


def test_cudnn_hands_the_library_the_segment_mask(monkeypatch):
  """No GPU here: the call jax.nn.dot_product_attention receives (implementation cudnn,
  causal, the same-segment mask), replayed with the XLA implementation, equals each document
  attended alone."""
  received = []
  library = jax.nn.dot_product_attention

  def spy(*args, **kwargs):
    received.append(dict(kwargs))
    return library(*args, **{**kwargs, "implementation": "xla"})

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  q, k, v, _ = _inputs(len(ROWS), LENGTH, LENGTH, 4, 2, 8, seed=7)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  ids, _ = _segments()
  out = jax.jit(lambda q, k, v: attention.attend(q, k, v, True, "cudnn", segment_ids=ids))(
      q, k, v)
  assert received[0]["implementation"] == "cudnn" and received[0]["is_causal"]
  assert received[0]["mask"].shape == (len(ROWS), 1, LENGTH, LENGTH)
  expected = jax.jit(_per_document(ids, True))(q, k, v)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                             atol=2e-2)  # bfloat16, cuDNN's input dtype


@pytest.mark.slow  # ~11 s on 2 busy cores: the interpreter runs the kernel's every block
def test_splash_in_interpret_mode_with_segment_ids():
  """The Pallas kernel's own SegmentIds, interpreted on CPU: 256 tokens in two 128-blocks, a
  document across the block boundary and padding."""
  rows = [(100, 60, 90), (256,)]
  q, k, v, weights = _inputs(2, 256, 256, 4, 2, 32, seed=8)
  ids, _ = _segments(rows, 256)
  expected = _value_and_grads(_per_document(ids, True), q, k, v, weights)
  actual = _value_and_grads(lambda q, k, v: attention.attend(q, k, v, True, "splash",
                                                             segment_ids=ids),
                            q, k, v, weights)
  _assert_same(actual, expected)


@pytest.mark.tpu_aot
def test_splash_with_segment_ids_compiles_for_a_tpu_without_a_score_tensor():
  """Forward and backward of splash with segment ids lowered for a v5e-8's compile-only
  devices (fsdp 8): the kernel is called (Mosaic) and no (512 queries, 512 keys) array
  exists; the step's own test is tests/toolkit/training/test_packing.py's."""
  extras.require("libtpu")
  from toolkit.planning import target as target_lib  # pylint: disable=g-import-not-at-top
  target_lib.prepare_libtpu_environment()
  mesh = sharding.make_mesh([("fsdp", 8)], devices=target_lib.target_for("v5litepod-8").devices)
  rules = sharding.Rules.preset("fsdp")
  spec = lambda shape, axes, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, rules.activation_spec(axes, mesh)))
  q = spec((8, 512, 4, 128), ("batch", "length", "heads", None))
  kv = spec((8, 512, 2, 128), ("batch", "length", "kv_heads", None))
  ids = spec((8, 512), ("batch", "length"), jnp.int32)

  def loss(q, k, v, ids):
    with sharding.activation_rules(rules, mesh):
      return jnp.sum(attention.attend(q, k, v, True, "splash", segment_ids=ids)
                     .astype(jnp.float32))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, ids).compile().as_text()
  assert "tpu_custom_call" in text
  assert not re.search(r"\[(\d+,)+512,512\]", text)
