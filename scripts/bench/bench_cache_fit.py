"""Benchmark: how many requests run at once in a fixed KV cache budget, the paged cache against
the contiguous one (issue 31).

  python scripts/bench/bench_cache_fit.py          # ~2 min: the defaults, cache_length 2304
  python scripts/bench/bench_cache_fit.py --quick  # seconds: 16 short requests, cache_length 64

The budget is what a contiguous cache of --slots slots of --cache_length positions holds
(slots x cache_length positions, per layer, of k and of v). The contiguous cache reserves
cache_length positions for every request whatever it needs: it is run as the same engine with
pages of cache_length positions, one page per request, so --slots requests at most. The paged
cache holds the same positions in pages of --page_size, and a request takes the pages of its
prompt + max_tokens. Both get a random-length workload (prompt lengths uniform in
--input_len, output lengths in --output_len, random token ids, greedy; the defaults are
tests/toolkit/inference/test_scheduler.py's, which counts the same without a model),
all --num_prompts queued at once, and run to the end on one CPU device with the `cpu` model
(random weights: what fits does not depend on them) and up to --max_batch running requests;
reported: the most requests running in one step, and the steps and seconds it took.
"""
from __future__ import annotations

import json
import time

from absl import app, flags

_CACHE_LENGTH = flags.DEFINE_integer("cache_length", 2304, "Positions per contiguous slot: the "
                                     "longest request the server takes.", lower_bound=2)
_SLOTS = flags.DEFINE_integer("slots", 16, "Contiguous slots; the budget is slots x "
                              "cache_length positions.", lower_bound=1)
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Positions per page of the paged cache.",
                                  lower_bound=1)
_MAX_BATCH = flags.DEFINE_integer("max_batch", 128, "Running requests at most (the paged "
                                  "Batcher's batch_size).", lower_bound=1)
_INPUT_LEN = flags.DEFINE_list("input_len", ["32", "512"], "Prompt tokens: MIN,MAX.")
_OUTPUT_LEN = flags.DEFINE_list("output_len", ["32", "256"], "Output tokens: MIN,MAX.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 128, "Requests, all queued at once.",
                                    lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the lengths and token ids.")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON here.")
_QUICK = flags.DEFINE_bool("quick", False, "16 requests of 8-32 + 4-16 tokens, 4 slots of 64.")


def run(engine, batch_size: int, cache_pages: int, prompts, params) -> dict:
  """Queues every request, steps to the end; the most running at once."""
  from toolkit.inference.scheduler import Batcher, Request  # pylint: disable=g-import-not-at-top
  batcher = Batcher(engine, batch_size, cache_pages=cache_pages, prefix_caching=False)
  done = []
  for prompt, param in zip(prompts, params):
    batcher.submit(Request(prompt, param, done.append))
  peak, steps, start = 0, 0, time.perf_counter()
  while batcher.step():
    peak, steps = max(peak, batcher.active), steps + 1
  if len(done) != len(prompts) or any(r.finish_reason != "length" for r in done):
    raise SystemExit(f"error: {len(done)} of {len(prompts)} requests ended by length")
  return {"peak_running": peak, "steps": steps, "seconds": time.perf_counter() - start,
          "cache_positions": cache_pages * engine.page_size}


def main(argv) -> None:
  del argv
  if _QUICK.value:
    for name, value in (("cache_length", 64), ("slots", 4), ("input_len", ["8", "32"]),
                        ("output_len", ["4", "16"]), ("num_prompts", 16)):
      flags.FLAGS[name].value = value
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start()  # no TPU or GPU: JAX on the CPU, without libtpu's start-up lines
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  import sharding  # pylint: disable=g-import-not-at-top
  from models import Llama, LlamaConfig  # pylint: disable=g-import-not-at-top
  from toolkit.inference.engine import Engine  # pylint: disable=g-import-not-at-top
  from toolkit.inference.sampling import SamplingParams  # pylint: disable=g-import-not-at-top

  cfg = LlamaConfig.preset("cpu")
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(params=0)), nnx.Param))
  mesh = sharding.make_mesh([("fsdp", 1)], [], jax.devices()[:1])
  rules = sharding.Rules.preset("fsdp")
  rng = np.random.default_rng(_SEED.value)
  (in_lo, in_hi), (out_lo, out_hi) = ([int(v) for v in f.value]
                                      for f in (_INPUT_LEN, _OUTPUT_LEN))
  n = _NUM_PROMPTS.value
  prompts = [rng.integers(0, cfg.vocab_size, k).astype(np.int32)
             for k in rng.integers(in_lo, in_hi + 1, n)]
  params_ = [SamplingParams(max_tokens=int(m)) for m in rng.integers(out_lo, out_hi + 1, n)]
  length, slots, page = _CACHE_LENGTH.value, _SLOTS.value, _PAGE_SIZE.value
  results = {}
  for name, page_size, batch, pages in (
      ("contiguous", length, slots, slots),
      ("paged", page, _MAX_BATCH.value, slots * length // page)):
    engine = Engine(cfg, params, mesh, rules, length, page_size)
    results[name] = run(engine, batch, pages, prompts, params_)
    r = results[name]
    print(f"{name:<10} pages of {page_size:>4}, {r['cache_positions']:,} positions: at most "
          f"{r['peak_running']} requests running, {r['steps']} steps, {r['seconds']:.1f} s",
          flush=True)
  ratio = results["paged"]["peak_running"] / results["contiguous"]["peak_running"]
  print(f"paged / contiguous, most requests running in {slots} x {length} positions: "
        f"{ratio:.2f}x", flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"results": results, "ratio": ratio, "cache_length": length, "slots": slots,
                 "page_size": page, "input_len": [in_lo, in_hi],
                 "output_len": [out_lo, out_hi], "num_prompts": n}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
