"""Benchmark: the toolkit's train step against a bare hand-written `jax.jit` step.

  python scripts/bench/bench_step.py                                  # 8 simulated devices, fsdp
  python scripts/bench/bench_step.py --devices=1 --mesh=data:1        # one device
  python scripts/bench/bench_step.py --quick                          # seconds: the smoke test

One run measures, on one mesh and one batch:
  1. the f32 matmul peak: median time of a jitted 2048x2048 `jnp.dot` on one device. On CPU
     the simulated devices share the host's cores, so this is the whole machine's peak;
  2. the toolkit step, built the way `toolkit.training.run` builds it (resolve -> optimizer ->
     layout -> create -> make_train_step -> jit_step; scripts/bench/timing.py);
  3. a bare baseline: the same model and loss written directly in jax.numpy on the same
     params pytree, the same optax optimizer, jitted with the same shardings and donation,
     without extra metrics and with one sharding constraint only: the residual stream split
     along `batch` right after the embedding lookup. Without it (--nobare_batch_constraint)
     XLA propagates the fsdp split of the embedding table's `embed` dimension into the
     activations and computes the whole batch on every device: on 8 devices with fsdp that
     step does ~1.35x the FLOPs per device and ran ~4x slower, so it is no baseline to beat.
Before timing, the two losses must agree over a few steps from identical states. The steps
then alternate in rounds; the table gives median step time, tokens/s, model FLOP/s and its
fraction of the matmul peak (model FLOP/s per device over one device's peak: on an accelerator
the matmul's own, on CPU its 1/n share of the cores), and the ratio toolkit/bare against its
target.
"""
from __future__ import annotations

import functools
import json
import os
import re
import statistics
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from models import LlamaConfig
from scripts.bench import timing
from toolkit.training import config as config_lib, setup as setup_lib  # noqa: E402

TARGET_RATIO = 1.03          # toolkit step time / bare step time, at most
TARGET_PEAK_FRACTION = 0.60  # model FLOP/s / matmul peak, at least

_DEVICES = flags.DEFINE_integer(
    "devices", 8, "Simulated host devices (sets XLA_FLAGS unless it already names a count).")
_MESH = flags.DEFINE_string("mesh", "data:1,fsdp:-1,tensor:1", "config.mesh.ici")
_RULES = flags.DEFINE_string("rules", "fsdp", "Sharding preset: dp, fsdp, tp, fsdp_tp.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds; the two steps alternate per round.")
_STEPS_PER_ROUND = flags.DEFINE_integer("steps_per_round", 10, "Steps of each kind per round.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 3, "Untimed steps of each kind first.")
_CHECK_STEPS = flags.DEFINE_integer(
    "check_steps", 3, "Steps over which the losses must agree (3 covers one nonzero update: the "
    "learning rate starts at 0).")
_RTOL = flags.DEFINE_float("rtol", 1e-5, "Relative tolerance of the loss agreement check.")
_MATMUL_SIZE = flags.DEFINE_integer("matmul_size", 2048, "Side of the square f32 matmul.")
_MATMUL_REPEATS = flags.DEFINE_integer("matmul_repeats", 20, "Timed matmuls (median taken).")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_N_LAYERS = flags.DEFINE_integer("n_layers", 4, "Transformer blocks.")
_N_HEADS = flags.DEFINE_integer("n_heads", 4, "Query heads.")
_N_KV_HEADS = flags.DEFINE_integer("n_kv_heads", 4, "Key/value heads.")
_MLP_DIM = flags.DEFINE_integer("mlp_dim", 1024, "Feed-forward hidden width.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 32_000, "Vocabulary (synthetic tokens).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per sequence.")
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 8, "Sequences per step.")
_BARE_BATCH_CONSTRAINT = flags.DEFINE_bool(
    "bare_batch_constraint", True, "Constrain the bare step's residual stream to the batch "
    "split after the embedding lookup (its only sharding constraint).")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")
_QUICK = flags.DEFINE_bool(
    "quick", False, "Tiny model, matmul and rounds (seconds; for the smoke test). Flags given "
    "explicitly still win.")

# --quick: a 2-layer grouped-query model (so the bare GQA path is checked too), short timing.
_QUICK_VALUES = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64, vocab_size=256,
                     seq_len=32, global_batch_size=8, rounds=2, steps_per_round=2, warmup_steps=1,
                     check_steps=3, matmul_size=256, matmul_repeats=3)


# --- the bare baseline -------------------------------------------------------------------------

def bare_loss(cfg: LlamaConfig, params, batch: dict[str, jax.Array],
              residual_sharding: NamedSharding | None = None) -> jax.Array:
  """Mean next-token cross-entropy of the Llama in `models/llama.py`, written directly in
  jax.numpy on its params pytree (layers stacked on a leading axis, scanned). The residual
  stream is constrained to `residual_sharding` after the embedding lookup, if given."""
  dtype = jnp.dtype(cfg.compute_dtype)
  tokens = batch["inputs"]
  half = cfg.resolved_head_dim // 2
  inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(tokens.shape[1], dtype=jnp.float32)[:, None] * inv_freq  # (length, half)
  sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]  # broadcast over heads

  def rotary(x):  # rotate-half
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)

  def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
    return (x32 * scale.astype(jnp.float32)).astype(dtype)

  def block(x, p):
    attention, mlp = p["attention"], p["mlp"]
    h = rms_norm(x, p["attention_norm"]["scale"])
    q = rotary(jnp.einsum("bte,ehd->bthd", h, attention["wq"].astype(dtype)))
    k = rotary(jnp.einsum("bte,ehd->bthd", h, attention["wk"].astype(dtype)))
    v = jnp.einsum("bte,ehd->bthd", h, attention["wv"].astype(dtype))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # groups kv heads itself
    x = x + jnp.einsum("bthd,hde->bte", out, attention["wo"].astype(dtype))
    h = rms_norm(x, p["mlp_norm"]["scale"])
    hidden = jax.nn.silu(h @ mlp["w_gate"].astype(dtype)) * (h @ mlp["w_up"].astype(dtype))
    return x + hidden @ mlp["w_down"].astype(dtype), None

  x = jnp.take(params["embed"], tokens, axis=0).astype(dtype)
  if residual_sharding is not None:
    x = jax.lax.with_sharding_constraint(x, residual_sharding)
  x, _ = jax.lax.scan(block, x, params["layers"])
  x = rms_norm(x, params["final_norm"]["scale"])
  unembed = params["embed"].T if cfg.tie_embeddings else params["unembed"]
  logits = (x @ unembed.astype(dtype)).astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))


def make_bare_step(cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                   residual_sharding: NamedSharding | None = None):
  """(state, batch) -> (state, loss) on the toolkit's state pytree; no metrics beyond the loss."""
  if cfg.remat != "none":
    raise ValueError(f"the bare baseline has no remat; run with model.remat='none', not "
                     f"{cfg.remat!r}")

  def bare_step(state, batch):
    loss_fn = functools.partial(bare_loss, cfg, residual_sharding=residual_sharding)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {**state, "step": state["step"] + 1, "opt_state": opt_state,
            "params": optax.apply_updates(state["params"], updates)}, loss
  return bare_step


# --- measurements ------------------------------------------------------------------------------

def _cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis() or {}
  return {"flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def _check_same_math(steps: dict, states: dict, batch, check_steps: int, rtol: float) -> dict:
  """Runs both steps `check_steps` times; raises unless their losses agree within `rtol`."""
  losses = {"toolkit": [], "bare": []}
  for _ in range(check_steps):
    states["toolkit"], metrics = steps["toolkit"](states["toolkit"], batch)
    states["bare"], loss = steps["bare"](states["bare"], batch)
    losses["toolkit"].append(float(metrics["loss"]))
    losses["bare"].append(float(loss))
  if not np.allclose(losses["bare"], losses["toolkit"], rtol=rtol, atol=0):
    raise AssertionError(
        f"bare losses {losses['bare']} differ from toolkit losses {losses['toolkit']} beyond "
        f"rtol={rtol}: the baseline is not the same math, so its timing is not comparable")
  timing.progress(f"losses agree: {losses['toolkit']}")
  return losses


def _time_rounds(steps: dict, states: dict, batch, warmup_steps: int, rounds: int,
                 steps_per_round: int) -> dict[str, list[float]]:
  """Seconds per step of each round, the two steps alternating which goes first."""
  for name in steps:
    states[name], per_step = timing.run_steps(steps[name], states[name], batch, warmup_steps)
    timing.progress(f"warm-up {name}: {per_step * 1e3:.0f} ms/step")
  seconds = {name: [] for name in steps}
  for r in range(rounds):
    for name in (("toolkit", "bare") if r % 2 == 0 else ("bare", "toolkit")):  # cancel drift
      states[name], per_step = timing.run_steps(steps[name], states[name], batch,
                                                steps_per_round)
      seconds[name].append(per_step)
      timing.progress(f"round {r + 1}/{rounds} {name}: {per_step * 1e3:.0f} ms/step")
  return seconds


def benchmark(config: ml_collections.ConfigDict, *, rounds: int, steps_per_round: int,
              warmup_steps: int, check_steps: int, rtol: float, matmul_size: int,
              matmul_repeats: int, bare_batch_constraint: bool = True) -> dict:
  """Measures the matmul peak, then the toolkit and bare steps; returns plain numbers."""
  peak = setup_lib.matmul_flops_per_second(matmul_size, matmul_repeats)
  timing.progress(f"matmul peak {peak / 1e9:.1f} GFLOP/s")

  # The toolkit step, built by the same `toolkit.training.build` the training loop uses.
  built = timing.toolkit_step(config)
  setup, toolkit_compile_s = built.setup, built.compile_s
  mesh, rules, model_cfg = setup.spec.mesh, setup.spec.rules, setup.spec.model
  batches, optimizer, layout = setup.batches, setup.optimizer, setup.layout

  # The bare step: same in/out shardings and donation as `step.jit_step` gives the toolkit.
  abstract_batch = batches.abstract()
  residual_sharding = (NamedSharding(mesh, rules.activation_spec(("batch", "length", "embed"),
                                                                  mesh))
                       if bare_batch_constraint else None)
  start = time.perf_counter()
  bare_step = jax.jit(
      make_bare_step(model_cfg, optimizer, residual_sharding),
      in_shardings=(layout.shardings, jax.tree.map(lambda a: a.sharding, abstract_batch)),
      out_shardings=(layout.shardings, NamedSharding(mesh, PartitionSpec())),
      donate_argnums=0).lower(layout.abstract, abstract_batch).compile()
  bare_compile_s = time.perf_counter() - start
  timing.progress(f"compiled: toolkit {toolkit_compile_s:.1f} s, bare {bare_compile_s:.1f} s")

  # Identical states (a copy, not an alias: each step donates its own), one batch throughout.
  state, batch = built.state, built.batch
  states = {"toolkit": state, "bare": jax.device_put(state, layout.shardings, may_alias=False)}
  steps = {"toolkit": built.compiled, "bare": bare_step}

  losses = _check_same_math(steps, states, batch, check_steps, rtol)
  seconds = _time_rounds(steps, states, batch, warmup_steps, rounds, steps_per_round)
  peak_after = setup_lib.matmul_flops_per_second(matmul_size, matmul_repeats)

  tokens_per_step = config.data.global_batch_size * config.data.seq_len
  flops_per_step = model_cfg.flops_per_token(config.data.seq_len) * tokens_per_step
  devices = list(mesh.devices.flat)
  rows = {}
  for name, values in seconds.items():
    median = statistics.median(values)
    rows[name] = {"median_step_s": median, "round_step_s": values,
                  "tokens_per_second": tokens_per_step / median,
                  "model_flops_per_second": flops_per_step / median,
                  "fraction_of_matmul_peak": timing.peak_fraction(flops_per_step, median, peak,
                                                                  devices)}
  return {
      "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
      "mesh": dict(mesh.shape), "rules": rules.name,
      "model": {k: getattr(model_cfg, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                                   "mlp_dim", "vocab_size", "compute_dtype")},
      "seq_len": config.data.seq_len, "global_batch_size": config.data.global_batch_size,
      "tokens_per_step": tokens_per_step, "flops_per_step": flops_per_step,
      "matmul": {"size": matmul_size, "flops_per_second": peak,
                 "flops_per_second_after": peak_after},
      "bare_batch_constraint": bare_batch_constraint,
      "compile_s": {"toolkit": toolkit_compile_s, "bare": bare_compile_s},
      # XLA's own per-device counts: a timing-free check that both programs do the same work.
      "compiled_cost": {name: _cost(compiled) for name, compiled in steps.items()},
      "check_losses": losses, "rounds": rounds, "steps_per_round": steps_per_round,
      "results": rows,
      "ratio": rows["toolkit"]["median_step_s"] / rows["bare"]["median_step_s"],
      # Less sensitive to other load on the machine: rounds r of the two steps ran back to back;
      # the fastest rounds are the least disturbed.
      "paired_round_ratios": [t / b for t, b in zip(seconds["toolkit"], seconds["bare"])],
      "fastest_round_ratio": min(seconds["toolkit"]) / min(seconds["bare"]),
      "target_ratio": TARGET_RATIO, "target_peak_fraction": TARGET_PEAK_FRACTION,
  }


def format_report(r: dict) -> str:
  matmul = r["matmul"]
  lines = [
      f"devices {r['devices']} x {r['device_kind']}; mesh {r['mesh']}; rules {r['rules']}",
      f"model {r['model']}; batch {r['global_batch_size']} x {r['seq_len']} = "
      f"{r['tokens_per_step']} tokens, {r['flops_per_step'] / 1e9:.1f} GFLOP per step",
      f"matmul peak (f32 {matmul['size']}^2, one device): "
      f"{matmul['flops_per_second'] / 1e9:.1f} GFLOP/s "
      f"(after the steps: {matmul['flops_per_second_after'] / 1e9:.1f})",
      f"compile: toolkit {r['compile_s']['toolkit']:.1f} s, bare {r['compile_s']['bare']:.1f} s; "
      f"losses agree over {len(r['check_losses']['bare'])} steps: "
      f"{', '.join(f'{x:.6f}' for x in r['check_losses']['toolkit'])}",
      "compiled, per device (XLA counts the scanned layer body once): " + "; ".join(
          f"{name} {c['flops'] / 1e9:.4g} GFLOP, {c['bytes_accessed'] / 2**20:.0f} MiB accessed"
          for name, c in r["compiled_cost"].items()),
      f"{r['rounds']} rounds x {r['steps_per_round']} steps each, alternating; bare step "
      f"{'with' if r['bare_batch_constraint'] else 'without'} the batch constraint",
      "",
      f"{'':10}{'median step ms':>16}{'tokens/s':>12}{'model TFLOP/s':>15}"
      f"{'of matmul peak':>16}   rounds (ms)",
  ]
  for name, row in r["results"].items():
    lines.append(
        f"{name:10}{row['median_step_s'] * 1e3:16.1f}{row['tokens_per_second']:12.0f}"
        f"{row['model_flops_per_second'] / 1e12:15.4f}{row['fraction_of_matmul_peak']:16.1%}   "
        + " ".join(f"{s * 1e3:.0f}" for s in row["round_step_s"]))
  fraction = r["results"]["toolkit"]["fraction_of_matmul_peak"]
  lines += [
      "",
      f"ratio toolkit/bare: {r['ratio']:.3f} (target <= {r['target_ratio']}): "
      f"{'PASS' if r['ratio'] <= r['target_ratio'] else 'MISS'}",
      f"  cross-checks: median of per-round ratios "
      f"{statistics.median(r['paired_round_ratios']):.3f} (rounds: "
      f"{' '.join(f'{x:.2f}' for x in r['paired_round_ratios'])}); fastest rounds "
      f"{r['fastest_round_ratio']:.3f}",
      f"toolkit fraction of matmul peak: {fraction:.1%} (target >= "
      f"{r['target_peak_fraction']:.0%}): "
      f"{'PASS' if fraction >= r['target_peak_fraction'] else 'MISS'}",
  ]
  return "\n".join(lines)


# --- command line ------------------------------------------------------------------------------

def _set_device_count(devices: int) -> None:
  """Asks XLA for `devices` host devices. XLA reads XLA_FLAGS when JAX creates its CPU
  backend (the first device query), not at import, so this runs first thing in `main`."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    flag = f"--xla_force_host_platform_device_count={devices}"
    os.environ["XLA_FLAGS"] = f"{xla_flags} {flag}".strip()
  if jax.device_count() != devices:
    count = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ["XLA_FLAGS"])
    raise app.UsageError(
        f"--devices={devices} but JAX sees {jax.device_count()} device(s) (XLA_FLAGS asks for "
        f"{count.group(1) if count else 'none'}); unset XLA_FLAGS or pass a matching --devices")


def main(argv) -> None:
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.start()  # no TPU or GPU: JAX on the CPU, without libtpu's start-up lines
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _QUICK.value:
    for name, value in _QUICK_VALUES.items():
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value
  _set_device_count(_DEVICES.value)
  f = flags.FLAGS
  config = config_lib.defaults()
  config.model.update(d_model=f.d_model, n_layers=f.n_layers, n_heads=f.n_heads,
                      n_kv_heads=f.n_kv_heads, mlp_dim=f.mlp_dim, vocab_size=f.vocab_size,
                      head_dim=0, param_dtype="float32", compute_dtype="float32", remat="none")
  config.mesh.ici = _MESH.value
  config.sharding.preset = _RULES.value
  config.data.update(source="synthetic", seq_len=f.seq_len, global_batch_size=f.global_batch_size,
                     eval_batches=1)
  # The schedule spans exactly the steps each state takes.
  config.train.steps = f.check_steps + f.warmup_steps + f.rounds * f.steps_per_round
  results = benchmark(config, rounds=f.rounds, steps_per_round=f.steps_per_round,
                      warmup_steps=f.warmup_steps, check_steps=f.check_steps, rtol=f.rtol,
                      matmul_size=f.matmul_size, matmul_repeats=f.matmul_repeats,
                      bare_batch_constraint=f.bare_batch_constraint)
  print(format_report(results), flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as file:
      json.dump(results, file, indent=2)
    print(f"wrote {_JSON.value}")


if __name__ == "__main__":
  app.run(main)
