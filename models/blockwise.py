"""Flash-style attention in plain JAX (`models.attention`'s `blockwise`), and the block
helpers ring attention shares with it.

  blockwise(q, k, v, causal, block, positions=None, segment_ids=None)

An online softmax over key/value blocks of `block` keys for each block of `block` queries, and
a custom VJP that recomputes each block's scores in the backward pass: memory O(length x block)
instead of O(length^2). Shapes, scaling and grouped-query heads as in `models.attention`.

Which (query, key) pairs are seen:
  by index    (positions None) key j is seen by query i when j <= i (causal); the loops'
              bounds skip the blocks above the diagonal
  by position (positions = (query positions (batch, q_length), key positions (batch,
              kv_length)), context parallelism) key j when its position <= query i's
  segments    (segment_ids = (query segment ids, key segment ids), each (batch, length),
              packed documents) and only keys of the query's own segment
With positions or segment ids, a (query block, key block) pair in which no query sees any
key, in any row (no shared segment, or every key after every query), is skipped by
`jax.lax.cond`: its scores are never computed, forward or backward. Segment ids are per-device
data here: under a mesh `models.attention` runs this per device (`shard_map`), so each device
decides its own skips.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The name the kernels' outputs (and their softmax statistics) carry for remat policies: a
# policy that saves it never reruns attention in the backward pass.
CONTEXT = "context"
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf in the softmax


def prescaled(q):
  """q / sqrt(head_dim): scaling the queries costs length/head_dim times less than scaling the
  scores (XLA's CPU backend ran the xla implementation 1.2x faster so, forward and backward)."""
  return (q * q.shape[-1] ** -0.5).astype(q.dtype)


def varying_like(x, like):
  """`x` marked as varying over the mesh axes that `like` varies over inside `jax.shard_map`
  (its check of which values differ per device): a loop's carry that starts as a constant then
  matches what the loop computes from `like`. Outside shard_map, `x` itself."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  axes = tuple(sorted(varying(like) - varying(x)))
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def split_blocks(x, count: int, size: int):
  """(batch, length, ...) -> (count, batch, size, ...) with the length padded with zeros."""
  pad = count * size - x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(x.shape[0], count, size, *x.shape[2:]), 1, 0)


def merge_blocks(x, length: int):
  """Inverse of `split_blocks`: (count, batch, size, ...) -> (batch, length, ...)."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def scores(q_block, k_block):
  """(batch, bq, kv, group, d) x (batch, bk, kv, d) -> (batch, kv, group, bq, bk) float32."""
  return jnp.einsum("bqkgd,bskd->bkgqs", q_block, k_block, preferred_element_type=jnp.float32)


def _blocks(length: int, block: int) -> tuple[int, int]:
  """(block size, block count) for `length` positions: one block for short inputs."""
  size = min(block, length)
  return size, -(-length // size)


class _Masking(NamedTuple):
  """Query and key positions and segment ids split into blocks, (nq, batch, bq) and (nk,
  batch, bk); a pair is None where not given."""
  q_positions: jax.Array | None
  kv_positions: jax.Array | None
  q_segments: jax.Array | None
  kv_segments: jax.Array | None

  @property
  def by_index(self) -> bool:
    """Causality by index (no positions): the loops' bounds may skip the upper blocks."""
    return self.q_positions is None


def _masking(positions, segment_ids, nq: int, bq: int, nk: int, bk: int, q) -> _Masking | None:
  """Positions and segment ids split into blocks like q and k; None when neither is given
  (index order, one sequence per row).

  Tied to q by an optimization barrier: positions usually derive from constants only, and
  where the layers are scanned and rematerialized JAX's partial evaluation would compute every
  block's mask (and what the masks select) ahead of the loops and keep them all, stacked over
  the block pairs (an (nq, nk, ..., bq, bk) array: 3.4x the temporaries at 8192 positions)."""
  if positions is None and segment_ids is None:
    return None
  if segment_ids is None:  # as before segment ids existed: the same program
    _, positions = jax.lax.optimization_barrier((q, positions))
  else:
    _, (positions, segment_ids) = jax.lax.optimization_barrier((q, (positions, segment_ids)))
  split = lambda pair: ((None, None) if pair is None else
                        (split_blocks(pair[0], nq, bq), split_blocks(pair[1], nk, bk)))
  return _Masking(*split(positions), *split(segment_ids))


def _visible(i, j, bq: int, bk: int, kv_length: int, causal: bool, masking: _Masking | None):
  """Which keys of block j the queries of block i see: (bq, bk) by index, or with `masking`
  (batch, 1, 1, bq, bk)."""
  index = j * bk + jnp.arange(bk)[None, :]
  seen = index < kv_length
  if masking is None:
    return seen & (index <= i * bq + jnp.arange(bq)[:, None]) if causal else seen
  if masking.by_index:
    seen = (seen & (index <= i * bq + jnp.arange(bq)[:, None]) if causal else seen)[None]
  else:
    seen = seen[None]
    if causal:
      seen = seen & (masking.kv_positions[j][:, None, :] <= masking.q_positions[i][:, :, None])
  if masking.q_segments is not None:
    seen = seen & (masking.kv_segments[j][:, None, :] == masking.q_segments[i][:, :, None])
  rows = (masking.q_segments if masking.q_positions is None else masking.q_positions).shape[1]
  return jnp.broadcast_to(seen, (rows, bq, bk))[:, None, None]


def _unless_hidden(visible, compute, carry, masking: _Masking | None):
  """compute(carry), skipped when no query of the block sees a key of it: by index the loops'
  bounds skip such blocks already; with positions or segment ids this test does."""
  if masking is None:
    return compute(carry)
  return jax.lax.cond(visible.any(), compute, lambda c: c, carry)


def _kv_blocks_seen(i, bq: int, bk: int, nk: int, causal: bool):
  """Key blocks 0..n-1 hold every key that query block i sees (causal: up to its last row)."""
  return jnp.minimum(nk, ((i + 1) * bq - 1) // bk + 1) if causal else nk


def _forward(q, k, v, positions, segment_ids, causal: bool, block: int):
  """(out (batch, q_length, heads, d), logsumexp (nq, batch, kv, group, bq) float32)."""
  batch, q_length, heads, d = q.shape
  kv_length, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  bq, nq = _blocks(q_length, block)
  bk, nk = _blocks(kv_length, block)
  qs = split_blocks(prescaled(q).reshape(batch, q_length, kv_heads, group, d), nq, bq)
  ks, vs = split_blocks(k, nk, bk), split_blocks(v, nk, bk)
  masking = _masking(positions, segment_ids, nq, bq, nk, bk, q)

  def query_block(i):
    qi = qs[i]

    def key_block(j, carry):
      visible = _visible(i, j, bq, bk, kv_length, causal, masking)

      def update(carry):
        m, l, acc = carry
        s = jnp.where(visible, scores(qi, ks[j]), MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vs[j],
                        preferred_element_type=jnp.float32)
        return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv

      return _unless_hidden(visible, update, carry, masking)

    stats = (batch, kv_heads, group, bq)
    init = jax.tree.map(lambda x: varying_like(x, q), (
        jnp.full(stats, MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
        jnp.zeros(stats + (d,), jnp.float32)))
    by_index = masking is None or masking.by_index
    seen = _kv_blocks_seen(i, bq, bk, nk, causal) if by_index else nk
    m, l, acc = jax.lax.fori_loop(0, seen, key_block, init)
    out = (acc / l[..., None]).astype(q.dtype)            # (batch, kv, group, bq, d)
    return jnp.einsum("bkgqd->bqkgd", out), m + jnp.log(l)

  out, logsumexp = jax.lax.map(query_block, jnp.arange(nq))
  return merge_blocks(out, q_length).reshape(batch, q_length, heads, d), logsumexp


def _backward(q, k, v, positions, segment_ids, out, logsumexp, d_out, causal: bool,
              block: int):
  """dq, dk, dv: for each key block, the query blocks that see it, scores recomputed."""
  batch, q_length, heads, d = q.shape
  kv_length, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  scale = d ** -0.5
  bq, nq = _blocks(q_length, block)
  bk, nk = _blocks(kv_length, block)
  grouped = lambda x: x.reshape(batch, q_length, kv_heads, group, d)
  qs = split_blocks(prescaled(q).reshape(batch, q_length, kv_heads, group, d), nq, bq)
  dos = split_blocks(grouped(d_out), nq, bq)
  # Row sums of d_out * out: the softmax backward's correction, (nq, batch, kv, group, bq).
  delta = jnp.einsum("nbqkgd,nbqkgd->nbkgq", dos.astype(jnp.float32),
                     split_blocks(grouped(out), nq, bq).astype(jnp.float32))
  ks, vs = split_blocks(k, nk, bk), split_blocks(v, nk, bk)
  masking = _masking(positions, segment_ids, nq, bq, nk, bk, q)

  def key_block(j, dq):
    kj, vj = ks[j], vs[j]

    def query_block(i, carry):
      qi, doi = qs[i], dos[i]
      visible = _visible(i, j, bq, bk, kv_length, causal, masking)

      def update(carry):
        dq, dk, dv = carry
        s = jnp.where(visible, scores(qi, kj), MASK_VALUE)
        p = jnp.exp(s - logsumexp[i][..., None])                     # (b, kv, g, bq, bk)
        dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), doi,
                             preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[i][..., None])).astype(q.dtype)
        dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32)
        dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
        return dq.at[i].add(dqi * scale), dk, dv

      return _unless_hidden(visible, update, carry, masking)

    by_index = masking is None or masking.by_index
    first = (j * bk) // bq if causal and by_index else 0
    zeros = varying_like(jnp.zeros((batch, bk, kv_heads, d), jnp.float32), q)
    dq, dk, dv = jax.lax.fori_loop(first, nq, query_block, (dq, zeros, zeros))
    return dq, (dk, dv)

  dq = varying_like(jnp.zeros((nq, batch, bq, kv_heads, group, d), jnp.float32), q)
  dq, (dk, dv) = jax.lax.scan(lambda dq, j: key_block(j, dq), dq, jnp.arange(nk))
  dq = merge_blocks(dq, q_length).reshape(q.shape).astype(q.dtype)
  return dq, merge_blocks(dk, kv_length).astype(k.dtype), \
      merge_blocks(dv, kv_length).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _blockwise(q, k, v, positions, segment_ids, causal: bool, block: int):
  return _forward(q, k, v, positions, segment_ids, causal, block)[0]


def _blockwise_fwd(q, k, v, positions, segment_ids, causal, block):
  out, logsumexp = _forward(q, k, v, positions, segment_ids, causal, block)
  out, logsumexp = checkpoint_name(out, CONTEXT), checkpoint_name(logsumexp, CONTEXT)
  return out, (q, k, v, positions, segment_ids, out, logsumexp)


def _blockwise_bwd(causal, block, residuals, d_out):
  dq, dk, dv = _backward(*residuals, d_out, causal, block)
  return dq, dk, dv, None, None  # positions and segment ids: integers, no cotangent


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise(q, k, v, causal: bool, block: int, positions=None, segment_ids=None):
  """Flash-style attention (module docstring): `block` queries/keys per block; `positions`
  and `segment_ids` None or (query array (batch, q_length), key array (batch, kv_length))."""
  return _blockwise(q, k, v, positions, segment_ids, causal, block)
