"""Attention implementations behind one call, chosen by name (`LlamaConfig.attention`).

  attend(q, k, v, causal=True, implementation="auto") -> (batch, q_length, heads, head_dim)

q is (batch, q_length, heads, head_dim), k and v (batch, kv_length, kv_heads, head_dim) with
heads a multiple of kv_heads (grouped-query: query head h reads key/value head h // (heads //
kv_heads)); scores are scaled by 1/sqrt(head_dim); causal means key j is seen by query i when
j <= i (queries and keys both counted from position 0). The output has q's dtype.

  xla        `jax.nn.dot_product_attention` (XLA): materializes the (batch, heads, q, k) scores
  blockwise  flash-style attention in plain JAX on every backend: an online softmax over
             key/value blocks, blocks above the causal diagonal skipped, a custom VJP that
             recomputes each block; memory O(length x block) instead of O(length^2)
  splash     the Pallas TPU splash-attention kernel, per device under `shard_map` over the
             batch and head axes the activation rules split (off a TPU it runs in Pallas
             interpret mode: correct and slow, for tests); lengths must be multiples of 128
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")` on NVIDIA GPUs
  ring       ring attention: each device keeps its block of queries and the key/value blocks
             travel around the devices that split `length` (ppermute), an online softmax adds
             them up; memory per device linear in the length, and no device ever holds every
             key (on one device: plain attention)
  auto       `resolve`: splash on TPU from SPLASH_FROM keys, cudnn on GPU within its limits,
             else xla below BLOCKWISE_FROM keys and blockwise from there

Context parallelism. When the activation rules split `length` over devices (a `sequence` mesh
axis), the inputs come in `sharding.sequence`'s load-balanced order and attention masks by the
tokens' positions: xla and blockwise run per device on the device's queries against keys and
values gathered whole (`gathered`; auto picks between them as above), ring passes the blocks
around instead; splash and cudnn are refused there.

To add one: write `fn(q, k, v, causal) -> out` with the contract above, register it in
IMPLEMENTATIONS (and SPLIT_LENGTH if it takes `positions=`), and give `resolve` a case if `auto`
should pick it. The platform is the active mesh's (`sharding.active_mesh`), so compiling for a
TPU from a CPU host resolves as on the TPU.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import sharding

# The name the kernels' outputs (and their softmax statistics) carry for remat policies: a
# policy that saves it never reruns attention in the backward pass.
CONTEXT = "context"
# Below this many keys `auto` keeps the XLA implementation's scores, from it the blockwise loop
# (memory linear in the length). Timed on CPU (scripts/bench_attention.py: forward + backward,
# causal, 8 heads of 64, medians of 7 rounds), blockwise / xla: 0.98 at 256 keys, 1.68 at 512,
# 1.41 at 768, 0.68 at 1024, 0.41 at 2048, 0.37 at 4096: blockwise wins from 1024.
BLOCKWISE_FROM = 1024
# Compiled for v5p-8 (the CPU LM, head_dim 32, remat none, per device): splash 219 MiB vs xla
# 201 MiB at 256 tokens, 423 vs 516 MiB at 512. The kernel's residuals are laid out heads-major
# with head_dim padded to 128 lanes, which costs more than short sequences' scores.
SPLASH_FROM = 512
BLOCK = 512                 # blockwise: queries and keys per block (smaller for short inputs)
SPLASH_BLOCKS = (512, 256, 128)  # splash block sizes tried, largest first (128-lane tiles)
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf in the softmax


def platform() -> str:
  """The platform attention compiles for: the active mesh's devices, else JAX's default."""
  mesh = sharding.active_mesh()
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


# --- xla and cudnn ----------------------------------------------------------------------------

def _prescaled(q):
  """q / sqrt(head_dim): scaling the queries costs length/head_dim times less than scaling the
  scores (XLA's CPU backend ran the xla implementation 1.2x faster so, forward and backward)."""
  return (q * q.shape[-1] ** -0.5).astype(q.dtype)


def xla(q, k, v, causal: bool, positions=None):
  """`positions`: None (queries and keys counted from 0), or (query positions (batch,
  q_length), key positions (batch, kv_length)) for inputs in any order, masked by position."""
  if positions is None:
    return jax.nn.dot_product_attention(_prescaled(q), k, v, is_causal=causal, scale=1.0,
                                        implementation="xla")
  q_positions, kv_positions = positions
  mask = (kv_positions[:, None, None, :] <= q_positions[:, None, :, None]) if causal else None
  return jax.nn.dot_product_attention(_prescaled(q), k, v, mask=mask, scale=1.0,
                                      implementation="xla")


def cudnn(q, k, v, causal: bool):
  return jax.nn.dot_product_attention(_prescaled(q), k, v, is_causal=causal, scale=1.0,
                                      implementation="cudnn")


def cudnn_supports(q_shape, kv_shape, head_dim: int, dtype) -> bool:
  """cuDNN's fused attention limits (jax.nn.dot_product_attention): 16-bit inputs, head_dim
  a multiple of 8 up to 128 (256 from cuDNN 9.5 on Hopper; 128 is safe)."""
  del q_shape, kv_shape
  return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and \
      head_dim <= 128


# --- blockwise --------------------------------------------------------------------------------

def _blocks(length: int, block: int) -> tuple[int, int]:
  """(block size, block count) for `length` positions: one block for short inputs."""
  size = min(block, length)
  return size, -(-length // size)


def _visible(i, j, bq: int, bk: int, kv_length: int, causal: bool, positions=None):
  """Which keys of block j the queries of block i see: (bq, bk) by index, or with `positions`
  (query and key positions split into blocks, (nq, batch, bq) and (nk, batch, bk)) by
  position, (batch, 1, 1, bq, bk)."""
  index = j * bk + jnp.arange(bk)[None, :]
  seen = index < kv_length
  if positions is None:
    return seen & (index <= i * bq + jnp.arange(bq)[:, None]) if causal else seen
  q_positions, kv_positions = positions
  seen = seen[None]
  if causal:
    seen = seen & (kv_positions[j][:, None, :] <= q_positions[i][:, :, None])
  return jnp.broadcast_to(seen, (q_positions.shape[1], bq, bk))[:, None, None]


def _varying_like(x, like):
  """`x` marked as varying over the mesh axes that `like` varies over inside `jax.shard_map`
  (its check of which values differ per device): a loop's carry that starts as a constant then
  matches what the loop computes from `like`. Outside shard_map, `x` itself."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  axes = tuple(sorted(varying(like) - varying(x)))
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def _unless_hidden(visible, compute, carry, positions):
  """compute(carry), skipped when no query of the block sees a key of it: by index the loops'
  bounds skip such blocks already, by position (any order) this test does."""
  if positions is None:
    return compute(carry)
  return jax.lax.cond(visible.any(), compute, lambda c: c, carry)


def _kv_blocks_seen(i, bq: int, bk: int, nk: int, causal: bool):
  """Key blocks 0..n-1 hold every key that query block i sees (causal: up to its last row)."""
  return jnp.minimum(nk, ((i + 1) * bq - 1) // bk + 1) if causal else nk


def _split(x, count: int, size: int):
  """(batch, length, ...) -> (count, batch, size, ...) with the length padded with zeros."""
  pad = count * size - x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(x.shape[0], count, size, *x.shape[2:]), 1, 0)


def _merge(x, length: int):
  """Inverse of `_split`: (count, batch, size, ...) -> (batch, length, ...)."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _scores(q_block, k_block):
  """(batch, bq, kv, group, d) x (batch, bk, kv, d) -> (batch, kv, group, bq, bk) float32."""
  return jnp.einsum("bqkgd,bskd->bkgqs", q_block, k_block, preferred_element_type=jnp.float32)


def _split_positions(positions, nq: int, bq: int, nk: int, bk: int, q):
  """(query positions, key positions) (batch, length) split into blocks like q and k; None
  stays None (index order).

  Tied to q by an optimization barrier: positions usually derive from constants only, and
  where the layers are scanned and rematerialized JAX's partial evaluation would compute every
  block's mask (and what the masks select) ahead of the loops and keep them all, stacked over
  the block pairs (an (nq, nk, ..., bq, bk) array: 3.4x the temporaries at 8192 positions)."""
  if positions is None:
    return None
  _, positions = jax.lax.optimization_barrier((q, positions))
  return _split(positions[0], nq, bq), _split(positions[1], nk, bk)


def _blockwise_forward(q, k, v, positions, causal: bool, block: int):
  """(out (batch, q_length, heads, d), logsumexp (nq, batch, kv, group, bq) float32)."""
  batch, q_length, heads, d = q.shape
  kv_length, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  bq, nq = _blocks(q_length, block)
  bk, nk = _blocks(kv_length, block)
  qs = _split(_prescaled(q).reshape(batch, q_length, kv_heads, group, d), nq, bq)
  ks, vs = _split(k, nk, bk), _split(v, nk, bk)
  blocked = _split_positions(positions, nq, bq, nk, bk, q)

  def query_block(i):
    qi = qs[i]

    def key_block(j, carry):
      visible = _visible(i, j, bq, bk, kv_length, causal, blocked)

      def update(carry):
        m, l, acc = carry
        s = jnp.where(visible, _scores(qi, ks[j]), _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vs[j],
                        preferred_element_type=jnp.float32)
        return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv

      return _unless_hidden(visible, update, carry, blocked)

    stats = (batch, kv_heads, group, bq)
    init = jax.tree.map(lambda x: _varying_like(x, q), (
        jnp.full(stats, _MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
        jnp.zeros(stats + (d,), jnp.float32)))
    seen = nk if blocked is not None else _kv_blocks_seen(i, bq, bk, nk, causal)
    m, l, acc = jax.lax.fori_loop(0, seen, key_block, init)
    out = (acc / l[..., None]).astype(q.dtype)            # (batch, kv, group, bq, d)
    return jnp.einsum("bkgqd->bqkgd", out), m + jnp.log(l)

  out, logsumexp = jax.lax.map(query_block, jnp.arange(nq))
  return _merge(out, q_length).reshape(batch, q_length, heads, d), logsumexp


def _blockwise_backward(q, k, v, positions, out, logsumexp, d_out, causal: bool, block: int):
  """dq, dk, dv: for each key block, the query blocks that see it, scores recomputed."""
  batch, q_length, heads, d = q.shape
  kv_length, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  scale = d ** -0.5
  bq, nq = _blocks(q_length, block)
  bk, nk = _blocks(kv_length, block)
  grouped = lambda x: x.reshape(batch, q_length, kv_heads, group, d)
  qs = _split(_prescaled(q).reshape(batch, q_length, kv_heads, group, d), nq, bq)
  dos = _split(grouped(d_out), nq, bq)
  # Row sums of d_out * out: the softmax backward's correction, (nq, batch, kv, group, bq).
  delta = jnp.einsum("nbqkgd,nbqkgd->nbkgq", dos.astype(jnp.float32),
                     _split(grouped(out), nq, bq).astype(jnp.float32))
  ks, vs = _split(k, nk, bk), _split(v, nk, bk)
  blocked = _split_positions(positions, nq, bq, nk, bk, q)

  def key_block(j, dq):
    kj, vj = ks[j], vs[j]

    def query_block(i, carry):
      qi, doi = qs[i], dos[i]
      visible = _visible(i, j, bq, bk, kv_length, causal, blocked)

      def update(carry):
        dq, dk, dv = carry
        s = jnp.where(visible, _scores(qi, kj), _MASK_VALUE)
        p = jnp.exp(s - logsumexp[i][..., None])                     # (b, kv, g, bq, bk)
        dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), doi,
                             preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[i][..., None])).astype(q.dtype)
        dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32)
        dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
        return dq.at[i].add(dqi * scale), dk, dv

      return _unless_hidden(visible, update, carry, blocked)

    first = (j * bk) // bq if causal and blocked is None else 0
    zeros = _varying_like(jnp.zeros((batch, bk, kv_heads, d), jnp.float32), q)
    dq, dk, dv = jax.lax.fori_loop(first, nq, query_block, (dq, zeros, zeros))
    return dq, (dk, dv)

  dq = _varying_like(jnp.zeros((nq, batch, bq, kv_heads, group, d), jnp.float32), q)
  dq, (dk, dv) = jax.lax.scan(lambda dq, j: key_block(j, dq), dq, jnp.arange(nk))
  dq = _merge(dq, q_length).reshape(q.shape).astype(q.dtype)
  return dq, _merge(dk, kv_length).astype(k.dtype), _merge(dv, kv_length).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blockwise(q, k, v, positions, causal: bool, block: int):
  return _blockwise_forward(q, k, v, positions, causal, block)[0]


def _blockwise_fwd(q, k, v, positions, causal, block):
  out, logsumexp = _blockwise_forward(q, k, v, positions, causal, block)
  out, logsumexp = checkpoint_name(out, CONTEXT), checkpoint_name(logsumexp, CONTEXT)
  return out, (q, k, v, positions, out, logsumexp)


def _blockwise_bwd(causal, block, residuals, d_out):
  dq, dk, dv = _blockwise_backward(*residuals, d_out, causal, block)
  return dq, dk, dv, None  # positions: integers, no cotangent


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise(q, k, v, causal: bool, block: int | None = None, positions=None):
  """Flash-style attention in plain JAX (module docstring); `block` queries/keys per block
  (default BLOCK); `positions` as in `xla`."""
  return _blockwise(q, k, v, positions, causal, block or BLOCK)


# --- splash (TPU) -----------------------------------------------------------------------------

def splash_block(q_length: int, kv_length: int) -> int | None:
  """The splash block size for these lengths, or None when no 128-multiple divides both."""
  return next((b for b in SPLASH_BLOCKS if q_length % b == 0 and kv_length % b == 0), None)


def _splash_local(q, k, v, causal: bool, interpret: bool):
  """Splash on one device's block: q (batch, q_len, heads, d), k/v (batch, kv_len, kv, d)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)
  q_length, heads, d = q.shape[1:]
  kv_length = k.shape[1]
  block = splash_block(q_length, kv_length)
  one = (mask_lib.CausalMask((q_length, kv_length)) if causal
         else mask_lib.FullMask((q_length, kv_length)))
  kernel = kernel_lib.make_splash_mha(
      mask_lib.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1,
      block_sizes=kernel_lib.BlockSizes(
          block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block),
      residual_checkpoint_name=CONTEXT, interpret=interpret)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # (batch, heads, length, d)
  out = jax.vmap(kernel)(heads_major(_prescaled(q)), heads_major(k), heads_major(v))
  return heads_major(out)


def splash(q, k, v, causal: bool):
  """The Pallas splash kernel per device over the batch and head axes the rules split."""
  if splash_block(q.shape[1], k.shape[1]) is None:
    raise ValueError(f"splash attention needs lengths that are multiples of 128, not "
                     f"{q.shape[1]} queries / {k.shape[1]} keys; use model.attention='auto'")
  k, v, kv_heads = _local_kv_heads(q, k, v)
  kv_axes = ("batch", None, kv_heads, None)
  q_axes = ("batch", None, "heads", None)
  local = functools.partial(_splash_local, causal=causal, interpret=platform() != "tpu")
  # check_vma=False: pallas_call refuses shard_map's varying-axes check (its outputs would need
  # a manual_axis_type, which the splash kernel does not set).
  return sharding.shard_map(local, in_axes=(q_axes, kv_axes, kv_axes), out_axes=q_axes,
                            check_vma=False)(q, k, v)


# --- context parallelism: token positions split over devices ------------------------------

def _local_kv_heads(q, k, v):
  """(k, v, the logical name of their head axis) for per-device code: when heads and kv_heads
  are split differently, local query heads would not line up with their key/value heads, so
  every query head gets its own copy."""
  if sharding.active_ways("heads") == sharding.active_ways("kv_heads"):
    return k, v, "kv_heads"
  group = q.shape[2] // k.shape[2]
  return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), "heads"


def gathered(q, k, v, causal: bool, positions, local: Callable):
  """All-gather context parallelism: each device keeps its queries (`length` split) and reads
  every key and value (`kv_length`, whole: XLA gathers them over the mesh axes of `length`),
  masked by position with `local` (xla or blockwise). positions (batch, length)."""
  k, v, kv_heads = _local_kv_heads(q, k, v)
  q_axes = ("batch", "length", "heads", None)
  kv_axes = ("batch", "kv_length", kv_heads, None)

  def per_device(q, k, v, q_positions, kv_positions):
    # Each device's keys and values become its own (varying) copies: their gradients are then
    # summed over the devices that share them by the cast's transpose, even inside kernels
    # with a custom VJP.
    k, v = _varying_like(k, q), _varying_like(v, q)
    return local(q, k, v, causal, positions=(q_positions, kv_positions))

  return sharding.shard_map(
      per_device, in_axes=(q_axes, kv_axes, kv_axes, ("batch", "length"), ("batch", "kv_length")),
      out_axes=q_axes)(q, k, v, positions, positions)


def _ring_local(q, k, v, q_positions, kv_positions, causal: bool, axes, ways: int):
  """One device's queries against every device's key/value block, the blocks passed one step
  around the ring of `axes` (`ways` devices) with ppermute, summed with an online softmax.
  Each step runs over blocks of BLOCK queries, each rematerialized in the backward pass, so
  the scores held at once are one query block's against one key/value block."""
  batch, q_length, heads, d = q.shape
  kv_heads, group = k.shape[2], heads // k.shape[2]
  # Tied to q: positions from constants would otherwise have their masks computed ahead of
  # the loops and kept (see _split_positions).
  _, (q_positions, kv_positions) = jax.lax.optimization_barrier((q, (q_positions, kv_positions)))
  bq = max(b for b in range(1, min(BLOCK, q_length) + 1) if q_length % b == 0)
  nq = q_length // bq
  qs = _split(_prescaled(q).reshape(batch, q_length, kv_heads, group, d), nq, bq)
  q_positions = _split(q_positions, nq, bq)                           # (nq, b, bq)
  ring_order = [(i, (i + 1) % ways) for i in range(ways)]

  def accumulate(stats, k, v, kv_positions):
    @jax.checkpoint
    def query_block(args):
      (m, l, acc), qi, qpos = args
      s = _scores(qi, k)                                              # (b, kv, g, bq, s)
      if causal:
        seen = kv_positions[:, None, :] <= qpos[:, :, None]           # (b, bq, s)
        s = jnp.where(seen[:, None, None], s, _MASK_VALUE)
      m_new = jnp.maximum(m, s.max(axis=-1))
      p = jnp.exp(s - m_new[..., None])
      correction = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)
      return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv

    return jax.lax.map(query_block, (stats, qs, q_positions))

  # Saved per ring step for the backward pass: the running statistics and the visiting block,
  # not its scores (recomputed), so memory stays linear in the length.
  @jax.checkpoint
  def step(carry, _):
    stats, blocks = carry
    blocks = tuple(jax.lax.ppermute(x, axes, ring_order) for x in blocks)
    return (accumulate(stats, *blocks), blocks), None

  stats = (nq, batch, kv_heads, group, bq)
  stats = accumulate(jax.tree.map(lambda x: _varying_like(x, q), (
      jnp.full(stats, _MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
      jnp.zeros(stats + (d,), jnp.float32))), k, v, kv_positions)
  if ways > 1:
    (stats, _), _ = jax.lax.scan(step, (stats, (k, v, kv_positions)), None, length=ways - 1)
  _, l, acc = stats
  out = (acc / l[..., None]).astype(q.dtype)                          # (nq, b, kv, g, bq, d)
  out = jnp.einsum("nbkgqd->nbqkgd", out)
  return _merge(out, q_length).reshape(batch, q_length, heads, d)


def ring(q, k, v, causal: bool, positions=None):
  """Ring attention over the mesh axes the rules split `length` over (one device: plain
  attention). positions (batch, length), default 0..length-1: self-attention, so queries and
  keys share them."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  axes, ways = sharding.active_axes("length"), sharding.active_ways("length")
  k, v, kv_heads = _local_kv_heads(q, k, v)
  q_axes = ("batch", "length", "heads", None)
  kv_axes = ("batch", "length", kv_heads, None)
  local = functools.partial(_ring_local, causal=causal, axes=axes, ways=ways)
  return sharding.shard_map(
      local, in_axes=(q_axes, kv_axes, kv_axes, ("batch", "length"), ("batch", "length")),
      out_axes=q_axes)(q, k, v, positions, positions)


# --- selection --------------------------------------------------------------------------------

IMPLEMENTATIONS: dict[str, Callable] = {
    "xla": xla, "blockwise": blockwise, "splash": splash, "cudnn": cudnn, "ring": ring}
# What runs per device when the token positions are split (context parallelism): the queries'
# own block against gathered keys and values, masked by position.
SPLIT_LENGTH = {"xla": xla, "blockwise": blockwise}
CHOICES = ("auto",) + tuple(IMPLEMENTATIONS)


def resolve(implementation: str, q_shape, kv_shape, dtype, on: str | None = None,
            split_length: bool | None = None) -> str:
  """The implementation `implementation` stands for on platform `on` (default `platform()`):
  itself, or for "auto" splash on TPU from SPLASH_FROM keys (lengths multiples of 128), cudnn
  on GPU within its limits, else xla below BLOCKWISE_FROM keys and blockwise from there. With
  the positions split over devices (`split_length`, default: as the active rules say) only
  those two."""
  if implementation != "auto":
    return implementation
  on = on or platform()
  q_length, kv_length, head_dim = q_shape[1], kv_shape[1], q_shape[-1]
  if split_length is None:
    split_length = sharding.active_ways("length") > 1
  if split_length:  # context parallelism: kernels that mask by position
    return "blockwise" if kv_length >= BLOCKWISE_FROM else "xla"
  if on == "tpu" and kv_length >= SPLASH_FROM and splash_block(q_length, kv_length):
    return "splash"
  if on == "gpu" and cudnn_supports(q_shape, kv_shape, head_dim, dtype):
    return "cudnn"
  return "blockwise" if kv_length >= BLOCKWISE_FROM else "xla"


def attend(q, k, v, causal: bool = True, implementation: str = "auto", positions=None):
  """Attention by `implementation` (module docstring); the output is named CONTEXT.

  `positions` (batch, length) are the tokens' positions when q, k and v come from the same
  tokens (self-attention). When the active rules split `length` over devices (context
  parallelism, whose inputs come in `sharding.sequence`'s balanced order) and with `ring`,
  attention masks by them (default 0..length-1); otherwise by index, as the module says."""
  name = resolve(implementation, q.shape, k.shape, q.dtype)
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {name!r} is unknown; choose one of "
                     f"{', '.join(CHOICES)}")
  if name != "ring" and sharding.active_ways("length") == 1:
    return checkpoint_name(IMPLEMENTATIONS[name](q, k, v, causal), CONTEXT)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  if name == "ring":
    return checkpoint_name(ring(q, k, v, causal, positions), CONTEXT)
  if name not in SPLIT_LENGTH:
    raise ValueError(f"model.attention={name!r} cannot run with the token positions split over "
                     f"devices (a sequence mesh axis); use one of auto, "
                     f"{', '.join(SPLIT_LENGTH)}, ring")
  return checkpoint_name(gathered(q, k, v, causal, positions, SPLIT_LENGTH[name]), CONTEXT)

