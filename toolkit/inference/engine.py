"""Generation with a paged KV cache on a mesh: the compiled step and how a step's rows are laid
out for it. The scheduler that feeds it (continuous batching, prefix caching, chunked
prefill, cancellation) is toolkit/inference/scheduler.py; its names are exported here too.

Design (vLLM's paged attention and mixed prefill/decode steps, in one process):
  * The cache is a pool of pages, (layers, kv_heads, pages, page_size, head_dim) for keys and
    values (models/paged.py), sharded by the activation rules like any activation: pages and
    rows split like the batch, kv_heads like the heads. Memory follows the pages in use, not
    slots x cache_length.
  * `step` runs groups of rows through the model at once: decoding rows (one token each) and
    prompt chunks (up to `chunk` tokens each), each row reading and writing its own pages
    through its page table. A row's tokens go into its pages at their positions; the step
    returns each row's next token (sampled) and its logits.
  * One program per step shape: the rows of each group (a power of two per device: the
    decode batch follows the live requests), the tokens per row of each group and the pages of
    the pool. `Engine.traces` counts the traces.
  * `quantize="int8"` stores the layer stack's matrices as int8 with per-channel scales
    (models/quantization.py); "bfloat16" casts the weights to bfloat16.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sharding
from models import LlamaConfig, paged, quantization
from models.llama import init_paged_cache
from toolkit.accelerators import human_bytes
from toolkit.inference import sampling
from toolkit.inference.sampling import RequestError, SamplingParams
# The scheduler's names, where callers have always found them.
from toolkit.inference.scheduler import Batcher, Request, Result, RowWork, generate
from toolkit.training import state as state_lib

__all__ = ["Batcher", "Engine", "Request", "Result", "RowWork", "convert_weights", "decode_step",
           "generate", "paged_step"]

MIN_PROMPT_BUCKET = 16
DEFAULT_PAGE_SIZE = 16
WEIGHT_FORMATS = ("none", "bfloat16", "int8")


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def decode_step(graphdef: nnx.GraphDef, rules: sharding.Rules, mesh: Mesh, params, cache,
                tokens, positions, rows, token_index):
  """One token for every slot of a contiguous cache (models/llama.py's `decode`): the
  model's decode and the sampler, under the rules. Returns (cache, next tokens (batch,),
  logits (batch, vocab)). scripts/bench/decode_cost.py compiles it ahead of time beside the paged
  step, to compare the two."""
  with sharding.activation_rules(rules, mesh):
    logits, cache = nnx.merge(graphdef, params).decode(tokens, positions, cache)
    next_tokens = sampling.sample(logits, rows, token_index)
  return cache, next_tokens, logits


def paged_step(graphdef: nnx.GraphDef, rules: sharding.Rules, mesh: Mesh, params, cache,
               tokens, positions, pages: paged.Rows, last, rows, token_index):
  """The engine's step: every group of rows through the model against the paged cache
  (models/llama.py's `extend`), then the sampler. Returns (cache, next tokens (rows,),
  logits (rows, vocab)). The engine jits it with the cache donated; scripts/bench/decode_cost.py
  compiles it ahead of time for a TPU topology."""
  with sharding.activation_rules(rules, mesh):
    logits, cache = nnx.merge(graphdef, params).extend(tokens, positions, cache, pages, last)
    next_tokens = sampling.sample(logits, rows, token_index)
  return cache, next_tokens, logits


@dataclasses.dataclass(frozen=True)
class Options:
  """How a server or offline run holds its cache and weights (toolkit.generate's and
  toolkit.serve's flags): positions per page, pages in all (0: batch_size x one cache_length
  request's pages), prompt tokens prefilled per step (0: whole prompts), reuse of cached prompt
  prefixes, and the weights' format (WEIGHT_FORMATS)."""
  page_size: int = DEFAULT_PAGE_SIZE
  cache_pages: int = 0
  prefill_chunk: int = 0
  prefix_caching: bool = True
  quantize: str = "none"

  def engine(self, model_cfg: LlamaConfig, params, mesh: Mesh, rules: sharding.Rules,
             cache_length: int) -> Engine:
    return Engine(model_cfg, params, mesh, rules, cache_length, self.page_size, self.quantize)

  def batcher(self) -> dict:
    """The Batcher's keyword arguments."""
    return {"cache_pages": self.cache_pages, "prefill_chunk": self.prefill_chunk,
            "prefix_caching": self.prefix_caching}


class Engine:
  """One model's parameters on a mesh with its compiled paged step."""

  def __init__(self, model_cfg: LlamaConfig, params, mesh: Mesh, rules: sharding.Rules,
               cache_length: int, page_size: int = DEFAULT_PAGE_SIZE, quantize: str = "none"):
    if not isinstance(model_cfg, LlamaConfig) or not model_cfg.causal:
      raise ValueError(f"the KV-cache engine generates with causal decoder LMs (LlamaConfig), "
                       f"not {type(model_cfg).__name__}; classifiers use toolkit.predict")
    if cache_length < 2:
      raise RequestError(f"cache_length={cache_length} must be >= 2 (prompt + new tokens)")
    if page_size < 1:
      raise RequestError(f"page_size={page_size} must be >= 1 (positions per cache page)")
    if quantize not in WEIGHT_FORMATS:
      raise RequestError(f"quantize={quantize!r} is unknown; choose one of "
                         f"{', '.join(WEIGHT_FORMATS)}")
    # A mixture of experts generates dropless whatever it trained with: capacity routing would
    # make a token's output depend on the other prompts in the batch and on the padding. XLA:CPU
    # lacks ragged_all_to_all; the ring computes the same outputs.
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    model_cfg = dataclasses.replace(model_cfg, moe_dispatch="dropless", **(
        {"expert_exchange": "ring"} if on_cpu else {}))
    self.model_cfg, self.mesh, self.rules, self.cache_length = model_cfg, mesh, rules, cache_length
    self.page_size, self.quantize = page_size, quantize
    self.pages_per_row = -(-cache_length // page_size)
    layout = state_lib.layout(model_cfg, optax.identity(), rules, mesh)
    self.graphdef, self.report = layout.graphdef, layout.report
    # Parameters that already sit in their shardings (restored) are not copied.
    self.params = convert_weights(jax.device_put(params, layout.shardings["params"]), layout,
                                  quantize, model_cfg.compute_dtype)
    batch_axes = [a for e in rules.activation_spec(("batch",), mesh) if e
                  for a in ((e,) if isinstance(e, str) else e)]
    self.batch_ways = int(np.prod([mesh.shape[a] for a in batch_axes]))
    self.cache_sharding = NamedSharding(mesh, rules.activation_spec(paged.CACHE_AXES, mesh))
    self.row_sharding = NamedSharding(mesh, rules.activation_spec(("batch",), mesh))
    self.traces: collections.Counter = collections.Counter()
    # With several processes each one reads every row's next token (the schedulers run the
    # same on all of them): replicated, a few bytes a row, instead of split over batch.
    tokens_out = (NamedSharding(mesh, jax.sharding.PartitionSpec()) if jax.process_count() > 1
                  else self.row_sharding)
    rows_out = (self.cache_sharding, tokens_out,
                NamedSharding(mesh, rules.activation_spec(("batch", "vocab"), mesh)))
    self._step = jax.jit(self._step_fn, donate_argnums=1, out_shardings=rows_out,
                         static_argnames="chunks")
    self._new_cache = jax.jit(lambda pages: init_paged_cache(self.model_cfg, pages, page_size),
                              static_argnums=0, out_shardings=self.cache_sharding)

  def _step_fn(self, params, cache, tokens, positions, tables, counts, last, rows, token_index,
               chunks):
    self.traces["step", tuple(t.shape[0] for t in tables), chunks, cache["k"].shape[2]] += 1
    return paged_step(self.graphdef, self.rules, self.mesh, params, cache, tokens, positions,
                      paged.Rows(tuple(tables), tuple(counts), chunks), last, rows, token_index)

  # --- host-side calls -----------------------------------------------------------------------
  def weight_bytes(self) -> int:
    """Bytes of the parameters as served (int8 values and their scales when quantized)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(self.params)))

  def describe_weights(self) -> str:
    """One line for start-up: the weights' bytes as served against bfloat16."""
    count = sum(int(np.prod(row.shape)) for row in self.report.rows)
    served = self.weight_bytes()
    label = "as restored" if self.quantize == "none" else self.quantize
    return (f"weights {human_bytes(served)} ({label}), {served / (2 * count):.2f}x their "
            f"{human_bytes(2 * count)} in bfloat16")

  def new_cache(self, pages: int):
    """An empty pool of `pages` pages (a multiple of the ways the mesh splits the batch)."""
    if pages < self.batch_ways or pages % self.batch_ways:
      raise RequestError(f"cache_pages={pages} must be a positive multiple of "
                         f"{self.batch_ways}, the number of ways the mesh splits the batch")
    return self._new_cache(pages)

  def check_request(self, prompt: np.ndarray, params: SamplingParams) -> None:
    """Raises RequestError naming what to fix when a request cannot run on this engine."""
    vocab = self.model_cfg.vocab_size
    params.validate(vocab)
    if len(prompt) == 0:
      raise RequestError("the prompt is empty; give at least one token")
    if prompt.min() < 0 or prompt.max() >= vocab:
      raise RequestError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt) + params.max_tokens > self.cache_length:
      raise RequestError(
          f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the cache "
          f"length {self.cache_length}; shorten the prompt or lower max_tokens")

  def check_batch_size(self, batch_size: int) -> None:
    if batch_size < 1 or batch_size % self.batch_ways:
      raise RequestError(
          f"batch_size={batch_size} must be a positive multiple of {self.batch_ways}, the "
          f"number of ways the mesh splits the batch; use e.g. {self.batch_ways * 4}")

  def prefill_rows(self, count: int, batch_size: int) -> int:
    """Rows of a step for `count` rows spread evenly over the devices: a power of two times
    the batch ways (so few shapes get compiled), at most the batch size."""
    return min(batch_size, self.batch_ways * _next_power_of_two(-(-count // self.batch_ways)))

  def prompt_bucket(self, length: int) -> int:
    return min(self.cache_length, max(MIN_PROMPT_BUCKET, _next_power_of_two(length)))

  def step(self, cache, groups: Sequence[tuple[Sequence[RowWork], int, int]]):
    """Runs groups of rows, each (rows, chunk, rows per device): at most `chunk` tokens per
    row, at most `rows per device` rows on each block of the pool (the rest idle). Returns
    (cache, next tokens (rows,), logits (rows, vocab), order): order[i] is the row of the
    i-th RowWork given, counting through the groups in order. A row's next token is sampled
    after its last token this step (for a prompt chunk that is not the prompt's end, it is
    not the request's)."""
    ways, width = self.batch_ways, self.pages_per_row
    per_device = sum(k * chunk for _, chunk, k in groups)
    tokens = np.zeros((ways, per_device), np.int32)
    positions = np.zeros((ways, per_device), np.int32)
    tables, counts, last, params, token_index, order = [], [], [], [], [], []
    offset = 0
    for items, chunk, k in groups:
      table = np.zeros((ways * k, width), np.int32)
      count = np.zeros(ways * k, np.int32)
      first_row = len(last)
      # Padding rows read their block's first token (count 0: they write nothing).
      last.extend(i * per_device + offset + j * chunk for i in range(ways) for j in range(k))
      params.extend([SamplingParams()] * (ways * k))
      token_index.extend([0] * (ways * k))
      used = [0] * ways
      for item in items:
        i, j = item.shard, used[item.shard]
        used[item.shard] += 1
        if j >= k or len(item.tokens) > chunk:
          raise ValueError(f"row of {len(item.tokens)} tokens on device block {i} does not "
                           f"fit {k} rows of {chunk} tokens")
        row, at, n = i * k + j, offset + j * chunk, len(item.tokens)
        tokens[i, at:at + n] = item.tokens
        positions[i, at:at + chunk] = item.start  # padding: a position the row already has
        positions[i, at:at + n] = item.start + np.arange(n)
        table[row, :len(item.pages)] = item.pages
        count[row] = n
        last[first_row + row] = i * per_device + at + n - 1
        params[first_row + row], token_index[first_row + row] = item.params, item.token_index
        order.append(first_row + row)
      tables.append(table)
      counts.append(count)
      offset += k * chunk
    put = lambda x: jax.device_put(x, self.row_sharding)
    cache, next_tokens, logits = self._step(
        self.params, cache, put(tokens.reshape(-1)), put(positions.reshape(-1)),
        tuple(put(t) for t in tables), tuple(put(c) for c in counts),
        put(np.asarray(last, np.int32)), put(sampling.row_arrays(params)),
        put(np.asarray(token_index, np.int32)), chunks=tuple(chunk for _, chunk, _ in groups))
    return cache, next_tokens, logits, np.asarray(order)


def convert_weights(params, layout: state_lib.StateLayout, quantize: str, compute_dtype):
  """`params` as served: unchanged ("none"), cast to bfloat16, or with the layer stack's
  matrices as Int8Weight (models/quantization.py), each array in its shardings (an int8
  weight's scales split like the weight along the dimensions they keep)."""
  if quantize == "none":
    return params
  convert, shardings = weight_format(layout, quantize, compute_dtype)
  return jax.jit(convert, out_shardings=shardings)(params)


def served_abstract(layout: state_lib.StateLayout, quantize: str, compute_dtype=jnp.bfloat16):
  """The served parameters' ShapeDtypeStructs with their shardings (for ahead-of-time
  compiles: nothing is allocated)."""
  if quantize == "none":
    return layout.abstract["params"]
  convert, shardings = weight_format(layout, quantize, compute_dtype)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      jax.eval_shape(convert, layout.abstract["params"]), shardings)


def weight_format(layout: state_lib.StateLayout, quantize: str, compute_dtype=jnp.bfloat16):
  """(the function from restored to served parameters, the served parameters' shardings).
  int8 keeps the parameters it does not quantize in the compute dtype, which is what the
  model casts them to when it uses them."""
  if quantize == "bfloat16":
    return (lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p),
            layout.shardings["params"])
  plan = {row.path: quantization.reduced_dims(row.path, row.logical_axes)
          for row in layout.report.rows}

  def scale_sharding(path: str, sharding_: NamedSharding):
    if plan[path] is None:
      return sharding_
    spec = list(sharding_.spec) + [None] * (len(plan_shapes[path]) - len(sharding_.spec))
    scale_spec = [None if d in plan[path] else e for d, e in enumerate(spec)]
    while scale_spec and scale_spec[-1] is None:  # the rules' spelling: no trailing Nones
      scale_spec.pop()
    scale_spec = PartitionSpec(*scale_spec)
    return quantization.Int8Weight(sharding_, NamedSharding(sharding_.mesh, scale_spec))

  plan_shapes = {row.path: row.shape for row in layout.report.rows}
  convert = lambda tree: _map_paths(lambda path, x: x.astype(compute_dtype) if plan[path] is None
                                    else quantization.quantize(x, plan[path]), tree)
  return convert, _map_paths(scale_sharding, layout.shardings["params"])


def _map_paths(fn, tree: dict, prefix: str = "") -> dict:
  """`tree` (nested dicts) with each leaf x replaced by fn(its "/"-joined path, x)."""
  return {key: _map_paths(fn, value, f"{prefix}{key}/") if isinstance(value, dict)
          else fn(f"{prefix}{key}", value) for key, value in tree.items()}



