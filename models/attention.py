"""Attention implementations behind one call, chosen by name (`LlamaConfig.attention`).

  attend(q, k, v, causal=True, implementation="auto", positions=None, segment_ids=None)
      -> (batch, q_length, heads, head_dim)

q is (batch, q_length, heads, head_dim), k and v (batch, kv_length, kv_heads, head_dim) with
heads a multiple of kv_heads (grouped-query: query head h reads key/value head h // (heads //
kv_heads)); scores are scaled by 1/sqrt(head_dim); causal means key j is seen by query i when
j <= i (queries and keys both counted from position 0). The output has q's dtype.

  xla        `jax.nn.dot_product_attention` (XLA): materializes the (batch, heads, q, k) scores
  blockwise  flash-style attention in plain JAX on every backend (models/blockwise.py): an
             online softmax over key/value blocks, blocks above the causal diagonal skipped, a
             custom VJP that recomputes each block; memory O(length x block), not O(length^2)
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

Packed documents. `segment_ids` (batch, length) int says which document of its row each token
belongs to (1, 2, ...; 0 is padding, which attends only to padding): a query then sees only
keys of its own segment, and causally within it. Every implementation masks so:
  xla        a (batch, 1, q, k) same-segment mask beside the causal one
  blockwise  the mask inside each block, and a (query block, key block) pair that shares no
             segment is skipped (`jax.lax.cond`, per device under `shard_map`)
  splash     the kernel's own `SegmentIds` (its block-sparse skipping stays the causal one)
  cudnn      the same-segment mask handed to the library, which turns it into a bias
  ring       the segment ids travel around the ring with the keys and values and positions
  gathered   (context parallelism) each device's segment ids against the gathered ones
Causality stays by index, or by position with the positions split: positions restart per
document, but within one segment they rise with the index, so "same segment and key position
<= query position" is the causal mask of each document.

Context parallelism. When the activation rules split `length` over devices (a `sequence` mesh
axis), the inputs come in `sharding.sequence`'s load-balanced order and attention masks by the
tokens' positions: xla and blockwise run per device on the device's queries against keys and
values gathered whole (`gathered`; auto picks between them as above), ring passes the blocks
around instead; splash and cudnn are refused there.

To add one: write `fn(q, k, v, causal, segment_ids=None) -> out` with the contract above
(segment ids as a (query ids, key ids) pair), register it in IMPLEMENTATIONS (and SPLIT_LENGTH
if it takes `positions=`), and give `resolve` a case if `auto` should pick it. The platform is
the active mesh's (`sharding.active_mesh`), so compiling for a TPU from a CPU host resolves as
on the TPU.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import sharding
from models import blockwise as blockwise_lib
from models.blockwise import CONTEXT, MASK_VALUE, prescaled, varying_like

# Below this many keys `auto` keeps the XLA implementation's scores, from it the blockwise loop
# (memory linear in the length). Timed on CPU (scripts/bench/bench_attention.py: forward + backward,
# causal, 8 heads of 64, medians of 7 rounds), blockwise / xla: 0.98 at 256 keys, 1.68 at 512,
# 1.41 at 768, 0.68 at 1024, 0.41 at 2048, 0.37 at 4096: blockwise wins from 1024.
BLOCKWISE_FROM = 1024
# Compiled for v5p-8 (the CPU LM, head_dim 32, remat none, per device): splash 219 MiB vs xla
# 201 MiB at 256 tokens, 423 vs 516 MiB at 512. The kernel's residuals are laid out heads-major
# with head_dim padded to 128 lanes, which costs more than short sequences' scores.
SPLASH_FROM = 512
BLOCK = 512                 # blockwise: queries and keys per block (smaller for short inputs)
SPLASH_BLOCKS = (512, 256, 128)  # splash block sizes tried, largest first (128-lane tiles)


def platform() -> str:
  """The platform attention compiles for: the active mesh's devices, else JAX's default."""
  mesh = sharding.active_mesh()
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _same_segment(segment_ids):
  """(batch, 1, q_length, kv_length) bool, True where query and key share a segment, from
  (query ids (batch, q_length), key ids (batch, kv_length))."""
  q_segments, kv_segments = segment_ids
  return q_segments[:, None, :, None] == kv_segments[:, None, None, :]


# --- xla and cudnn ----------------------------------------------------------------------------

def xla(q, k, v, causal: bool, positions=None, segment_ids=None):
  """`positions`: None (queries and keys counted from 0), or (query positions (batch,
  q_length), key positions (batch, kv_length)) for inputs in any order, masked by position.
  `segment_ids`: None, or (query ids, key ids) shaped alike: keys of other segments masked."""
  if positions is None and segment_ids is None:
    return jax.nn.dot_product_attention(prescaled(q), k, v, is_causal=causal, scale=1.0,
                                        implementation="xla")
  mask = None
  if positions is not None and causal:
    q_positions, kv_positions = positions
    mask = kv_positions[:, None, None, :] <= q_positions[:, None, :, None]
  if segment_ids is not None:
    same = _same_segment(segment_ids)
    mask = same if mask is None else mask & same
  return jax.nn.dot_product_attention(prescaled(q), k, v, mask=mask,
                                      is_causal=causal and positions is None, scale=1.0,
                                      implementation="xla")


def cudnn(q, k, v, causal: bool, segment_ids=None):
  """cuDNN's fused kernel through `jax.nn.dot_product_attention`. With `segment_ids` (query
  ids, key ids) the same-segment mask goes with it, which JAX hands cuDNN as a (batch, 1, q,
  k) bias (jax 0.10: the public call has no packed-sequence layout): the one length^2 array of
  this path."""
  mask = None if segment_ids is None else _same_segment(segment_ids)
  return jax.nn.dot_product_attention(prescaled(q), k, v, mask=mask, is_causal=causal,
                                      scale=1.0, implementation="cudnn")


def cudnn_supports(q_shape, kv_shape, head_dim: int, dtype) -> bool:
  """cuDNN's fused attention limits (jax.nn.dot_product_attention): 16-bit inputs, head_dim
  a multiple of 8 up to 128 (256 from cuDNN 9.5 on Hopper; 128 is safe)."""
  del q_shape, kv_shape
  return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and \
      head_dim <= 128


# --- blockwise (models/blockwise.py) ----------------------------------------------------------

def blockwise(q, k, v, causal: bool, block: int | None = None, positions=None,
              segment_ids=None):
  """Flash-style attention in plain JAX (`models.blockwise`); `block` queries/keys per block
  (default BLOCK); `positions` and `segment_ids` as in `xla`."""
  return blockwise_lib.blockwise(q, k, v, causal, block or BLOCK, positions, segment_ids)


# --- splash (TPU) -----------------------------------------------------------------------------

def splash_block(q_length: int, kv_length: int) -> int | None:
  """The splash block size for these lengths, or None when no 128-multiple divides both."""
  return next((b for b in SPLASH_BLOCKS if q_length % b == 0 and kv_length % b == 0), None)


def _splash_local(q, k, v, q_segments=None, kv_segments=None, *, causal: bool,
                  interpret: bool):
  """Splash on one device's block: q (batch, q_len, heads, d), k/v (batch, kv_len, kv, d),
  segment ids (batch, q_len) and (batch, kv_len) or None."""
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
  q, k, v = heads_major(prescaled(q)), heads_major(k), heads_major(v)
  if q_segments is None:
    return heads_major(jax.vmap(kernel)(q, k, v))
  row = lambda q, k, v, q_ids, kv_ids: kernel(
      q, k, v, segment_ids=kernel_lib.SegmentIds(q=q_ids, kv=kv_ids))
  return heads_major(jax.vmap(row)(q, k, v, q_segments, kv_segments))


def splash(q, k, v, causal: bool, segment_ids=None):
  """The Pallas splash kernel per device over the batch and head axes the rules split;
  `segment_ids` None or (query ids, key ids), the kernel's `SegmentIds`."""
  if splash_block(q.shape[1], k.shape[1]) is None:
    raise ValueError(f"splash attention needs lengths that are multiples of 128, not "
                     f"{q.shape[1]} queries / {k.shape[1]} keys; use model.attention='auto'")
  k, v, kv_heads = _local_kv_heads(q, k, v)
  kv_axes = ("batch", None, kv_heads, None)
  q_axes = ("batch", None, "heads", None)
  local = functools.partial(_splash_local, causal=causal, interpret=platform() != "tpu")
  args, in_axes = (q, k, v), (q_axes, kv_axes, kv_axes)
  if segment_ids is not None:
    args, in_axes = args + tuple(segment_ids), in_axes + (("batch", None),) * 2
  # check_vma=False: pallas_call refuses shard_map's varying-axes check (its outputs would need
  # a manual_axis_type, which the splash kernel does not set).
  return sharding.shard_map(local, in_axes=in_axes, out_axes=q_axes, check_vma=False)(*args)


# --- context parallelism: token positions split over devices ------------------------------

def _local_kv_heads(q, k, v):
  """(k, v, the logical name of their head axis) for per-device code: when heads and kv_heads
  are split differently, local query heads would not line up with their key/value heads, so
  every query head gets its own copy."""
  if sharding.active_ways("heads") == sharding.active_ways("kv_heads"):
    return k, v, "kv_heads"
  group = q.shape[2] // k.shape[2]
  return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), "heads"


def gathered(q, k, v, causal: bool, positions, local: Callable, segment_ids=None):
  """All-gather context parallelism: each device keeps its queries (`length` split) and reads
  every key and value (`kv_length`, whole: XLA gathers them over the mesh axes of `length`),
  masked by position with `local` (xla or blockwise). positions and segment_ids (batch,
  length); the segment ids are gathered like the positions."""
  k, v, kv_heads = _local_kv_heads(q, k, v)
  q_axes = ("batch", "length", "heads", None)
  kv_axes = ("batch", "kv_length", kv_heads, None)
  tokens = (("batch", "length"), ("batch", "kv_length"))

  def per_device(q, k, v, q_positions, kv_positions, *segments):
    # Each device's keys and values become its own (varying) copies: their gradients are then
    # summed over the devices that share them by the cast's transpose, even inside kernels
    # with a custom VJP.
    k, v = varying_like(k, q), varying_like(v, q)
    return local(q, k, v, causal, positions=(q_positions, kv_positions),
                 segment_ids=tuple(segments) or None)

  args, in_axes = (q, k, v, positions, positions), (q_axes, kv_axes, kv_axes) + tokens
  if segment_ids is not None:
    args, in_axes = args + (segment_ids, segment_ids), in_axes + tokens
  return sharding.shard_map(per_device, in_axes=in_axes, out_axes=q_axes)(*args)


def _ring_local(q, k, v, q_positions, kv_positions, q_segments=None, kv_segments=None, *,
                causal: bool, axes, ways: int):
  """One device's queries against every device's key/value block, the blocks passed one step
  around the ring of `axes` (`ways` devices) with ppermute, summed with an online softmax.
  Each step runs over blocks of BLOCK queries, each rematerialized in the backward pass, so
  the scores held at once are one query block's against one key/value block. Segment ids, when
  given, travel with the key/value blocks."""
  batch, q_length, heads, d = q.shape
  kv_heads, group = k.shape[2], heads // k.shape[2]
  # Tied to q: positions from constants would otherwise have their masks computed ahead of
  # the loops and kept (see models.blockwise._masking).
  tokens = (q_positions, kv_positions)
  if q_segments is not None:
    tokens += (q_segments, kv_segments)
  _, tokens = jax.lax.optimization_barrier((q, tokens))
  q_positions, kv_positions = tokens[:2]
  bq = max(b for b in range(1, min(BLOCK, q_length) + 1) if q_length % b == 0)
  nq = q_length // bq
  qs = blockwise_lib.split_blocks(prescaled(q).reshape(batch, q_length, kv_heads, group, d),
                                  nq, bq)
  q_tokens = tuple(blockwise_lib.split_blocks(x, nq, bq)            # (nq, b, bq) each
                   for x in (q_positions,) + tokens[2:3])
  ring_order = [(i, (i + 1) % ways) for i in range(ways)]

  def accumulate(stats, k, v, kv_positions, kv_segments=None):
    @jax.checkpoint
    def query_block(args):
      (m, l, acc), qi, qpos, *qseg = args
      s = blockwise_lib.scores(qi, k)                                 # (b, kv, g, bq, s)
      seen = (kv_positions[:, None, :] <= qpos[:, :, None]) if causal else None  # (b, bq, s)
      if kv_segments is not None:
        same = kv_segments[:, None, :] == qseg[0][:, :, None]
        seen = same if seen is None else seen & same
      if seen is not None:
        s = jnp.where(seen[:, None, None], s, MASK_VALUE)
      m_new = jnp.maximum(m, s.max(axis=-1))
      p = jnp.exp(s - m_new[..., None])
      correction = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)
      return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv

    return jax.lax.map(query_block, (stats, qs) + q_tokens)

  # Saved per ring step for the backward pass: the running statistics and the visiting block,
  # not its scores (recomputed), so memory stays linear in the length.
  @jax.checkpoint
  def step(carry, _):
    stats, blocks = carry
    blocks = tuple(jax.lax.ppermute(x, axes, ring_order) for x in blocks)
    return (accumulate(stats, *blocks), blocks), None

  visiting = (k, v, kv_positions) + tokens[3:]
  stats = (nq, batch, kv_heads, group, bq)
  stats = accumulate(jax.tree.map(lambda x: varying_like(x, q), (
      jnp.full(stats, MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
      jnp.zeros(stats + (d,), jnp.float32))), *visiting)
  if ways > 1:
    (stats, _), _ = jax.lax.scan(step, (stats, visiting), None, length=ways - 1)
  _, l, acc = stats
  out = (acc / l[..., None]).astype(q.dtype)                          # (nq, b, kv, g, bq, d)
  out = jnp.einsum("nbkgqd->nbqkgd", out)
  return blockwise_lib.merge_blocks(out, q_length).reshape(batch, q_length, heads, d)


def ring(q, k, v, causal: bool, positions=None, segment_ids=None):
  """Ring attention over the mesh axes the rules split `length` over (one device: plain
  attention). positions (batch, length), default 0..length-1, and segment_ids (batch, length)
  or None: self-attention, so queries and keys share them."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  axes, ways = sharding.active_axes("length"), sharding.active_ways("length")
  k, v, kv_heads = _local_kv_heads(q, k, v)
  q_axes = ("batch", "length", "heads", None)
  kv_axes = ("batch", "length", kv_heads, None)
  tokens = (("batch", "length"),) * 2
  local = functools.partial(_ring_local, causal=causal, axes=axes, ways=ways)
  args, in_axes = (q, k, v, positions, positions), (q_axes, kv_axes, kv_axes) + tokens
  if segment_ids is not None:
    args, in_axes = args + (segment_ids, segment_ids), in_axes + tokens
  return sharding.shard_map(local, in_axes=in_axes, out_axes=q_axes)(*args)


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


def _blockwise_per_device(q, k, v, causal: bool, segment_ids):
  """blockwise with segment ids (batch, length) per device over the batch and head axes the
  rules split: each device skips the block pairs its own rows do not need (a skip decided on
  the global batch would wait on every device's rows)."""
  k, v, kv_heads = _local_kv_heads(q, k, v)
  q_axes = ("batch", None, "heads", None)
  kv_axes = ("batch", None, kv_heads, None)
  local = lambda q, k, v, ids: blockwise(q, k, v, causal, segment_ids=(ids, ids))
  return sharding.shard_map(local, in_axes=(q_axes, kv_axes, kv_axes, ("batch", None)),
                            out_axes=q_axes)(q, k, v, segment_ids)


def attend(q, k, v, causal: bool = True, implementation: str = "auto", positions=None,
           segment_ids=None):
  """Attention by `implementation` (module docstring); the output is named CONTEXT.

  `positions` (batch, length) are the tokens' positions when q, k and v come from the same
  tokens (self-attention). When the active rules split `length` over devices (context
  parallelism, whose inputs come in `sharding.sequence`'s balanced order) and with `ring`,
  attention masks by them (default 0..length-1); otherwise by index, as the module says.
  `segment_ids` (batch, length), self-attention too: packed documents, each attending only
  within itself (module docstring); None: one sequence per row."""
  name = resolve(implementation, q.shape, k.shape, q.dtype)
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {name!r} is unknown; choose one of "
                     f"{', '.join(CHOICES)}")
  if name != "ring" and sharding.active_ways("length") == 1:
    if segment_ids is None:
      return checkpoint_name(IMPLEMENTATIONS[name](q, k, v, causal), CONTEXT)
    if name == "blockwise":
      return checkpoint_name(_blockwise_per_device(q, k, v, causal, segment_ids), CONTEXT)
    pair = (segment_ids, segment_ids)
    return checkpoint_name(IMPLEMENTATIONS[name](q, k, v, causal, segment_ids=pair), CONTEXT)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  if name == "ring":
    return checkpoint_name(ring(q, k, v, causal, positions, segment_ids), CONTEXT)
  if name not in SPLIT_LENGTH:
    raise ValueError(f"model.attention={name!r} cannot run with the token positions split over "
                     f"devices (a sequence mesh axis); use one of auto, "
                     f"{', '.join(SPLIT_LENGTH)}, ring")
  return checkpoint_name(gathered(q, k, v, causal, positions, SPLIT_LENGTH[name], segment_ids),
                         CONTEXT)
