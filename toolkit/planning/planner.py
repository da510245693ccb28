"""The planner behind `python -m toolkit.compile --plan`: which mesh, rules preset, remat
policy and micro-batch count to train a config with on a target, decided by compiling.

  1. enumerate: meshes data x fsdp x tensor over one slice's devices (across slices the DCN
     axis is data, or fsdp for presets that shard parameters) x presets dp, fsdp, tp, fsdp_tp
     (each on the meshes where all its axes do work: dp on data only, fsdp without tensor, ...);
     for a mixture of experts also x expert (sizes dividing n_experts) with fsdp_ep and
     fsdp_tp_ep on the meshes that have one; from SEQUENCE_FROM positions also x sequence
     (2, 4, 8) with fsdp_cp (context parallelism); across slices also a pipeline, one stage
     per slice over DCN (fsdp_pp on fsdp's meshes, S, 2S, 4S pipeline micro-batches)
     x remat none, save_dots, minimal, save_attention, full x micro-batch counts (1 to 64,
     those that divide the batch) x attention auto, xla x vocabulary loss chunked (the
     config's model.loss_chunk) or not (0);
  2. lint each (the config's own validation and the sharding rules, plus activation
     dimensions vs their mesh axes) and estimate it (`toolkit.planning.estimate`); prune those whose
     analytic memory exceeds the chip's HBM; among layouts that differ only in attention and
     loss chunking, prune those another beats on both estimated step time and memory; and per
     mesh/preset/remat/attention/chunking keep the fewest micro-batches that fit by the
     estimate and the next count (in case the estimate is low);
  3. compile the survivors, most promising (analytic step time) first, in worker processes
     (as many as CPU cores and free memory allow; one means sequential) until the budget ends;
  4. rank those that fit by estimated step time: compute (the traced step's matmul FLOPs,
     loops counted) at the chip's peak plus the compiled program's collective bytes at the
     table's ICI and DCN bandwidths, without overlap; within 1 % of the fastest, the one with
     the least memory per device wins (more headroom for what the compiler cannot see).
The winner is written as a plan file (`toolkit.planning.plan`) that `toolkit.train` applies.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import queue
import re
import shlex
import time
from collections.abc import Callable, Sequence

import ml_collections

import sharding
from toolkit.training import config as config_lib, state as state_lib
from toolkit.planning import aot, estimate, plan as plan_lib
from toolkit.planning.candidates import (ATTENTIONS, MICROBATCHES, PRESETS, REMATS, Candidate,
                                    enumerate_candidates)
from toolkit.errors import ConfigError
from toolkit.planning.target import Target

TIE = 0.01  # step times within 1 % of the fastest are ties: the least memory wins
# Compiled memory came out 0.6x to 1.2x the analytic estimate (see the closing note of the
# planner's issue); candidates estimated above this fraction of HBM are compiled last.
SAFE_FRACTION = 0.8
WORKER_MEMORY_BYTES = 3 * 2**30  # one compile of a 7B model for 64 chips peaked at ~1.1 GiB


@dataclasses.dataclass
class Outcome:
  target: Target
  candidates: list[Candidate]
  seconds: float
  workers: int
  config: ml_collections.ConfigDict     # as given (before scale_config)

  @property
  def ranked(self) -> list[Candidate]:
    """Fitting candidates, fastest first; those within TIE of the fastest count as tied and
    go by memory (more headroom), since the estimate cannot tell them apart."""
    fitting = [c for c in self.candidates if c.status == "fits"]
    step = lambda c: c.step_time.get("total_s", math.inf)
    fastest = min((step(c) for c in fitting), default=math.inf)
    return sorted(fitting, key=lambda c: (0, c.compiled_bytes or 0, step(c))
                  if step(c) <= fastest * (1 + TIE) else (1, step(c), c.compiled_bytes or 0))

  @property
  def best(self) -> Candidate | None:
    return self.ranked[0] if self.ranked else None

  def as_dict(self) -> dict:
    return {"target": self.target.name, "slices": self.target.slices,
            "seconds": self.seconds, "workers": self.workers,
            "candidates": [dataclasses.asdict(c) for c in self.candidates]}


def _activation_lint(shape: estimate.Shape) -> str | None:
  """Activation dimensions their mesh axes do not divide (tracing would fail on them)."""
  m = shape.model
  rows = shape.global_batch_size // shape.microbatches
  sizes = {"batch": rows, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "mlp": m.mlp_dim,
           "vocab": m.vocab_size, "embed": m.d_model, "length": shape.seq_len,
           "experts": m.n_experts}
  for name, size in sizes.items():
    ways = shape.activation_ways(name)
    if size % ways:
      return (f"activation {name} has size {size}, not divisible by {ways} ways; change the "
              f"mesh or set sharding.activation_overrides='{name}=none'")
  return None


def prepare(config: ml_collections.ConfigDict, candidates: list[Candidate],
            target: Target) -> None:
  """Lints, estimates and prunes in place (status 'lint' or 'pruned' or left 'pending')."""
  entries_by_model = {}
  hbm = target.hbm_bytes_per_device
  for c in candidates:
    cfg = plan_lib.apply_overrides(config, c.overrides)
    try:
      spec = config_lib.resolve(cfg, list(target.devices))
      model_key = (spec.model.vocab_size, spec.model.d_model, spec.model.n_layers,
                   spec.model.n_heads, spec.model.n_kv_heads, spec.model.mlp_dim,
                   spec.model.param_dtype, spec.model.tie_embeddings, spec.model.head_dim)
      if model_key not in entries_by_model:
        entries_by_model[model_key] = state_lib.param_entries(spec.model)[1]
      report = sharding.sharding_report(entries_by_model[model_key], spec.rules, spec.mesh)
      report.check_replicated(cfg.sharding.max_replicated_fraction,
                              cfg.sharding.replicated_action)
    except (ConfigError, sharding.ShardingError) as e:
      c.status, c.reason = "lint", str(e)
      continue
    shape = estimate.shape_for(spec, cfg, report, target.slices)
    if target.stand_in_for:  # host devices standing in for the target's: its kernels
      shape = dataclasses.replace(shape, platform=target.stand_in_for)
    problem = _activation_lint(shape)
    if problem:
      c.status, c.reason = "lint", problem
      continue
    c.analytic_bytes = estimate.memory(shape).total
    ici, dcn = estimate.communication(shape)
    c.analytic_step_s = estimate.step_seconds(
        estimate.executed_flops_per_device(shape), ici, dcn,
        target.peak_flops_per_device or cfg.train.peak_flops_per_device or 1.0,
        target.ici_bytes_per_second or 0.0, target.dcn_bytes_per_second or 0.0)["total_s"]
    if hbm is not None and c.analytic_bytes > hbm:
      c.status = "pruned"
      c.reason = (f"analytic estimate {c.analytic_bytes / 2**30:.1f} GiB > "
                  f"{hbm / 2**30:g} GiB HBM")
  _prune_dominated(candidates)
  # Per mesh/preset/remat: the fewest micro-batches that fit by the estimate, and the next.
  groups: dict[tuple, list[Candidate]] = {}
  for c in candidates:
    if c.status == "pending":
      key = tuple((k, v) for k, v in c.overrides.items() if k != "train.microbatches")
      groups.setdefault(key, []).append(c)
  for members in groups.values():
    members.sort(key=lambda c: c.overrides["train.microbatches"])
    for c in members[2:]:
      c.status = "pruned"
      c.reason = (f"{members[0].overrides['train.microbatches']} micro-batch(es) fit by the "
                  f"estimate; more only add communication")


_VARIANT_FIELDS = ("model.attention", "model.loss_chunk")


def _prune_dominated(candidates: list[Candidate]) -> None:
  """Among pending candidates that differ only in attention and loss chunking, prunes each
  one another beats by the estimate: no slower and less memory, or faster and no more."""
  groups: dict[tuple, list[Candidate]] = {}
  for c in candidates:
    if c.status == "pending":
      key = tuple((k, v) for k, v in c.overrides.items() if k not in _VARIANT_FIELDS)
      groups.setdefault(key, []).append(c)
  for members in groups.values():
    for c in members:
      better = next((o for o in members if o is not c and o.analytic_step_s <= c.analytic_step_s
                     and o.analytic_bytes <= c.analytic_bytes
                     and (o.analytic_step_s, o.analytic_bytes)
                     < (c.analytic_step_s, c.analytic_bytes)), None)
      if better is not None and not c.given:
        c.status = "pruned"
        c.reason = (f"attention={better.overrides['model.attention']} chunk="
                    f"{better.overrides['model.loss_chunk']} is no slower and needs less memory "
                    f"by the estimate")


def _worker(tasks, results, target_name: str, slices: int, cpu_devices: int) -> None:
  """A compile process: builds the target once, then compiles configs until told to stop."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  if cpu_devices:
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  from toolkit.planning.target import target_for  # pylint: disable=g-import-not-at-top
  target = target_for(target_name, slices)
  while True:
    task = tasks.get()
    if task is None:
      return
    index, config_dict = task
    try:
      report = aot.compile_report(ml_collections.ConfigDict(config_dict), target)
      results.put((index, {
          "verdict": report.verdict, "seconds": report.compile_seconds,
          "bytes": (report.memory or {}).get("total") or
                   (report.out_of_memory or {}).get("required_bytes"),
          "step_time": report.step_time,
          "reason": (report.out_of_memory or {}).get("message", "")}))
    except Exception as e:  # pylint: disable=broad-except  # reported per candidate
      results.put((index, {"verdict": "error", "reason": f"{type(e).__name__}: {e}"[:500]}))


def auto_workers(tasks: int) -> int:
  try:
    with open("/proc/meminfo") as f:
      info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    free = info.get("MemAvailable", 0)
  except OSError:
    free = WORKER_MEMORY_BYTES
  by_memory = max(free // WORKER_MEMORY_BYTES, 1)
  return int(max(1, min(os.cpu_count() or 1, by_memory, tasks)))


def compile_candidates(config: ml_collections.ConfigDict, candidates: list[Candidate],
                       target: Target, budget_s: float, workers: int,
                       log: Callable[[str], None]) -> int:
  """Compiles the pending candidates in worker processes until done or out of budget."""
  pending = [c for c in candidates if c.status == "pending"]
  # The given layout first (the plan is then never worse than it), then the ones with memory
  # to spare by the estimate, each group fastest first by the estimate.
  hbm = target.hbm_bytes_per_device
  pending.sort(key=lambda c: (
      not c.given, hbm is not None and (c.analytic_bytes or 0) > SAFE_FRACTION * hbm,
      c.analytic_step_s if c.analytic_step_s is not None else math.inf))
  if not pending:
    return 0
  workers = workers or auto_workers(len(pending))
  workers = min(workers, len(pending))
  context = multiprocessing.get_context("spawn")
  tasks, results = context.Queue(), context.Queue()
  cpu_devices = 0 if target.is_tpu else len(target.devices)
  processes = [context.Process(target=_worker, daemon=True,
                               args=(tasks, results, target.name if target.is_tpu else
                                     f"cpu:{len(target.devices) // target.slices}",
                                     target.slices, cpu_devices))
               for _ in range(workers)]
  for p in processes:
    p.start()
  for index, c in enumerate(pending):
    tasks.put((index, plan_lib.apply_overrides(config, c.overrides).to_dict()))
  for _ in processes:
    tasks.put(None)
  deadline = time.monotonic() + budget_s
  done = 0
  try:
    while done < len(pending):
      left = deadline - time.monotonic()
      if left <= 0:
        break
      try:
        index, result = results.get(timeout=min(left, 5.0))
      except queue.Empty:
        if not any(p.is_alive() for p in processes):
          break
        continue
      done += 1
      c = pending[index]
      c.compile_seconds = result.get("seconds")
      c.compiled_bytes = result.get("bytes")
      c.step_time = result.get("step_time") or {}
      c.status = {"fits": "fits", "no chip": "fits", "does not fit": "does not fit"}.get(
          result["verdict"], "error")
      c.reason = result.get("reason", "")
      log(f"  [{done}/{len(pending)}] {c.label}: {c.status}"
          + (f", {c.compiled_bytes / 2**30:.2f} GiB" if c.compiled_bytes else "")
          + (f", step {_ms(c.step_time['total_s'])} ms" if c.step_time else "")
          + (f" ({c.compile_seconds:.0f} s)" if c.compile_seconds else ""))
  finally:
    for p in processes:
      if p.is_alive():
        p.kill()  # SIGKILL: libtpu's SIGTERM handler would print a stack trace per worker
    for p in processes:
      p.join(timeout=10)
    # Tasks nobody will read (the budget ran out) would otherwise keep this process's queue
    # feeder thread, and so the process itself, from ever exiting.
    tasks.cancel_join_thread()
    results.cancel_join_thread()
  for c in pending:
    if c.status == "pending":
      c.status, c.reason = "budget", f"not compiled within --plan_budget_s={budget_s:g}"
  return workers


def search(config: ml_collections.ConfigDict, target: Target, *, budget_s: float = 600.0,
           workers: int = 0, presets: Sequence[str] = PRESETS, remats: Sequence[str] = REMATS,
           microbatches: Sequence[int] = MICROBATCHES, attentions: Sequence[str] = ATTENTIONS,
           loss_chunks: Sequence[int] | None = None,
           log: Callable[[str], None] = lambda _: None) -> Outcome:
  """Enumerates, prunes, compiles and ranks; see the module docstring."""
  start = time.monotonic()
  original = config
  config, _ = aot.scale_config(config, target)
  candidates = enumerate_candidates(config, target, presets, remats, microbatches, attentions,
                                    loss_chunks)
  _mark_given(config, candidates, target)
  prepare(config, candidates, target)
  counts = {s: sum(c.status == s for c in candidates) for s in ("pending", "lint", "pruned")}
  log(f"plan: {len(candidates)} candidates on {target.describe()}; {counts['lint']} fail "
      f"the lint, {counts['pruned']} pruned by the analytic estimate, {counts['pending']} to "
      f"compile, most promising first, until {budget_s:g} s have passed")
  for line in skipped_reasons(candidates):
    log(line)
  used = compile_candidates(config, candidates, target, budget_s, workers, log)
  return Outcome(target=target, candidates=candidates, seconds=time.monotonic() - start,
                 workers=used, config=original)


def _why(c: Candidate) -> str:
  """The kind of reason a candidate was skipped, without its numbers."""
  if c.status == "pruned":
    if "HBM" in c.reason:
      return "needs more memory than the chip has, by the estimate"
    if "micro-batch" in c.reason:
      return "more micro-batches than the fewest that fit (only communication added)"
    return "another attention or loss chunking is no slower and needs less memory"
  if "is not divisible by the batch-sharding axes" in c.reason:
    return "the micro-batch does not divide over the batch axes"
  if "not divisible by" in c.reason:
    what = re.search(r"\(([a-z_]+)\) has size", c.reason)
    return f"{what.group(1) if what else 'a dimension'} does not divide over its mesh axes"
  return re.sub(r"\S*\d\S*", "N", c.reason.split(";")[0])


def skipped_reasons(candidates: list[Candidate], top: int = 4) -> list[str]:
  """One line per kind of reason candidates were skipped (lint or pruned), most frequent
  first, with the count."""
  tally: dict[tuple[str, str], int] = {}
  for c in candidates:
    if c.status in ("lint", "pruned"):
      key = (c.status, _why(c))
      tally[key] = tally.get(key, 0) + 1
  ranked = sorted(tally.items(), key=lambda kv: (-kv[1], kv[0]))
  lines = [f"  skipped {n:>5} ({status}): {why}" for (status, why), n in ranked[:top]]
  if len(ranked) > top:
    others = len(ranked) - top
    lines.append(f"  skipped {sum(n for _, n in ranked[top:]):>5}: {others} other "
                 f"reason{'s' if others > 1 else ''} (--json lists every candidate's)")
  return lines


def _mark_given(config: ml_collections.ConfigDict, candidates: list[Candidate],
                target: Target) -> None:
  """Marks the candidate with the config's own mesh, preset, remat, micro-batches, attention
  and loss chunking."""
  try:
    mesh = dict(config_lib.resolve(config, list(target.devices)).mesh.shape)
  except (ConfigError, sharding.ShardingError, ValueError):
    return  # the config's own layout does not even resolve here: nothing to mark
  for c in candidates:
    o = c.overrides
    c.given = (all(mesh.get(k, 1) == v for k, v in c.mesh.items())
               and math.prod(c.mesh.values()) == math.prod(mesh.values())
               and o["mesh.dcn"] == (config.mesh.dcn or "")
               and (o["sharding.preset"], o["model.remat"], o["train.microbatches"],
                    o["model.attention"], o["model.loss_chunk"])
               == (config.sharding.preset, config.model.remat, config.train.microbatches,
                   config.model.attention, config.model.loss_chunk))


def _ms(seconds: float) -> str:
  """Milliseconds, the one unit of the ranking's time columns."""
  return "-" if seconds != seconds else f"{seconds * 1e3:,.2f}"


def format_ranking(outcome: Outcome, top: int = 15) -> str:
  ranked = outcome.ranked
  width = max([len(c.label) for c in ranked[:top]] + [len("candidate")])
  lines = [f"ranking on {outcome.target.name}"
           + (f" x {outcome.target.slices} slices" if outcome.target.slices > 1 else "")
           + f" ({outcome.seconds:.0f} s, {outcome.workers} compile process(es)); step time "
           f"= compute + ICI + DCN, no overlap; steps within {TIE:.0%} of the fastest are a "
           f"tie, won by the least memory per device",
           f"  {'#':>2}  {'candidate':<{width}}  {'memory GiB':>10}  {'step ms':>10}  "
           f"{'compute ms':>10}  {'ICI ms':>10}  {'DCN ms':>10}"]
  for i, c in enumerate(ranked[:top], 1):
    s = c.step_time
    cell = lambda key, s=s: _ms(s.get(key, math.nan))
    lines.append(f"  {i:>2}  {c.label:<{width}}  {(c.compiled_bytes or 0) / 2**30:>10.2f}  "
                 f"{cell('total_s'):>10}  {cell('compute_s'):>10}  {cell('ici_s'):>10}  "
                 f"{cell('dcn_s'):>10}")
  if len(ranked) > top:
    lines.append(f"  ... and {len(ranked) - top} more that fit")
  tally: dict[str, int] = {}
  for c in outcome.candidates:
    tally[c.status] = tally.get(c.status, 0) + 1
  lines.append("  candidates: " + ", ".join(f"{n} {s}" for s, n in sorted(tally.items())))
  if not ranked and not any(c.status == "budget" for c in outcome.candidates):
    near = sorted((c for c in outcome.candidates if c.analytic_bytes),
                  key=lambda c: c.analytic_bytes)[:3]
    for c in near:
      lines.append(f"  closest: {c.label} needs {c.analytic_bytes / 2**30:.1f} GiB per device by "
                   f"the estimate ({c.status}{': ' + c.reason if c.reason else ''})")
  errors = [c for c in outcome.candidates if c.status == "error"]
  for c in errors[:3]:
    lines.append(f"  error in {c.label}: {c.reason}")
  return "\n".join(lines)


def _field(config: ml_collections.ConfigDict, dotted: str):
  for part in dotted.split("."):
    config = config[part]
  return config


def finish(outcome: Outcome, path: str, argv: Sequence[str]) -> str:
  """Writes the best candidate as a plan file; returns the text with the launch commands."""
  best = outcome.best
  assert best is not None
  overrides = dict(best.overrides)
  per_slice = {k: v // (outcome.target.slices if overrides["mesh.dcn"].startswith(k + ":")
                        else 1) for k, v in best.mesh.items()}
  overrides["mesh.ici"] = plan_lib.scalable_ici(per_slice)
  config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
  passed = [a for a in argv[1:] if a.startswith("--config.")
            and a.split("=", 1)[0][len("--config."):] not in overrides]
  plan_lib.write_plan(path, {
      "overrides": overrides, "target": outcome.target.name, "slices": outcome.target.slices,
      "mesh_on_target": best.mesh, "config_argument": config_arg, "config_overrides": passed,
      "compiled": {"bytes_per_device": best.compiled_bytes, "step_time": best.step_time,
                   "compile_seconds": best.compile_seconds}})
  # Spelled out as flags: only the fields the plan changes.
  changed = {k: v for k, v in overrides.items() if _field(outcome.config, k) != v}
  train_args = [f"--config={config_arg}", *passed, f"--plan={path}"]
  spelled = [f"--config={config_arg}", *passed, *plan_lib.flags_for(changed)]
  t = outcome.target
  pod = ["python", "scripts/launch/tpu_pod.py", "run", "--name=NAME", "--zone=ZONE",
         f"--accelerator-type={t.name}"] + ([f"--slices={t.slices}"] if t.slices > 1 else []) + [
         f"--config={config_arg}", "--workdir=/mnt/gcs/runs/RUN", "--",
         *passed, *plan_lib.flags_for(changed)]
  lines = [f"plan: {best.label} -> {path}",
           f"  python -m toolkit.train {shlex.join(train_args)} --workdir=runs/RUN",
           "  the same without --plan:",
           f"  python -m toolkit.train {shlex.join(spelled)} --workdir=runs/RUN"]
  if t.is_tpu:
    lines += ["  on the pod (scripts/launch/tpu_pod.py):", f"  {shlex.join(pod)}"]
  return "\n".join(lines)
