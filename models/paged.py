"""A paged KV cache: every request's keys and values in fixed-size pages of one pool, and a
page table per row naming its pages in order (vLLM's PagedAttention layout).

  cache {"k", "v"}: (layers, kv_heads, pages, page_size, head_dim), logical axes CACHE_AXES
  page table (rows, pages per row) int32: a row's position p lives at offset p % page_size of
      page table[row, p // page_size]

A step runs groups of rows (`Rows`): each group has its own page table and a static number of
tokens per row (`chunk`: 1 for decoding, more for a prompt's chunk), and every group's tokens
go through the model together, flattened into one token axis. The token axis, the rows and
the pool's pages are split like the batch: under rules that split `batch` over n devices,
device i holds pages / n pages, the rows i*R/n..(i+1)*R/n of each group of R rows, and their
tokens, laid out group after group (rows in order, each row's `chunk` tokens in order) in its
block of the token axis. Page ids are local to a device's block (the host gives each request
pages of the block its rows run on: toolkit/inference/pages.py), so writing and reading never
leave the device: `write_and_attend` runs per device (a shard_map over batch and kv_heads).

Reading follows the live tokens, not the table's width: a loop over blocks of BLOCK_POSITIONS
positions with an online softmax stops after the block holding the group's last position, so
one compiled step serves any mix of lengths. On TPU a one-token group reads its pages with the
Pallas paged-attention kernel (jax.experimental.pallas.ops.tpu.paged_attention) where its
tiling fits (`_kernel_fits`), which skips the pages past each row's length itself.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

import sharding
from sharding import ShardingError

CACHE_AXES = ("layers", "kv_heads", "batch", None, "head_dim")
BLOCK_POSITIONS = 64  # key positions the reading loop takes per iteration (whole pages)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@struct.dataclass
class Rows:
  """The groups of rows of one step: per group a page table (rows, pages per row) int32 and
  counts (rows,) int32, the real tokens of each row (the rest of its `chunk` is padding: never
  written, its output meaningless; 0 is an idle row); `chunks` the tokens per row of each
  group (static)."""
  tables: tuple[jax.Array, ...]
  counts: tuple[jax.Array, ...]
  chunks: tuple[int, ...] = struct.field(pytree_node=False)


def init(n_layers: int, kv_heads: int, head_dim: int, pages: int, page_size: int,
         dtype) -> dict[str, jax.Array]:
  """An empty pool: zeros (a page never written is finite, and masked anyway)."""
  shape = (n_layers, kv_heads, pages, page_size, head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def write_and_attend(q, k, v, cache: tuple[jax.Array, jax.Array], layer, rows: Rows,
                     positions):
  """Writes the step's keys and values into their rows' pages, then lets every query attend
  to the positions up to its own in its row.

  q (tokens, 1, heads, head_dim) with rotary positions applied; k, v (tokens, 1, kv_heads,
  head_dim); tokens laid out as the module docstring says; cache the stacked (keys, values)
  pools and `layer` this layer's index; positions (tokens, 1). Returns (out like q, cache)."""
  if sharding.active_ways("heads") != sharding.active_ways("kv_heads"):
    raise ShardingError("a paged KV cache needs heads and kv_heads split the same number of "
                        "ways (each device's query heads read its own key/value heads); "
                        "change sharding.activation_overrides")
  q_axes, kv_axes = ("batch", None, "heads", "head_dim"), ("batch", None, "kv_heads", "head_dim")
  tables = tuple(("batch", None) for _ in rows.tables)
  counts = tuple(("batch",) for _ in rows.counts)

  kernel = _platform() == "tpu"  # here: inside per_device no rules (and no mesh) are active

  def per_device(q, k, v, cache_k, cache_v, layer, positions, tables, counts):
    return _local(q, k, v, (cache_k, cache_v), layer, positions[:, 0], tables, counts,
                  rows.chunks, kernel=kernel)

  # check_vma=False: the Pallas kernel's outputs carry no varying-axes type.
  return sharding.shard_map(
      per_device, in_axes=(q_axes, kv_axes, kv_axes, CACHE_AXES, CACHE_AXES, (),
                           ("batch", None), tables, counts),
      out_axes=(q_axes, (CACHE_AXES, CACHE_AXES)), check_vma=False)(
          q, k, v, *cache, layer, positions, rows.tables, rows.counts)


def _platform() -> str:
  mesh = sharding.active_mesh()
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _groups(x, tables, chunks):
  """One device's token block split into its groups: (rows, chunk, ...) each."""
  out, start = [], 0
  for table, chunk in zip(tables, chunks):
    size = table.shape[0] * chunk
    out.append(x[start:start + size].reshape(table.shape[0], chunk, *x.shape[1:]))
    start += size
  return out


def _local(q, k, v, cache, layer, positions, tables, counts, chunks, *, kernel: bool):
  q, k, v = (x[:, 0] for x in (q, k, v))                     # (tokens, heads, head_dim)
  group_positions = _groups(positions, tables, chunks)
  cache_k, cache_v = cache
  # Every write first: a row reads only its own pages, so the groups' order does not matter.
  for table, count, at, new_k, new_v in zip(tables, counts, group_positions,
                                            _groups(k, tables, chunks), _groups(v, tables, chunks)):
    cache_k = _write(cache_k, layer, table, at, count, new_k)
    cache_v = _write(cache_v, layer, table, at, count, new_v)
  layer_k, layer_v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)
                      for c in (cache_k, cache_v))
  outs = []
  for table, count, at, queries in zip(tables, counts, group_positions,
                                       _groups(q, tables, chunks)):
    if kernel and _kernel_fits(queries, layer_k, table):
      out = _kernel(queries, layer_k, layer_v, table, at, count)
    else:
      out = _blockwise(queries, layer_k, layer_v, table, at, count)
    outs.append(out.reshape(-1, 1, *out.shape[2:]))
  return jnp.concatenate(outs, axis=0), (cache_k, cache_v)


def _write(cache, layer, table, positions, counts, new):
  """cache (layers, kv_heads, pages, page_size, head_dim) with new (rows, chunk, kv_heads,
  head_dim) at each real token's page and offset; padding goes to an out-of-range page, which
  the scatter drops."""
  pages, size = cache.shape[2], cache.shape[3]
  real = jnp.arange(new.shape[1])[None, :] < counts[:, None]
  index = jnp.clip(positions // size, 0, table.shape[1] - 1)
  page = jnp.where(real, jnp.take_along_axis(table, index, axis=1), pages)
  # Advanced indices split by a slice: the (rows, chunk) index dimensions come first, so the
  # update is (rows, chunk, kv_heads, head_dim), the layout `new` already has.
  return cache.at[layer, :, page, positions % size].set(new.astype(cache.dtype), mode="drop")


def _blockwise(q, layer_k, layer_v, table, positions, counts):
  """q (rows, chunk, heads, head_dim) against the rows' pages, BLOCK_POSITIONS keys at a time
  with an online softmax (flash attention's recurrence), up to the block holding the group's
  last real position: key t is seen by a query at position p when t <= p."""
  rows, chunk, heads, d = q.shape
  kv_heads, _, page_size, _ = layer_k.shape
  block_pages = max(1, BLOCK_POSITIONS // page_size)
  width = -(-table.shape[1] // block_pages) * block_pages
  table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])))
  block = block_pages * page_size
  real = jnp.arange(chunk)[None, :] < jnp.maximum(counts, 1)[:, None]
  last = jnp.max(jnp.where(real, positions, 0))
  grouped = (q * d ** -0.5).reshape(rows, chunk, kv_heads, heads // kv_heads, d)
  shape = (rows, kv_heads, heads // kv_heads, chunk)

  def body(j, carry):
    peak, total, acc = carry
    pages = jax.lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1)
    keys, values = (jnp.take(pool, pages, axis=1).reshape(kv_heads, rows, block, d)
                    for pool in (layer_k, layer_v))
    scores = jnp.einsum("rckgd,krtd->rkgct", grouped, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    seen = j * block + jnp.arange(block)[None, None, :] <= positions[:, :, None]
    scores = jnp.where(seen[:, None, None], scores, _MASK)
    new_peak = jnp.maximum(peak, scores.max(axis=-1))
    weights = jnp.exp(scores - new_peak[..., None])
    rescale = jnp.exp(peak - new_peak)
    total = total * rescale + weights.sum(axis=-1)
    acc = acc * rescale[..., None] + jnp.einsum("rkgct,krtd->rkgcd", weights,
                                                values.astype(jnp.float32))
    return new_peak, total, acc

  # Block 0 holds position 0, which every query sees: after it no row's peak is the mask value.
  init = (jnp.full(shape, _MASK, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros((*shape, d), jnp.float32))
  _, total, acc = jax.lax.fori_loop(0, last // block + 1, body, init)
  out = (acc / total[..., None]).astype(q.dtype)               # (rows, kv, group, chunk, d)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(rows, chunk, heads, d)


# --- the Pallas TPU kernel ---------------------------------------------------------------------

def _kernel_fits(q, layer_k, table) -> bool:
  """One query per row, head_dim filling 128 lanes, pages of whole (16, 128) bf16 tiles."""
  return q.shape[1] == 1 and q.shape[3] % 128 == 0 and layer_k.shape[2] % 16 == 0 and \
      table.shape[1] >= 1


def _kernel(q, layer_k, layer_v, table, positions, counts):
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
  per_row = table.shape[1]
  block = max(b for b in (1, 2, 4, 8) if per_row % b == 0)
  lengths = jnp.where(counts > 0, positions[:, 0] + 1, 0).astype(jnp.int32)
  out = paged_attention(q[:, 0] * q.shape[-1] ** -0.5, layer_k, layer_v, lengths, table,
                        pages_per_compute_block=block)
  return out[:, None].astype(q.dtype)


def pages_for(positions: int, page_size: int) -> int:
  """Pages that hold `positions` positions."""
  return math.ceil(positions / page_size)
