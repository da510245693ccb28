"""Population training: K trials that differ only in values (not shapes) in ONE compiled program.

Every leaf of the train state gets a leading `trial` axis (logical name `trial`, split over the
`population` mesh axis by every rules preset); the model's own sharding stays on the remaining
mesh axes. With LoRA (model.lora_rank > 0) the frozen base is the exception: one copy, without a
trial axis, that every trial's adapters apply to (`shared_leaves`); it comes from
`train.init_from` (read once) or else from the seed, which the trials must then share. The per-trial hyperparameters are arrays of shape (K,) passed into the step, so the
program is compiled once for all K trials, and the step is the single-run step
(`toolkit.training.step.make_train_step`) under `jax.vmap`:

  mesh    population:P x (the experiment's own axes on devices / P)
  state   {"step": (K,), "params": (K, ...), "opt_state": (K, ...), "rng": (K, 2)}
  step    vmap(single-trial step)(state, hparams, batch) -> (state, metrics of shape (K,))

Values that can differ between the trials of one population (`VALUE_FIELDS`): peak learning
rate, minimum learning-rate ratio, warmup length, weight decay, Adam b1/b2/eps, the clipping
norm, the init scale `model.init_std`, `seed` (initialization and data order: with
different seeds each trial gets its own batch), and LoRA's `model.lora_alpha` and
`model.lora_dropout`. Anything else that differs is refused with the
field's name; fields that change a shape say so.

Each trial keeps the layout of a single run in its own workdir (config.json, metrics.jsonl,
checkpoints/), so any trial continues as an ordinary `python -m toolkit.train` run.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
import types
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding

import sharding
from models import lora
from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.training import metrics as metrics_lib, state as state_lib
from toolkit.training.checkpoints import checkpoint
from toolkit.training import step as step_lib
from toolkit.training import setup as setup_lib
from toolkit.tuning import trial_state
from toolkit.tuning.trial_state import TrialLayout

# Config fields that enter the step (or the init) as values: field -> dtype of its array.
VALUE_FIELDS: dict[str, type] = {
    "optimizer.learning_rate": jnp.float32,
    "optimizer.min_lr_ratio": jnp.float32,
    "optimizer.warmup_steps": jnp.int32,
    "optimizer.weight_decay": jnp.float32,
    "optimizer.b1": jnp.float32,
    "optimizer.b2": jnp.float32,
    "optimizer.eps": jnp.float32,
    "optimizer.clip_norm": jnp.float32,
    "model.init_std": jnp.float32,
    "seed": jnp.int32,
    "model.lora_alpha": jnp.float32,
    "model.lora_dropout": jnp.float32,
}
# Fields that change an array's shape or dtype (so the program itself).
SHAPE_FIELDS = ({f"model.{name}" for name in checkpoint.SHAPE_FIELDS}
                | {"model.compute_dtype", "data.seq_len", "data.global_batch_size",
                   "data.eval_batches", "train.microbatches", "mesh.ici", "mesh.dcn"})


def _flat(config: ml_collections.ConfigDict) -> dict:
  flat = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      flat.update({f"{key}.{k}": v for k, v in _flat(value).items()})
    else:
      flat[key] = value
  return flat


def varying_fields(configs: Sequence[ml_collections.ConfigDict]) -> list[str]:
  """The fields whose values differ between `configs`, refusing any that a population cannot
  hold: the error names the field and says whether it changes a shape."""
  # The trials' init and per-trial values (init_std, LoRA alpha and dropout) are the language
  # model's: a ViT population once failed with a KeyError deep in build. --mode=auto (runner.
  # choose_mode) reads this error as "processes".
  kind = configs[0].model.get("kind", "llama")
  if kind != "llama":
    raise ConfigError(f"population mode: model.kind={kind!r}: a population trains the language "
                      f"model (model.kind='llama') only; run this sweep with --mode=processes")
  flats = [_flat(c) for c in configs]
  varying = sorted(k for k in flats[0] if any(f.get(k) != flats[0][k] for f in flats[1:]))
  for field in varying:
    if field in VALUE_FIELDS:
      continue
    values = ", ".join(sorted({repr(f.get(field)) for f in flats}))
    why = ("changes a shape (every trial of a population must have the same array shapes)"
           if field in SHAPE_FIELDS or field.startswith("model.") else
           "is not a per-trial value of the compiled step (those are: "
           f"{', '.join(VALUE_FIELDS)})")
    raise ConfigError(f"population mode: the trials differ in {field} ({values}), which {why}; "
                      f"run this sweep with --mode=processes, or keep {field} fixed")
  return varying


def population_axis_size(trials: int, ici: str, devices: int) -> int:
  """The largest P dividing both the trial count and the device count for which the
  experiment's mesh `ici` still fits on devices / P (its fixed sizes divide that)."""
  pairs = sharding.parse_axis_sizes(ici, "mesh.ici")
  fixed = math.prod(size for _, size in pairs if size != -1)
  wildcard = any(size == -1 for _, size in pairs)
  for size in range(min(trials, devices), 0, -1):
    if trials % size or devices % size:
      continue
    left = devices // size
    if (wildcard and left % fixed == 0) or (not wildcard and left == fixed):
      return size
  raise ConfigError(f"mesh.ici={ici!r} does not fit on {devices} devices; for a population its "
                    f"sizes must divide the devices (use -1 for one axis)")


def schedule_from(hparams: dict[str, jax.Array], total_steps: int) -> Callable:
  """`step.learning_rate_schedule` with the peak, warmup and floor as (traced) arrays: linear
  warmup from 0, then cosine decay to peak * min_lr_ratio, written as optax writes it."""
  peak = hparams["optimizer.learning_rate"]
  warmup = jnp.minimum(hparams["optimizer.warmup_steps"], max(total_steps - 1, 0))
  decay = jnp.maximum(total_steps, warmup + 1) - warmup
  # optax: alpha = 0 for a peak of 0 (a learning rate of 0 is allowed), else end / peak.
  alpha = jnp.where(peak == 0, 0.0, peak * hparams["optimizer.min_lr_ratio"] / peak)

  def schedule(count):
    ramp = jnp.clip(count, 0, warmup) / jnp.maximum(warmup, 1)
    warm = -peak * (1 - ramp) + peak
    cosine = 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(count - warmup, decay) / decay))
    return jnp.where(count < warmup, warm, peak * ((1 - alpha) * cosine + alpha))
  return schedule


@dataclasses.dataclass(frozen=True)
class Population:
  """A population's compiled pieces (everything but the state's values)."""
  setup: setup_lib.Setup              # of the first trial, on the population mesh
  size: int                           # K trials
  hparams: dict[str, jax.Array]       # field -> (K,) array, split over `population`
  abstract: dict                      # the population state, with shardings
  shardings: dict
  shared_data: bool                   # one batch for all trials (all seeds equal)
  trial_batches: list                 # data.Batches per trial (seeds differ) or [shared]
  train_step: Callable                # (state, hparams, batch) -> (state, metrics (K,))
  eval_step: Callable                 # (state, hparams, batch) -> losses (K,)
  init: Callable                      # () -> state
  take: Callable                      # (state, i) -> trial i's state, in a single-run layout
  stack: Callable                     # (*single states) -> state
  trial_layout: TrialLayout           # which leaves have the trial axis (not a LoRA base)

  @property
  def mesh(self):
    return self.setup.spec.mesh

  def batch(self, step: int):
    return self._gather([b.batch(step) for b in self.trial_batches])

  def batches_from(self, start: int) -> Iterator:
    """The training batches from step `start` on, as `batch` gives them, through each
    source's iterator (a packed source, such as chat data, then packs each batch once)."""
    iterators = [b.iterator(start, prefetch=0) for b in self.trial_batches]
    try:
      while True:
        yield self._gather([next(it) for it in iterators])
    finally:
      for it in iterators:
        it.close()

  def eval_batch(self, index: int):
    return self._gather([b.eval_batch(index) for b in self.trial_batches])

  def _gather(self, batches):
    return batches[0] if self.shared_data else self.stack_batches(*batches)

  def stack_batches(self, *batches):
    return _stacker(self.mesh, self.setup.spec.rules)(*batches)


_STACKERS: dict = {}


def _stacker(mesh, rules):
  key = (mesh, rules)
  if key not in _STACKERS:
    spec = rules.activation_spec(("trial", "batch", None), mesh)
    _STACKERS[key] = jax.jit(lambda *bs: jax.tree.map(lambda *x: jnp.stack(x), *bs),
                             out_shardings=NamedSharding(mesh, spec))
  return _STACKERS[key]


def _with(config: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
  """A copy of `config` with top-level `fields` replaced."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.update(fields)
  return config


def population_config(configs: Sequence[ml_collections.ConfigDict], devices: int,
                      axis_size: int = 0) -> ml_collections.ConfigDict:
  """The first trial's config on a mesh with a leading `population` axis (of `axis_size`, or
  by default the largest that fits: `population_axis_size`)."""
  config = ml_collections.ConfigDict(configs[0].to_dict())
  size = axis_size or population_axis_size(len(configs), config.mesh.ici, devices)
  config.mesh.ici = f"population:{size}," + config.mesh.ici
  return config


def build(configs: Sequence[ml_collections.ConfigDict], devices=None,
          axis_size: int = 0) -> Population:
  """Validates that `configs` can share a program and builds it (compiles lazily, once)."""
  devices = list(jax.devices() if devices is None else devices)
  fields = varying_fields(configs)
  config = population_config(configs, len(devices), axis_size)
  setup = setup_lib.build(config, devices)
  if setup.layout.reference:
    raise ConfigError(f"population mode: {setup.task.name}.reference holds a frozen copy of the "
                      f"starting weights, one per trial; use a LoRA model's base or "
                      f"dpo.reference='precomputed', or run this sweep with --mode=processes")
  mesh, rules = setup.spec.mesh, setup.spec.rules
  k = len(configs)
  flats = [_flat(c) for c in configs]
  trial_sharding = NamedSharding(mesh, rules.param_spec(("trial",), mesh, (k,), "trial axis"))
  hparams = {field: jax.device_put(np.array([f[field] for f in flats], dtype), trial_sharding)
             for field, dtype in VALUE_FIELDS.items()}
  shared_data = "seed" not in fields
  trial_batches = [setup.batches]
  if not shared_data:  # each trial its own batches, as its own run would draw them
    trial_batches = [setup_lib.build(_with(config, seed=int(f["seed"])), devices).batches
                     for f in flats]

  layout = TrialLayout.of(setup.layout, k)
  _check_shared_base(config, fields, layout)
  train_step, eval_step = _vmapped_steps(config, setup, layout, trial_sharding, shared_data,
                                         fields)
  init = trial_state.initializer(config, setup, layout, hparams,
                                 vary="model.init_std" in fields)
  return Population(
      setup=setup, size=k, hparams=hparams, abstract=layout.abstract,
      shardings=layout.shardings, shared_data=shared_data, trial_batches=trial_batches,
      train_step=train_step, eval_step=eval_step, init=init, take=layout.take_fn(),
      stack=layout.stack_fn(), trial_layout=layout)


def _check_shared_base(config, fields: list[str], layout: TrialLayout) -> None:
  """A LoRA population trains every trial on one frozen base: refuses trials whose own runs
  would each draw a different one."""
  if not layout.shares:
    return
  if "model.init_std" in fields:
    raise ConfigError("population mode with LoRA holds one frozen base for all trials: the "
                      "trials differ in model.init_std, which only draws the base; keep it "
                      "fixed, or run this sweep with --mode=processes")
  if "seed" in fields and not config.train.get("init_from", ""):
    raise ConfigError("population mode with LoRA holds one frozen base for all trials: the "
                      "trials differ in seed and have no train.init_from, so each of their "
                      "runs would draw its own random base; set train.init_from=hf:DIR, keep "
                      "seed fixed, or run this sweep with --mode=processes")


def _vmapped_steps(config, setup, layout: TrialLayout, trial_sharding, shared_data: bool,
                   fields: Sequence[str]):
  """The train and eval steps of one trial, vmapped over the trial axis (not over the shared
  leaves: a LoRA base) and jitted: each trial's optimizer, schedule, and LoRA alpha and
  dropout come from its own hyperparameter values. LoRA dropout is traced only when it is one
  of the varying `fields`: a traced rate draws every adapter input's mask even at 0 (where it
  keeps x exactly): a 3-trial CPU population's step took 470 ms where it takes 335 ms now."""
  single, mesh, rules, task = setup.layout, setup.spec.mesh, setup.spec.rules, setup.task
  schedule_steps = config.optimizer.schedule_steps or config.train.steps
  base_optimizer = config.optimizer.to_dict()

  def optimizer_for(hp):
    values = {**base_optimizer, **{f.split(".", 1)[1]: hp[f] for f in VALUE_FIELDS
                                   if f.startswith("optimizer.")}}
    schedule = schedule_from(hp, schedule_steps)
    return (step_lib.make_optimizer(types.SimpleNamespace(**values), schedule_steps, schedule),
            schedule)

  def trial_step(hp):
    optimizer, schedule = optimizer_for(hp)
    adapter_values = None
    if layout.shares:  # None: the config's rate, the same for every trial
      adapter_values = {"alpha": hp["model.lora_alpha"], "dropout": (
          hp["model.lora_dropout"] if "model.lora_dropout" in fields else None)}
    return step_lib.make_train_step(single.graphdef, optimizer, schedule,
                                    config.train.microbatches, rules, mesh, loss=task.loss,
                                    evaluate=task.evaluate, adapter_values=adapter_values)

  one_step = lambda state, hp, batch: trial_step(hp).fn(state, batch)
  eval_one = lambda state, hp, batch: trial_step(hp).eval_fn(state, batch)
  batch_axis = None if shared_data else 0
  vmapped = jax.vmap(one_step, in_axes=(layout.axes, 0, batch_axis),
                     out_axes=(layout.axes, 0), spmd_axis_name="population")
  hparam_shardings = {f: trial_sharding for f in VALUE_FIELDS}
  # Every key of the source's batches (inputs and targets; chat data adds its loss weights).
  batch_shardings = {key: a.sharding for key, a in setup.batches.abstract().items()}
  if not shared_data:
    stacked = NamedSharding(mesh, rules.activation_spec(("trial", "batch", None), mesh))
    batch_shardings = {key: stacked for key in batch_shardings}
  shardings = layout.shardings
  train_step = jax.jit(vmapped, in_shardings=(shardings, hparam_shardings, batch_shardings),
                       out_shardings=(shardings, trial_sharding), donate_argnums=0)
  eval_step = jax.jit(jax.vmap(eval_one, in_axes=(layout.axes, 0, batch_axis),
                               spmd_axis_name="population"),
                      in_shardings=(shardings, hparam_shardings, batch_shardings),
                      out_shardings=trial_sharding)
  return train_step, eval_step


def sharding_table(pop: Population) -> sharding.ShardingReport:
  """The sharding report of the population's parameters (with their leading trial axis, but
  for the shared ones: a LoRA base)."""
  _, entries = state_lib.param_entries(pop.setup.spec.model)
  shares = pop.trial_layout.shares
  entries = [(path, shape, dtype, axes) if shares and not lora.is_adapter(path) else
             (path, (pop.size,) + shape, dtype, ("trial",) + axes)
             for path, shape, dtype, axes in entries]
  return sharding.sharding_report(entries, pop.setup.spec.rules, pop.mesh)


@dataclasses.dataclass
class TrialOutcome:
  start_step: int
  final_step: int
  diverged_at: int | None
  seconds: float


def run(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str], until: int,
        devices=None, log: Callable[[str], None] = print) -> list[TrialOutcome]:
  """Trains the trials together up to step `until`, each checkpointing into its own workdir;
  resumes from the latest step at which every trial has a checkpoint.

  A trial whose loss turns non-finite is reported (`diverged_at`) and its later values are
  ignored; the others go on (they are independent in the vmapped program)."""
  started = time.perf_counter()
  pop = build(configs, devices)
  table = sharding_table(pop)
  log(f"population of {pop.size} trials on mesh {dict(pop.mesh.shape)}, rules "
      f"{pop.setup.spec.rules.name}: parameters {table.total_bytes / 2**20:.2f} MiB in all, "
      f"{table.per_device_bytes / 2**20:.2f} MiB per device")
  for workdir, trial_config in zip(workdirs, configs):
    workdir_lib.makedirs(workdir)
    workdir_lib.write_text(os.path.join(workdir, "config.json"),
                           trial_config.to_json_best_effort(indent=2))
  trials = _Trials(pop, list(configs), list(workdirs), until, log)

  # --- restore or init -----------------------------------------------------------------------
  state = trials.restore_or_init()
  start = int(jax.device_get(state["step"])[0])

  # --- compile once (for all K trials) -------------------------------------------------------
  compile_start = time.perf_counter()
  batches = pop.batches_from(start)
  first = next(batches)
  trials.train_step = pop.train_step.lower(state, pop.hparams, first).compile()
  trials.eval_step = pop.eval_step.lower(state, pop.hparams, pop.eval_batch(0)).compile()
  log(f"compiled the population step in {time.perf_counter() - compile_start:.1f} s")

  # --- loop ----------------------------------------------------------------------------------
  try:
    _train(trials, state, start, itertools.chain([first], batches))
  finally:
    batches.close()
    trials.close()
  for workdir in workdirs:
    metrics_lib.plot_loss_curve(os.path.join(workdir, "metrics.jsonl"),
                                os.path.join(workdir, "loss.png"), trials.units)
  seconds = time.perf_counter() - started
  return [TrialOutcome(start_step=start, final_step=until, diverged_at=d, seconds=seconds)
          for d in trials.diverged]


class _Trials:
  """The trials' outputs (a checkpoint manager and a metric writer each) and which diverged."""

  def __init__(self, pop: Population, configs: list, workdirs: list[str], until: int,
               log: Callable[[str], None]):
    self.pop, self.configs, self.workdirs, self.until, self.log = pop, configs, workdirs, until, log
    keep = configs[0].train.keep_checkpoints
    self.managers = [checkpoint.Checkpoints(os.path.join(w, "checkpoints"), keep=keep)
                     for w in workdirs]
    self.writers = [metrics_lib.MetricWriter(w) for w in workdirs]
    self.diverged: list[int | None] = [None] * pop.size
    data = configs[0].data
    self.tokens_per_step = data.global_batch_size * data.seq_len * pop.size
    self.units = setup_lib.units_of(configs[0], pop.setup)  # the trials share their data
    self.train_step = self.eval_step = None

  def restore_or_init(self):
    """The stacked state at the latest step every trial has a checkpoint of, or a fresh one."""
    common = set.intersection(*(set(m.manager.all_steps()) for m in self.managers))
    common = {s for s in common if s <= self.until}
    if not common:
      return self.pop.init()
    restore_step = max(common)
    abstract = self.pop.setup.layout.abstract
    first = self.managers[0].restore(restore_step, abstract)[0]
    # The other trials' checkpoints hold the same base (a LoRA population): not read again.
    shares = self.pop.trial_layout.shares
    base = state_lib.split_trainable(first["params"])[1]
    target = {**abstract, "params": state_lib.split_trainable(abstract["params"])[0]}
    rest = [m.restore(restore_step, target if shares else abstract, partial=shares)[0]
            for m in self.managers[1:]]
    singles = [first] + [{**r, "params": state_lib.combine(r["params"], base)} for r in rest]
    self.log(f"restored the {self.pop.size} trials at step {restore_step}")
    return self.pop.stack(*singles)

  def live(self) -> list[int]:
    return [t for t in range(self.pop.size) if self.diverged[t] is None]

  def evaluate(self, state, at_step: int) -> None:
    pop = self.pop
    outputs = jax.device_get([self.eval_step(state, pop.hparams, pop.eval_batch(i))
                              for i in range(pop.trial_batches[0].eval_batches)])
    losses = []
    for t in self.live():  # each trial summarized as its own run summarizes its eval
      summary = pop.setup.task.summarize([jax.tree.map(lambda x, t=t: x[t], o) for o in outputs])
      scalars = {k: v for k, v in summary.items() if isinstance(v, float)}
      self.writers[t].write(at_step, "eval", scalars)
      losses.append(scalars["loss"])
    if losses:
      self.log(f"eval at step {at_step}: loss best {min(losses):.4f} / median "
               f"{float(np.median(losses)):.4f} {self.units.loss} over {len(losses)} trials")

  def flush(self, pending: list, since: float) -> None:
    fetched = jax.device_get([m for _, m in pending])
    seconds = (time.perf_counter() - since) / len(pending)
    for (at_step, _), values in zip(pending, fetched):
      for t in self.live():
        row = {k: float(v[t]) for k, v in values.items()}
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
          self.diverged[t] = at_step
          self.log(f"trial {os.path.basename(self.workdirs[t])}: loss {row['loss']} at step "
                   f"{at_step}; it stops here, the others go on")
          continue
        self.writers[t].write(at_step, "train", row)
    losses = [float(fetched[-1]["loss"][t]) for t in self.live()]
    at_step = pending[-1][0]
    eta = metrics_lib.format_duration((self.until - at_step) * seconds)
    if losses:
      self.log(f"step {at_step}/{self.until} | loss best {min(losses):.4f} median "
               f"{float(np.median(losses)):.4f} | step {seconds * 1000:.0f} ms | "
               f"{self.tokens_per_step / seconds:,.0f} tok/s ({self.pop.size} trials) | ETA {eta}")
    pending.clear()

  def save(self, state, at_step: int) -> None:
    for t in self.live():
      config = self.configs[t]
      self.managers[t].save(at_step, self.pop.take(state, t), checkpoint.config_to_dict(config),
                            {"step": at_step, "seed": config.seed, "source": config.data.source})

  def close(self) -> None:
    for manager in self.managers:
      manager.close()
    for writer in self.writers:
      writer.close()


def _train(trials: _Trials, state, start: int, batches: Iterator) -> None:
  """Steps from `start` to `until` (`batches` from `start` on) with log/eval/checkpoint every
  N steps, as the loop does."""
  train, pop, until = trials.configs[0].train, trials.pop, trials.until
  if start == 0:
    trials.evaluate(state, 0)
  pending: list = []
  since = time.perf_counter()
  for current in range(start, until):
    state, step_metrics = trials.train_step(state, pop.hparams, next(batches))
    done = current + 1
    pending.append((done, step_metrics))
    at_end = done == until
    save_now = done % train.checkpoint_every == 0 or at_end
    if done % train.log_every == 0 or save_now:
      trials.flush(pending, since)
      since = time.perf_counter()
    if done % train.eval_every == 0 or at_end:
      trials.evaluate(state, done)
    if save_now:
      trials.save(state, done)
    if done % train.eval_every == 0 or save_now:
      since = time.perf_counter()
  if pending:
    trials.flush(pending, since)
