"""Benchmark: the `xla` and `blockwise` attention implementations by sequence length (CPU).

  python scripts/bench/bench_attention.py                      # lengths 256 .. 4096
  python scripts/bench/bench_attention.py --lengths=128,256 --rounds=2 --heads=2   # seconds

Times one jitted forward + backward (the gradient of the output's sum with respect to q, k and
v) of causal self-attention on one device, float32, for each implementation and length; the
implementations alternate within each round and the table gives median milliseconds, the
ratio blockwise / xla, and the (batch, heads, q, k) float32 score tensor that `xla`
materializes and `blockwise` never does. `models.attention.BLOCKWISE_FROM`, where `auto`
switches from xla to blockwise off TPU and GPU, comes from this table.
"""
from __future__ import annotations

import json
import statistics

from absl import app, flags

_LENGTHS = flags.DEFINE_list("lengths", ["256", "512", "1024", "2048", "4096"],
                             "Sequence lengths (queries = keys).")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences.")
_HEADS = flags.DEFINE_integer("heads", 8, "Query heads (and key/value heads).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Features per head.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds; each times every implementation.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Calls per implementation per round.")
_JSON = flags.DEFINE_string("json", "", "Write the numbers as JSON here.")

IMPLEMENTATIONS = ("xla", "blockwise")


def timed_steps(length: int, batch: int, heads: int, head_dim: int):
  """Per implementation, a compiled forward+backward and its inputs (scripts/bench/timing.py)."""
  timing = _timing()
  inputs = timing.attention_inputs(batch, length, heads, heads, head_dim)
  return timing.attention_steps(inputs, IMPLEMENTATIONS), inputs


def _timing():
  """scripts/bench/timing.py, imported when the benchmark runs (it imports JAX)."""
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  return timing


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start()
  timing = _timing()

  rows = []
  for length in (int(n) for n in _LENGTHS.value):
    steps, inputs = timed_steps(length, _BATCH.value, _HEADS.value, _HEAD_DIM.value)
    times = timing.time_alternating(
        {name: (lambda step=step: step(*inputs)) for name, step in steps.items()},
        _ROUNDS.value, _REPEATS.value)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    scores = 4 * _BATCH.value * _HEADS.value * length * length
    rows.append({"length": length, "ms": ms, "ratio": ms["blockwise"] / ms["xla"],
                 "score_bytes": scores})
    print(f"length {length:6d}: xla {ms['xla']:9.1f} ms, blockwise {ms['blockwise']:9.1f} ms, "
          f"blockwise/xla {ms['blockwise'] / ms['xla']:.2f}, xla's scores "
          f"{scores / 2**20:,.1f} MiB", flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"batch": _BATCH.value, "heads": _HEADS.value, "head_dim": _HEAD_DIM.value,
                 "rounds": _ROUNDS.value, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
