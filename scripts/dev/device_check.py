"""Device check: what one GPU machine does with meshkit, measured in under 10 minutes, in one
table (issue 33, item 7).

  python scripts/dev/device_check.py                     # a GPU: the sizes below; no GPU: the dry run
  python scripts/dev/device_check.py --dry_run --json=/tmp/device_check.json   # tiny shapes, seconds

Rows, each timed after untimed warm-up calls (scripts/bench/timing.py, shared with the benchmarks):
  demo step        experiments/lm.py:cpu's train step, built as toolkit.training builds it; on
                   an odd number of GPUs its mesh's tensor:2 becomes tensor:1
  1b-shaped step   experiments/lm.py:size=1b's model in bfloat16 compute (all 16 layers, remat
                   full) at a batch one GPU holds: 16 x 2048 tokens (the pod config's is 512 x
                   2048) over fsdp on every GPU; MFU against the chip's dense bf16 peak from
                   toolkit/accelerators.py (`peak_flops_per_chip`)
  attention NAME   models/attention.py's xla, blockwise and cudnn (GPU only): causal, the 1b's
                   heads (32 query, 8 key/value, 64 wide), 2 x 4096 tokens in bfloat16; each
                   output against a float32 xla reference within ATTENTION_TOLERANCE, and the
                   time of one forward + backward
  decode (engine)  toolkit/inference's Engine on one device: the 1b-shaped model with bfloat16
                   weights, 64 rows decoding after a 128-token prompt (scripts/bench/bench_generate.py
                   times it the same way)
  estimate         toolkit/planning/estimate.py's step time for the 1b-shaped run (its Shape built
                   as the planner builds it; the compiled step's memory traffic at the GPU's
                   HBM bandwidth) against the measured step: measured / estimate
Bounds: every size above is fixed (the 1b-shaped run needs ~28 GiB by toolkit/planning/estimate.py,
and ~0.3 s of compute per step at an H100/H200's peak), each timed loop stops after ROW_SECONDS,
and a row that would start after --budget_s (default 9 minutes) is skipped and says so. A
compile cannot be cut short: the sizes are what bound it.

Without a GPU (or with --dry_run) every row runs for real at tiny shapes (a 2-layer 1b-shaped
model, 256-token attention, the demo at 8 x 64 tokens), in seconds on a CPU; cudnn says "not on
this platform". On the CPU the peak behind MFU and the estimate is the measured float32 matmul
shared by the simulated devices, and communication between them is not timed. Exit status 1
when a row failed (its error is in the table).
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
import traceback

from absl import app, flags


_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Tiny shapes, seconds (the default without a "
                             "GPU).")
_JSON = flags.DEFINE_string("json", "", "Also write the table as JSON to this path.")
_BUDGET_S = flags.DEFINE_float("budget_s", 540.0, "Seconds after which rows not yet started "
                               "are skipped.")

ROW_SECONDS = 30.0           # each timed loop stops after this many seconds (one round at least)
ATTENTION_TOLERANCE = 2e-2   # |out - float32 reference| <= tol + tol * |reference|, elementwise:
                             # a bfloat16 output alone is rounded by up to 2^-9 of its value


@dataclasses.dataclass(frozen=True)
class Sizes:
  demo_data: tuple[int, int] | None    # (global batch, seq_len); None: the demo's own 32 x 128
  big_model: dict                      # fields of the 1b preset replaced
  big_data: tuple[int, int]            # (global batch, seq_len)
  attention: tuple[int, int, int, int, int]  # batch, length, heads, kv_heads, head_dim
  decode: tuple[int, int, int, int]    # rows, prompt tokens, decode steps, cache length
  rounds: int                          # timed rounds (fewer once ROW_SECONDS are spent)
  steps_per_round: int
  warmup_steps: int


GPU_SIZES = Sizes(demo_data=None, big_model={}, big_data=(16, 2048),
                  attention=(2, 4096, 32, 8, 64), decode=(64, 128, 64, 256), rounds=3,
                  steps_per_round=5, warmup_steps=2)
DRY_SIZES = Sizes(demo_data=(8, 64),
                  big_model=dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1,
                                 mlp_dim=256),
                  big_data=(8, 64), attention=(1, 256, 4, 1, 16), decode=(4, 8, 8, 32),
                  rounds=2, steps_per_round=2, warmup_steps=1)
ATTENTION = ("xla", "blockwise", "cudnn")


def _row(check: str, setup: str, **fields) -> dict:
  """A row of the table: its name, what ran, status ok unless said, time_s, result, numbers."""
  return {"check": check, "setup": setup, "status": "ok", "time_s": None, "result": "",
          **fields}


def _mesh_text(mesh) -> str:
  return " x ".join(f"{name} {size}" for name, size in mesh.shape.items() if size > 1) or "1 device"


def _time_train(built, sizes: Sizes) -> float:
  """Median seconds per step of a toolkit step (timing.ToolkitStep), bounded by ROW_SECONDS."""
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  _, seconds = timing.time_step_rounds(built.compiled, built.state, built.batch,
                                       sizes.warmup_steps, sizes.rounds, sizes.steps_per_round,
                                       ROW_SECONDS)
  built.state = None  # donated into the steps above; drops the last reference
  return statistics.median(seconds)


# --- the rows ----------------------------------------------------------------------------------

def demo_row(sizes: Sizes, devices) -> dict:
  from experiments import lm  # pylint: disable=g-import-not-at-top
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  config = lm.get_config("cpu")
  if len(devices) % 2:  # the demo's tensor:2 needs an even count
    config.mesh.ici = "data:1,fsdp:-1,tensor:1"
  if sizes.demo_data:
    config.data.update(global_batch_size=sizes.demo_data[0], seq_len=sizes.demo_data[1])
  built = timing.toolkit_step(config, devices)
  step_s = _time_train(built, sizes)
  tokens = config.data.global_batch_size * config.data.seq_len
  return _row("demo step", f"lm.py:cpu, {config.data.global_batch_size} x "
              f"{config.data.seq_len} tokens, {_mesh_text(built.setup.spec.mesh)}",
              time_s=step_s, tokens_per_second=tokens / step_s, compile_s=built.compile_s,
              result=f"{tokens / step_s:,.0f} tokens/s (compile {built.compile_s:.1f} s)")


def big_config(sizes: Sizes):
  """experiments/lm.py:size=1b at `sizes`: one micro-batch of synthetic tokens."""
  from experiments import lm  # pylint: disable=g-import-not-at-top
  config = lm.get_config("size=1b")
  config.model.update(sizes.big_model)
  config.data.update(source="synthetic", global_batch_size=sizes.big_data[0],
                     seq_len=sizes.big_data[1])
  config.train.microbatches = 1
  return config


def big_row(sizes: Sizes, devices, peak: tuple[float, str]) -> tuple[dict, dict]:
  """The 1b-shaped step's row, and what the estimate row needs (setup, config, step_s, the
  compiled step's memory traffic)."""
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  from toolkit.planning import traffic  # pylint: disable=g-import-not-at-top
  config = big_config(sizes)
  built = timing.toolkit_step(config, devices)
  model = built.setup.spec.model
  step_s = _time_train(built, sizes)
  batch, seq_len = sizes.big_data
  tokens, mesh = batch * seq_len, built.setup.spec.mesh
  flops = model.flops_per_token(seq_len) * tokens
  mfu = flops / mesh.size / step_s / peak[0] if peak[0] else float("nan")
  setup = (f"{model.n_layers} layers, d {model.d_model}, vocab {model.vocab_size:,}, "
           f"{batch} x {seq_len}, {model.compute_dtype}, remat {model.remat}, "
           f"{_mesh_text(mesh)}")
  row = _row("1b-shaped step", setup, time_s=step_s, tokens_per_second=tokens / step_s,
             model_flops_per_step=flops, mfu=mfu, peak_flops_per_device=peak[0],
             peak_source=peak[1], compile_s=built.compile_s,
             result=f"{tokens / step_s:,.0f} tokens/s, MFU {mfu:.1%} of "
                    f"{_flops_text(peak[0])} per device ({peak[1]})")
  memory = traffic.memory_traffic(built.compiled.as_text())
  return row, {"setup": built.setup, "config": config, "step_s": step_s, "memory": memory}


def attention_rows(sizes: Sizes) -> list[dict]:
  """One row per implementation: output against a float32 reference, forward + backward time."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from models import attention  # pylint: disable=g-import-not-at-top
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  batch, length, heads, kv_heads, head_dim = sizes.attention
  inputs = timing.attention_inputs(batch, length, heads, kv_heads, head_dim, jnp.bfloat16)
  setup = f"causal, {batch} x {length}, heads {heads}/{kv_heads} x {head_dim}, bfloat16, fwd+bwd"
  with jax.default_matmul_precision("highest"):  # no TF32 in the reference
    reference = jax.jit(lambda q, k, v: attention.attend(q, k, v, True, "xla"))(
        *(x.astype(jnp.float32) for x in inputs))
  on_gpu = jax.default_backend() == "gpu"
  names = [name for name in ATTENTION if name != "cudnn" or on_gpu]
  rows, steps = {}, {}
  for name in names:
    try:
      steps[name] = timing.attention_steps(inputs, [name])[name]
      error = jnp.abs(steps[name](*inputs)[0].astype(jnp.float32) - reference)
      equal = bool(jnp.all(error <= ATTENTION_TOLERANCE * (1 + jnp.abs(reference))))
      rows[name] = _row(f"attention {name}", setup, max_abs_error=float(error.max()),
                        tolerance=ATTENTION_TOLERANCE, equal=equal,
                        status="ok" if equal else "failed")
    except Exception as e:  # pylint: disable=broad-except  # cuDNN may refuse: say so, go on
      rows[name] = _failed(f"attention {name}", setup, e)
  times = timing.time_alternating({n: (lambda s=s: s(*inputs)) for n, s in steps.items()},
                                  sizes.rounds, 3, ROW_SECONDS)
  for name, seconds in times.items():
    row = rows[name]
    row["time_s"] = statistics.median(seconds)
    row["result"] = (f"max |out - f32 ref| {row['max_abs_error']:.1e} (tol "
                     f"{ATTENTION_TOLERANCE:g} + {ATTENTION_TOLERANCE:g} |ref|): "
                     f"{'equal' if row['equal'] else 'not equal'}")
  if not on_gpu:
    rows["cudnn"] = _row("attention cudnn", setup, status="not on this platform",
                         result=f"cuDNN runs on NVIDIA GPUs; this is {jax.default_backend()}")
  return [rows[name] for name in ATTENTION]


def decode_row(sizes: Sizes, devices) -> dict:
  """The serving engine's decode tokens/s on one device (the 1b-shaped model)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from models import LlamaConfig  # pylint: disable=g-import-not-at-top
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  from toolkit.inference import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top
  rows, prompt, steps, cache_length = sizes.decode
  cfg = LlamaConfig.preset("1b", **sizes.big_model)
  mesh = sharding.make_mesh([("data", 1)], [], devices[:1])
  params = jax.jit(state_lib.init_params, static_argnums=0)(cfg, 0)
  engine = engine_lib.Engine(cfg, params, mesh, sharding.Rules.preset("dp"), cache_length,
                             quantize="bfloat16")
  del params
  step_s = timing.time_decode(engine, rows, prompt, steps, sizes.rounds,
                              np.random.default_rng(0))
  return _row("decode (engine)", f"1b-shaped, {cfg.n_layers} layers, bfloat16 weights, {rows} "
              f"rows, prompt {prompt}, {steps} steps, cache {cache_length}, 1 device",
              time_s=step_s, tokens_per_second=rows / step_s,
              result=f"{rows / step_s:,.0f} tokens/s ({step_s * 1e3:.2f} ms per step)")


def estimate_row(big: dict, peak: tuple[float, str]) -> dict:
  """toolkit/planning/estimate.py's step time for the 1b-shaped run against its measured step."""
  from toolkit import accelerators  # pylint: disable=g-import-not-at-top
  from toolkit.planning import estimate  # pylint: disable=g-import-not-at-top
  setup, config = big["setup"], big["config"]
  shape = estimate.shape_for(setup.spec, config, setup.layout.report)
  kind = setup.spec.mesh.devices.flat[0].device_kind
  gpu = next((g for g in accelerators.GPU_TYPES.values() if g.device_kind == kind), None)
  ici, dcn = estimate.communication(shape)
  seconds = estimate.step_seconds(
      estimate.executed_flops_per_device(shape), ici, dcn, peak[0],
      gpu.ici_bytes_per_second_per_chip if gpu else 0.0,
      gpu.dcn_bytes_per_second_per_chip if gpu else 0.0,
      big["memory"].memory_bytes, gpu.hbm_bytes_per_second_per_chip if gpu else 0.0)
  ratio = big["step_s"] / seconds["total_s"]
  return _row("estimate", f"toolkit/planning/estimate.py for the 1b-shaped step (attention "
              f"{shape.attention}, its peak)", time_s=seconds["total_s"],
              estimate=seconds, measured_s=big["step_s"], ratio=ratio,
              result=f"measured {big['step_s'] * 1e3:,.1f} ms / estimated "
                     f"{seconds['total_s'] * 1e3:,.1f} ms (compute "
                     f"{seconds['compute_s'] * 1e3:,.1f}, memory "
                     f"{seconds['memory_s'] * 1e3:,.1f}, communication "
                     f"{(seconds['ici_s'] + seconds['dcn_s']) * 1e3:,.1f}) = {ratio:.2f}")


# --- the run -----------------------------------------------------------------------------------

def peak_per_device(devices) -> tuple[float, str]:
  """(FLOP/s, where it comes from): the table's dense bf16 peak of the chip, else (the CPU, a
  chip the table lacks) the measured float32 matmul, shared by simulated CPU devices."""
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  from toolkit import accelerators  # pylint: disable=g-import-not-at-top
  from toolkit.training import setup as setup_lib  # pylint: disable=g-import-not-at-top
  kind = devices[0].device_kind
  table = accelerators.peak_flops_per_chip(kind)
  if table:
    return table, f"dense bf16 peak of {kind}, toolkit/accelerators.py"
  measured = timing.per_device_peak(setup_lib.matmul_flops_per_second(1024, 5, devices[0]),
                                    devices)
  if devices[0].platform == "cpu":
    return measured, f"measured f32 matmul / {len(devices)} devices"
  return measured, f"measured f32 matmul; {kind!r} is not in toolkit/accelerators.py"


def _flops_text(flops_per_second: float) -> str:
  if flops_per_second >= 1e12:
    return f"{flops_per_second / 1e12:.4g} TFLOP/s"
  return f"{flops_per_second / 1e9:.4g} GFLOP/s"


def _failed(check: str, setup: str, error: Exception) -> dict:
  traceback.print_exc()
  message = (str(error).strip().splitlines() or [""])[0][:160]
  return _row(check, setup, status="failed", result=f"{type(error).__name__}: {message}")


def run(dry_run: bool, budget_s: float = math.inf) -> dict:
  """Every row (module docstring) at the dry or the GPU sizes; returns the table as data."""
  import jax  # pylint: disable=g-import-not-at-top
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  start, devices = time.perf_counter(), jax.devices()
  sizes = DRY_SIZES if dry_run else GPU_SIZES
  peak = peak_per_device(devices)
  rows, big = [], {}

  def big_step() -> list[dict]:
    row, big["run"] = big_row(sizes, devices, peak)
    return [row]

  stages = (("demo step", lambda: [demo_row(sizes, devices)]),
            ("1b-shaped step", big_step),
            ("attention", lambda: attention_rows(sizes)),
            ("decode (engine)", lambda: [decode_row(sizes, devices)]),
            ("estimate", lambda: [estimate_row(big["run"], peak)]))
  for check, stage in stages:
    if time.perf_counter() - start > budget_s:
      rows.append(_row(check, "", status="skipped", result=f"--budget_s={budget_s:g} spent"))
    elif check == "estimate" and "run" not in big:
      rows.append(_row(check, "", status="skipped", result="no measured 1b-shaped step"))
    else:
      began = time.perf_counter()
      timing.progress(f"device check: {check} ...")
      try:
        rows.extend(stage())
      except Exception as e:  # pylint: disable=broad-except  # the table still prints
        rows.append(_failed(check, "", e))
      timing.progress(f"device check: {check} took {time.perf_counter() - began:.1f} s")
  return {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
          "devices": len(devices), "jax": jax.__version__, "dry_run": dry_run,
          "seconds": time.perf_counter() - start, "rows": rows}


def format_table(result: dict) -> str:
  """The table: a heading line, then check | setup | time | result."""
  head = (f"device check: {result['devices']} x {result['device_kind']} "
          f"({result['platform']}), jax {result['jax']}, "
          f"{'dry run (tiny shapes)' if result['dry_run'] else 'full sizes'}, "
          f"{result['seconds']:.0f} s")
  lines = [("check", "setup", "time", "result")]
  for row in result["rows"]:
    time_s = row["time_s"]
    shown = ("-" if time_s is None else
             f"{time_s * 1e3:,.2f} ms" if time_s < 1 else f"{time_s:,.2f} s")
    text = row["result"] if row["status"] == "ok" else f"{row['status']}: {row['result']}"
    lines.append((row["check"], row["setup"], shown, text))
  widths = [max(len(line[i]) for line in lines) for i in range(3)]
  return "\n".join([head] + ["  ".join([*(c.ljust(w) for c, w in zip(line, widths)),
                                        line[3]]).rstrip() for line in lines])


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  # No GPU: the CPU, with the 8 devices the demo's mesh (fsdp x tensor:2) is made for.
  runtime.start(cpu_devices=(8, "the demo's mesh"))
  import jax  # pylint: disable=g-import-not-at-top
  dry_run = _DRY_RUN.value
  if jax.default_backend() != "gpu" and not dry_run:
    print(f"no GPU here ({jax.default_backend()}): the dry run, tiny shapes on "
          f"{jax.device_count()} {jax.default_backend()} device(s)", flush=True)
    dry_run = True
  result = run(dry_run, _BUDGET_S.value)
  print(format_table(result), flush=True)
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2, default=str)
    print(f"wrote {_JSON.value}")
  if any(row["status"] == "failed" for row in result["rows"]):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
