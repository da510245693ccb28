"""The next-token loss over the vocabulary, in one pass over full logits or in chunks that
never hold the full (tokens, vocab) float32 logits or their gradient.

  next_token_loss(model, inputs, targets) -> (mean cross-entropy, mean logsumexp^2)
  next_token_objective(model, inputs, targets) -> (cross-entropy + model.cfg.z_loss x the
      other + the model's auxiliary loss (a mixture of experts' router losses), its metrics)

both float32 nats. With per-token `weights` (batch, length) float32 (packed documents: 0 on
padding, and for supervised fine-tuning on the tokens not trained on) each mean is weighted:
sum(weights x per-token value) / sum(weights), the z-loss term weighted like the cross-entropy
(a weight of 0 drops the token from both). The router's auxiliary loss stays the mean over
every position routed, padding included: padding takes expert slots like any token.

With `model.cfg.loss_chunk` > 0 the final features (batch, length, embed) are split into
chunks of positions holding about `loss_chunk` tokens per device ((rows per device) x
positions). A chunk takes every n-th position (positions c, c + n, ...), so a length
split over devices (context parallelism) still gives every device its share of each chunk.

Differentiated, the chunked objective computes its gradient in the forward pass, chunk by
chunk: the loss is the last thing the step computes, so the only cotangent it will ever get is
one scalar, and scaling gradients computed for a cotangent of 1 is exact. Each chunk's logits
become their softmax gradient at once and fold into the features' gradient (kept per chunk)
and the output matrix's (accumulated in float32). No logits are saved or computed twice: the
three output-layer matmuls of the full-logits path, no more, and peak memory holds one chunk.
Not differentiated (eval), only the losses are computed.

Sharded (the path XLA partitions: TPU, and CPU where the vocabulary-parallel one does not
apply), the output matrix is gathered into its compute layout once, before the chunks, and its
gradient kept as one float32 partial sum per batch shard, reduced once after them: left to
the partitioner, every chunk gathered the matrix and reduce-scattered its gradient (46 GiB per
device and step on the 1b on v5p-32, docs/compile.md).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import sharding

# A chunk's tokens are flattened to one (rows x positions) dimension, batch-major: matmuls of
# (tokens, embed) x (embed, vocab) run faster on XLA's CPU backend than with batch and
# positions kept apart (models.linear.dense), and it shards like the batch.
_LOGITS_AXES = ("batch", "vocab")


def weight_total(weights: jax.Array) -> jax.Array:
  """sum(weights), what a weighted mean divides by; 1 where it is 0 (a batch of padding only
  then has loss 0, not 0 / 0)."""
  total = jnp.sum(weights, dtype=jnp.float32)
  return jnp.where(total > 0, total, 1.0)


def full_logits_loss(logits: jax.Array, targets: jax.Array,
                     weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(mean cross-entropy, mean logsumexp^2) from float32 logits (batch, length, vocab),
  weighted by `weights` (batch, length) when given (module docstring)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  lse = jax.nn.logsumexp(logits, axis=-1)
  if weights is None:
    return jnp.mean(ce), jnp.mean(lse * lse)
  total = weight_total(weights)
  return jnp.sum(ce * weights) / total, jnp.sum(lse * lse * weights) / total


def chunk_positions(loss_chunk: int, rows: int, length: int) -> int:
  """Positions per chunk: `loss_chunk` tokens per device over its `rows` rows (at least one
  position, at most the whole length)."""
  return max(1, min(length, loss_chunk // max(rows, 1)))


def _strided(x, count: int, chunk: int):
  """(batch, count * chunk, ...) -> (count, batch, chunk, ...); position i * count + c goes to
  chunk c, row i of it."""
  return jnp.moveaxis(x.reshape(x.shape[0], chunk, count, *x.shape[2:]), 2, 0)


def _chunks(features, targets, chunk: int, weights=None):
  """Strided chunks of the features, targets and weights (the given per-token weights, else
  1; 0 on the positions padded to whole chunks), each
  chunk's (rows, positions) flattened: (count, tokens, embed) and (count, tokens). With the
  positions split over devices (context parallelism) rows and positions stay apart, (count,
  batch, chunk, ...): XLA partitions their merge by gathering the positions."""
  batch, length = targets.shape
  count = -(-length // chunk)
  pad = ((0, 0), (0, count * chunk - length))
  if weights is None:
    weights = jnp.ones((batch, length), jnp.float32)
  weights = jnp.pad(weights.astype(jnp.float32), pad)
  flat = lambda x: x.reshape(count, batch * chunk, *x.shape[3:])
  if sharding.active_ways("length") > 1:
    flat = lambda x: x
  return (flat(_strided(jnp.pad(features, pad + ((0, 0),)), count, chunk)),
          flat(_strided(jnp.pad(targets, pad), count, chunk)),
          flat(_strided(weights, count, chunk)))


def _unchunk(x, batch: int, length: int):
  """Inverse of `_chunks` for (count, tokens, embed) -> (batch, length, embed)."""
  x = jnp.moveaxis(x.reshape(x.shape[0], batch, -1, x.shape[-1]), 0, 2)
  return x.reshape(batch, -1, x.shape[-1])[:, :length]


def _chunk_losses(f, t, w, matrix, letters: str):
  """One chunk, flattened: f (tokens, embed), t and w (tokens,). Its logits, logsumexp, and
  weighted cross-entropy and logsumexp^2 sums."""
  axes = _LOGITS_AXES if f.ndim == 2 else ("batch", "length", "vocab")
  logits = sharding.constrain(jnp.einsum(f"...e,{letters}->...v", f, matrix,
                                         preferred_element_type=jnp.float32), axes)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
  return logits, lse, ((lse - target_logit) * w).sum(), (lse * lse * w).sum()


def chunked_losses(features, matrix, targets, letters: str, chunk: int, weights=None):
  """(mean cross-entropy, mean logsumexp^2) over chunks of `chunk` positions; features
  (batch, length, embed), matrix and letters as `Llama.unembedding` gives them; weighted by
  `weights` (batch, length) when given. For metrics: differentiate `chunked_objective`."""
  matrix = _compute_layout(matrix, letters)

  def one(sums, xs):
    _, _, ce, z = _chunk_losses(*xs, matrix, letters)
    return (sums[0] + ce, sums[1] + z), None

  zero = jnp.zeros((), jnp.float32)
  (ce, z), _ = jax.lax.scan(one, (zero, zero), _chunks(features, targets, chunk, weights))
  if weights is None:
    return ce / targets.size, z / targets.size
  total = weight_total(weights)
  return ce / total, z / total


def chunked_objective(features, matrix, targets, letters: str, chunk: int, z_loss: float,
                      weights=None):
  """mean cross-entropy + z_loss x mean logsumexp^2, over chunks (module docstring), weighted
  by `weights` (batch, length) when given."""
  return _chunked_objective(features, matrix, targets, weights, letters, chunk, z_loss)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_objective(features, matrix, targets, weights, letters: str, chunk: int,
                       z_loss: float):
  ce, z = chunked_losses(features, matrix, targets, letters, chunk, weights)
  return ce + z_loss * z


def _logits_grad(logits, lse, targets, weights, z_loss: float):
  """d/dlogits of weights x (cross-entropy + z_loss x lse^2), per token: zero where the weight
  is (padding). `targets` index the last axis of these logits (a slice of the vocabulary may
  hold none of a row's target)."""
  probs = jnp.exp(logits - lse[..., None])
  hot = jnp.arange(logits.shape[-1]) == targets[..., None]
  return (probs * (1.0 + 2.0 * z_loss * lse)[..., None] - hot) * weights[..., None]


def _objective_and_grads(features, matrix, targets, weights, letters, chunk, z_loss):
  """The objective and its gradients for a cotangent of 1, chunk by chunk."""
  if (split := vocab_parallel_axes(matrix.shape[letters.index("v")], letters)):
    return _vocab_parallel_objective_and_grads(features, matrix, targets, weights, letters,
                                               chunk, z_loss, split)
  scale = 1.0 / targets.size if weights is None else 1.0 / weight_total(weights)
  matrix = _compute_layout(matrix, letters)
  xs = _chunks(features, targets, chunk, weights)
  # One partial sum of the matrix's gradient per batch shard (the leading axis, split like the
  # batch), reduced once after the loop: a chunk's tokens are split over the batch axes, and
  # a gradient laid out as stored would be reduce-scattered in every chunk.
  shards = sharding.active_ways("batch") if xs[0].ndim == 3 else 1
  partial_axes = ("batch",) + _matrix_axes(letters)

  def one(carry, xs):
    ce_sum, z_sum, d_matrix = carry
    f, t, w = xs
    logits, lse, ce, z = _chunk_losses(f, t, w, matrix, letters)
    d_logits = _logits_grad(logits, lse, t, w * scale, z_loss)
    axes = _LOGITS_AXES if f.ndim == 2 else ("batch", "length", "vocab")
    d_logits = sharding.constrain(d_logits.astype(matrix.dtype), axes)
    d_features = jnp.einsum(f"...v,{letters}->...e", d_logits, matrix,
                            preferred_element_type=jnp.float32).astype(features.dtype)
    if shards > 1:
      per_shard = lambda x: x.reshape(shards, -1, x.shape[-1])
      d_matrix = sharding.constrain(d_matrix + jnp.einsum(
          f"stv,ste->s{letters}", per_shard(d_logits), per_shard(f),
          preferred_element_type=jnp.float32), partial_axes)
    else:
      d_matrix = d_matrix + jnp.einsum(f"...v,...e->{letters}", d_logits, f,
                                       preferred_element_type=jnp.float32)
    return (ce_sum + ce, z_sum + z, d_matrix), d_features

  zero = jnp.zeros((), jnp.float32)
  d_matrix = jnp.zeros(((shards,) if shards > 1 else ()) + matrix.shape, jnp.float32)
  if shards > 1:
    d_matrix = sharding.constrain(d_matrix, partial_axes)
  (ce, z, d_matrix), d_features = jax.lax.scan(one, (zero, zero, d_matrix), xs)
  if shards > 1:
    d_matrix = d_matrix.sum(axis=0)
  objective = (ce + z_loss * z) * scale
  return objective, (_unchunk(d_features, *targets.shape), d_matrix.astype(matrix.dtype))


def _matrix_axes(letters: str) -> tuple[str, str]:
  return tuple("vocab" if c == "v" else "embed" for c in letters)


def _compute_layout(matrix, letters: str):
  """The output matrix as the activation rules lay it out (the vocabulary split over the
  tensor axes, the embedding whole): gathered once before the loop over chunks, where XLA's
  partitioner, left alone, gathers it from its stored layout in every chunk."""
  return sharding.constrain(matrix, _matrix_axes(letters))


def vocab_parallel_axes(vocab: int, letters: str) -> tuple[str, ...]:
  """The mesh axes the vocabulary-parallel loss splits the output matrix's vocabulary over:
  the batch's axes, then the vocabulary's own (tensor). () when it does not apply: no mesh, the
  batch whole, the positions split, a vocabulary they do not divide, a matrix stored split
  over other mesh axes (then its gradient could not return to its storage layout by an
  all-to-all: XLA replicates it, e.g. with a data or expert axis), or a mesh not of CPU
  devices (measured faster on CPU, docs/benchmarks.md; the TPU memory figures in
  docs/compile.md were measured with XLA's partitioning of the plain path and stay so)."""
  active = sharding.rules.active()
  if active is None:
    return ()
  rules, mesh = active
  if (mesh.devices.flat[0].platform != "cpu" or sharding.active_ways("length") > 1
      or sharding.active_ways("batch") == 1):
    return ()
  batch_axes = sharding.active_axes("batch")
  split = batch_axes + tuple(a for a in sharding.active_axes("vocab") if a not in batch_axes)
  stored = rules.param_spec(tuple("embed" if c == "e" else "vocab" for c in letters), mesh)
  stored_axes = [a for entry in stored if entry
                 for a in ((entry,) if isinstance(entry, str) else entry)]
  live = lambda axes: {a for a in axes if mesh.shape[a] > 1}
  if live(split) != live(stored_axes) or vocab % math.prod(mesh.shape[a] for a in split):
    return ()
  return split


def _vocab_parallel_objective_and_grads(features, matrix, targets, weights, letters, chunk,
                                        z_loss, split):
  """`_objective_and_grads` with the output matrix split over its vocabulary across the
  `split` axes (the batch's first): each device gathers a chunk's features from the batch's
  devices (tokens x embed, small), computes the logits of its vocabulary slice for all of
  them, and exchanges only each token's softmax statistics. The matrix's gradient stays on its
  device (no all-reduce of a vocab x embed array) and the features' gradient is summed and
  scattered back to the devices of its rows."""
  mesh = sharding.active_mesh()
  batch_axes = sharding.active_axes("batch")
  extra = tuple(a for a in split if a not in batch_axes)
  vocab_dim = letters.index("v")
  matrix_spec = P(*(split if d == vocab_dim else None for d in range(2)))
  rows = P(None, batch_axes)
  # 1 / the tokens (or the weights' sum): a constant, or with weights an argument of its own
  # (replicated), as shard_map's body takes traced values only as arguments.
  scales = () if weights is None else (1.0 / weight_total(weights),)

  def local(f, t, w, m, *weighted):
    scale = weighted[0] if weighted else 1.0 / targets.size
    local_vocab = m.shape[vocab_dim]
    offset = jax.lax.axis_index(split) * local_vocab
    gather = lambda x: jax.lax.all_gather(x, batch_axes, axis=0, tiled=True)

    def one(carry, xs):
      ce_sum, z_sum, d_m = carry
      f, t, w = xs
      f_all, t_all, w_all = gather(f), gather(t) - offset, gather(w)
      logits = jnp.einsum(f"te,{letters}->tv", f_all, m, preferred_element_type=jnp.float32)
      top = jax.lax.pmax(jnp.max(logits, axis=-1), split)
      lse = top + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1),
                                       split))
      mine = (t_all >= 0) & (t_all < local_vocab)
      picked = jnp.take_along_axis(logits, jnp.clip(t_all, 0, local_vocab - 1)[:, None],
                                   axis=-1)[:, 0]
      target_logit = jax.lax.psum(jnp.where(mine, picked, 0.0), split)
      d_logits = _logits_grad(logits, lse, t_all, w_all * scale, z_loss).astype(m.dtype)
      d_f = jnp.einsum(f"tv,{letters}->te", d_logits, m, preferred_element_type=jnp.float32)
      if extra:
        d_f = jax.lax.psum(d_f, extra)
      d_f = jax.lax.psum_scatter(d_f, batch_axes, scatter_dimension=0, tiled=True)
      d_m = d_m + jnp.einsum(f"tv,te->{letters}", d_logits, f_all,
                             preferred_element_type=jnp.float32)
      return (ce_sum + ((lse - target_logit) * w_all).sum(), z_sum + (lse * lse * w_all).sum(),
              d_m), d_f.astype(f.dtype)

    zero = jnp.zeros((), jnp.float32)
    (ce, z, d_m), d_f = jax.lax.scan(one, (zero, zero, jnp.zeros(m.shape, jnp.float32)),
                                     (f, t, w))
    return ce, z, d_m, d_f

  f, t, w = _chunks(features, targets, chunk, weights)
  ce, z, d_matrix, d_features = jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(None, batch_axes, None), rows, rows, matrix_spec) + (P(),) * len(scales),
      out_specs=(P(), P(), matrix_spec, P(None, batch_axes, None)), check_vma=False)(
          f, t, w, matrix, *scales)
  scale = scales[0] if scales else 1.0 / targets.size
  objective = (ce + z_loss * z) * scale
  return objective, (_unchunk(d_features, *targets.shape), d_matrix.astype(matrix.dtype))


def _objective_fwd(features, matrix, targets, weights, letters, chunk, z_loss):
  return _objective_and_grads(features, matrix, targets, weights, letters, chunk, z_loss)


def _objective_bwd(letters, chunk, z_loss, grads, cotangent):
  del letters, chunk, z_loss
  d_features, d_matrix = grads
  return (d_features * cotangent).astype(d_features.dtype), \
      (d_matrix * cotangent).astype(d_matrix.dtype), None, None  # targets, weights: data


_chunked_objective.defvjp(_objective_fwd, _objective_bwd)


def split_chunk_positions(loss_chunk: int, rows: int, length: int, ways: int) -> int:
  """`chunk_positions` with the positions split `ways` ways (context parallelism): a device
  holds 1/ways of each chunk's positions, and they must split evenly, so the chunk is a
  multiple of `ways` that divides the length (no padding)."""
  if ways == 1:
    return chunk_positions(loss_chunk, rows, length)
  wanted = max(chunk_positions(loss_chunk * ways, rows, length), ways)
  return max(c for c in range(ways, length + 1, ways) if length % c == 0 and c <= wanted)


def _chunk_of(model, targets, differentiated: bool = False) -> int:
  """Positions per chunk: about `loss_chunk` tokens per device, or in all when the
  differentiated objective runs vocabulary-parallel (a device then holds the logits of every
  row's chunk for its slice of the vocabulary)."""
  rows = targets.shape[0] // sharding.active_ways("batch")
  letters = "ve" if model.cfg.tie_embeddings else "ev"
  if differentiated and vocab_parallel_axes(model.cfg.vocab_size, letters):
    rows = targets.shape[0]
  return split_chunk_positions(model.cfg.loss_chunk, rows, targets.shape[1],
                               sharding.active_ways("length"))


def next_token_loss(model, inputs: jax.Array, targets: jax.Array,
                    positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                    weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(mean cross-entropy, mean logsumexp^2) of `targets` given `inputs` (at `positions`,
  default 0..length-1; packed documents by `segment_ids`, `models.Llama`) under a Llama,
  weighted by `weights` when given (module docstring): chunked when model.cfg.loss_chunk > 0,
  else over full logits. For metrics (eval)."""
  if not model.cfg.loss_chunk:
    return full_logits_loss(model(inputs, positions, segment_ids), targets, weights)
  matrix, letters = model.unembedding()
  return chunked_losses(model.features(inputs, positions, segment_ids), matrix, targets,
                        letters, _chunk_of(model, targets), weights)


def next_token_objective(model, inputs: jax.Array, targets: jax.Array,
                         positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None,
                         weights: jax.Array | None = None
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """What an LM trains on, and the model's metrics: mean cross-entropy + model.cfg.z_loss x
  mean logsumexp^2 (both weighted by `weights` when given) + the model's auxiliary loss (a
  mixture of experts' weighted router losses, `Llama.features_and_aux`; 0 for a dense model).
  `positions` and `segment_ids` as in `next_token_loss`."""
  z_loss = float(model.cfg.z_loss)
  if not model.cfg.loss_chunk:
    logits, aux_loss, metrics = model.logits_and_aux(inputs, positions, segment_ids)
    ce, z = full_logits_loss(logits, targets, weights)
    objective = ce + z_loss * z if z_loss else ce
  else:
    features, aux_loss, metrics = model.features_and_aux(inputs, positions, segment_ids)
    matrix, letters = model.unembedding()
    objective = chunked_objective(features, matrix, targets, letters,
                                  _chunk_of(model, targets, differentiated=True), z_loss,
                                  weights)
  return objective + aux_loss, metrics
