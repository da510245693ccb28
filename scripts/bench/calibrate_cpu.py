"""Calibration: toolkit/planning/estimate.py's step time against the measured step on this CPU, for
three layouts on 8 simulated devices (issue 33, item 5; the table is in docs/compile.md).

  python scripts/bench/calibrate_cpu.py              # the three configs, 3 runs each: ~10 minutes
  python scripts/bench/calibrate_cpu.py --quick      # tiny shapes, seconds (what the test runs)

Each config is experiments/lm.py:size=1b's architecture at a width this CPU trains in seconds
(float32 compute: the CPU has no fast bfloat16 matmul), synthetic tokens, one micro-batch,
built as toolkit.training builds it (scripts/bench/timing.py). The measured time is the median of
ROUNDS rounds of STEPS steps after WARMUP untimed ones. The estimate is toolkit.compile's,
`estimate.step_seconds`: the executed FLOPs per device (remat recompute included) at the
matmul peak, plus the compiled program's memory traffic outside the matmuls
(`toolkit.planning.traffic`) at the memory bandwidth, plus the collectives' analytic bytes per
device. Both rates are measured beside each run, on all 8 simulated devices at once (they
share the host's cores and memory): the peak as float32 (1024 x 1024) matmuls, the
bandwidth as an elementwise update of 64 MiB per device (bytes read + written per second).
Simulated devices exchange through host memory, so the collectives move at the memory
bandwidth too. ratio = measured / estimated, the median over --repeats runs with its range;
the target is 0.75-1.25.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys

from absl import app, flags


_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes, seconds: checks the script runs.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Times each config is measured (the median "
                                "ratio is reported).")
_JSON = flags.DEFINE_string("json", "", "Also write the table as JSON to this path.")

TARGET = (0.75, 1.25)   # measured / estimated, issue 33's +-25 %
WARMUP, ROUNDS, STEPS = 2, 3, 3
BANDWIDTH_MIB, BANDWIDTH_CALLS = 64, 10


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  mesh: str            # mesh.ici
  preset: str          # sharding.preset
  model: dict          # fields of the 1b preset replaced
  batch: int
  seq_len: int
  remat: str


def _model(d_model: int, n_layers: int, heads: int) -> dict:
  return dict(vocab_size=8192, d_model=d_model, n_layers=n_layers, n_heads=heads,
              n_kv_heads=heads // 2, mlp_dim=4 * d_model, compute_dtype="float32",
              tie_embeddings=False)


CONFIGS = (
    Config("fsdp", "data:1,fsdp:8,tensor:1", "fsdp", _model(512, 4, 8), 16, 256, "none"),
    Config("fsdp_tp", "data:1,fsdp:4,tensor:2", "fsdp_tp", _model(768, 4, 12), 16, 256, "full"),
    Config("dp_fsdp", "data:2,fsdp:4,tensor:1", "fsdp", _model(1024, 2, 16), 16, 512, "minimal"),
)
QUICK = tuple(dataclasses.replace(c, model=_model(64, 2, 4), batch=8, seq_len=64)
              for c in CONFIGS)


def experiment(cfg: Config):
  """experiments/lm.py:size=1b at `cfg`'s sizes and layout."""
  from experiments import lm  # pylint: disable=g-import-not-at-top
  config = lm.get_config("size=1b")
  config.model.update(cfg.model, remat=cfg.remat)
  config.data.update(source="synthetic", global_batch_size=cfg.batch, seq_len=cfg.seq_len)
  config.mesh.update(ici=cfg.mesh, dcn="")
  config.sharding.preset = cfg.preset
  config.train.microbatches = 1
  return config


def memory_bytes_per_second(devices, mib: int = BANDWIDTH_MIB,
                            calls: int = BANDWIDTH_CALLS) -> float:
  """Bytes read + written per second per device by `x * a + b` over `mib` MiB of float32 on
  each of `devices` at once (the median of `calls` calls after one untimed)."""
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
  place = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("devices"))
  n = mib * 2**20 // 4
  x = jax.device_put(jnp.ones((len(devices), n), jnp.float32), place)
  update = jax.jit(lambda x: x * 1.0001 + 0.5)
  update(x).block_until_ready()
  seconds = []
  for _ in range(calls):
    start = time.perf_counter()
    update(x).block_until_ready()
    seconds.append(time.perf_counter() - start)
  return 2 * n * 4 / statistics.median(seconds)


def measure(cfg: Config, devices, peak: float, bandwidth: float) -> dict:
  """One config's measured and estimated seconds per step."""
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  from toolkit.planning import estimate, traffic  # pylint: disable=g-import-not-at-top
  config = experiment(cfg)
  built = timing.toolkit_step(config, devices)
  _, seconds = timing.time_step_rounds(built.compiled, built.state, built.batch, WARMUP,
                                       ROUNDS, STEPS)
  shape = estimate.shape_for(built.setup.spec, config, built.setup.layout.report)
  flops = estimate.executed_flops_per_device(shape)
  memory = traffic.memory_traffic(built.compiled.as_text())
  ici, dcn = estimate.communication(shape)
  estimated = estimate.step_seconds(flops, ici + dcn, 0.0, peak, bandwidth, 0.0,
                                    memory.memory_bytes, bandwidth)
  measured = statistics.median(seconds)
  return {"measured_s": measured, "estimated_s": estimated["total_s"],
          "compute_s": estimated["compute_s"], "memory_s": estimated["memory_s"],
          "collectives_s": estimated["ici_s"], "ratio": measured / estimated["total_s"],
          "flops_per_device": flops, "memory_bytes_per_device": memory.memory_bytes,
          "matmul_memory_bytes_per_device": memory.matmul_bytes,
          "collective_bytes_per_device": ici + dcn, "compile_s": built.compile_s}


def run(configs, repeats: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  from toolkit.training import setup as setup_lib  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  rows = []
  for cfg in configs:
    runs = []
    for i in range(repeats):
      # The peak beside each run: the machine's speed drifts over minutes.
      peak = setup_lib.matmul_flops_per_second(1024, 20, devices=devices)
      bandwidth = memory_bytes_per_second(devices)
      runs.append({**measure(cfg, devices, peak, bandwidth), "peak_flops_per_device": peak,
                   "memory_bytes_per_second": bandwidth})
      timing.progress(f"calibrate: {cfg.name} run {i + 1}/{repeats}: measured "
                      f"{runs[-1]['measured_s'] * 1e3:,.1f} ms, estimated "
                      f"{runs[-1]['estimated_s'] * 1e3:,.1f} ms at {peak / 1e9:.1f} GFLOP/s "
                      f"and {bandwidth / 1e9:.2f} GB/s per device")
    ratios = sorted(r["ratio"] for r in runs)
    rows.append({"config": dataclasses.asdict(cfg), "runs": runs,
                 "ratio": statistics.median(ratios), "ratio_min": ratios[0],
                 "ratio_max": ratios[-1],
                 "measured_s": statistics.median(r["measured_s"] for r in runs),
                 "estimated_s": statistics.median(r["estimated_s"] for r in runs),
                 **{k: statistics.median(r[k] for r in runs)
                    for k in ("compute_s", "memory_s", "collectives_s")},
                 "memory_bytes_per_device": runs[0]["memory_bytes_per_device"],
                 "collective_bytes_per_device": runs[0]["collective_bytes_per_device"],
                 "within_target": TARGET[0] <= statistics.median(ratios) <= TARGET[1]})
  rates = lambda key: statistics.median(run[key] for row in rows for run in row["runs"])
  return {"devices": len(devices), "platform": devices[0].platform, "jax": jax.__version__,
          "repeats": repeats, "target": TARGET, "rows": rows,
          "peak_flops_per_device": rates("peak_flops_per_device"),
          "memory_bytes_per_second": rates("memory_bytes_per_second")}


def format_table(result: dict) -> str:
  ms = lambda seconds: f"{seconds * 1e3:,.0f} ms"
  lines = [f"calibration on {result['devices']} simulated {result['platform']} devices, jax "
           f"{result['jax']}, median of {result['repeats']} runs; per device (medians): peak "
           f"{result['peak_flops_per_device'] / 1e9:.1f} GFLOP/s, memory "
           f"{result['memory_bytes_per_second'] / 1e9:.2f} GB/s; target ratio "
           f"{result['target'][0]}-{result['target'][1]}",
           "| config | mesh | model | tokens | remat | memory traffic / collectives per device "
           "| measured | estimated = compute + memory + collectives | ratio (range) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in result["rows"]:
    cfg = row["config"]
    model = cfg["model"]
    lines.append(
        f"| {cfg['name']} | {cfg['mesh'].replace(',', ' ')} | d {model['d_model']}, "
        f"{model['n_layers']} layers | {cfg['batch']} x {cfg['seq_len']} | {cfg['remat']} | "
        f"{row['memory_bytes_per_device'] / 2**30:,.2f} GiB / "
        f"{row['collective_bytes_per_device'] / 2**20:,.0f} MiB | {ms(row['measured_s'])} | "
        f"{ms(row['estimated_s'])} = {ms(row['compute_s'])} + {ms(row['memory_s'])} + "
        f"{ms(row['collectives_s'])} | {row['ratio']:.2f} ({row['ratio_min']:.2f}-"
        f"{row['ratio_max']:.2f}){'' if row['within_target'] else ' outside'} |")
  return "\n".join(lines)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _REPEATS.value < 1:
    raise app.UsageError(f"--repeats={_REPEATS.value}: give 1 or more")
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start(cpu_devices=(8, "the calibration's meshes"))
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "cpu" or jax.device_count() != 8:
    sys.exit(f"error: this calibrates the CPU's estimate on 8 simulated devices; found "
             f"{jax.device_count()} {jax.default_backend()} device(s). On a GPU, "
             f"scripts/dev/device_check.py has the estimate row")
  result = run(QUICK if _QUICK.value else CONFIGS, 1 if _QUICK.value else _REPEATS.value)
  print(format_table(result))
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
