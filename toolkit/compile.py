"""Will this config fit, and how will it run, on a TPU pod? Answered from a laptop by the real
compiler: the training step is lowered and compiled for a named topology's devices without
having them, and the report sets what the compiler says next to what the formulas say.

  python -m toolkit.compile --config=experiments/lm.py:size=7b --topology=v5p-128
  python -m toolkit.compile --config=experiments/lm.py:size=7b --topology=v5p-128 --slices=2 \\
      --json=report.json
  python -m toolkit.compile --config=experiments/lm.py:cpu --topology=cpu:8   # no libtpu
  python -m toolkit.compile --config=experiments/lm.py:size=1b --topology=v5e-16 --plan

The step is the training run's own: `toolkit.train.build(config, devices)` on the target's
devices (the same `sharding.make_mesh`, rules, model, optimizer and step; a -1 in mesh.ici
fills from the target's device count), jitted by `toolkit.step.jit_step` and compiled on
abstract inputs. TPU targets need libtpu (`pip install -e '.[tpu]'`); their devices come from
`toolkit.target` (the accelerator table's `topology_desc_kwargs`).

The report, printed and as JSON (--json):
  memory per device   compiled.memory_analysis(): arguments, outputs, temporaries, generated
                      code; total = arguments + outputs + temporaries + generated code - aliased
                      (donated state: outputs that reuse argument buffers), against the chip's
                      HBM from the table: fits / does not fit, and the headroom. When the
                      compiler itself refuses ("Ran out of memory ... hbm") its figures are
                      the verdict.
  analytic            params, optimizer, gradients, activations under the remat policy,
                      logits, weights in use (`toolkit.estimate`), and compiled / analytic
  FLOPs               compiled.cost_analysis() (which counts a loop body once: scanned layers,
                      micro-batches), the same with loops counted, and the model formula
  collectives         from compiled.as_text(), by kind and mesh axes, bytes per step with loop
                      trip counts applied; what crosses slices (DCN) is flagged
  step time           compute at the chip's peak plus communication at the table's ICI/DCN
                      bandwidth, no overlap
Exit status: 0 fits (or a CPU target), 1 does not fit (or the compiler failed otherwise: its
first line is the error), 2 bad input (flags, config, sharding
lint: replicated parameters above the limit with replicated_action=fail, dimensions that do not
divide their mesh axes, a batch the data axes do not divide), each as one `error:` line.
`--plan` searches meshes, rules, remat and micro-batches instead (`toolkit.planner`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time

import jax
import ml_collections

import sharding
from toolkit import collectives as collectives_lib
from toolkit import command_line, estimate
from toolkit import step as step_lib
from toolkit import train as train_lib
from toolkit.config import ConfigError
from toolkit.target import Target, TargetError, target_for

FITS, DOES_NOT_FIT, BAD_INPUT = 0, 1, 2
GiB = 2**30


class LintError(ValueError):
  """A sharding or config mistake found before compiling; the message names the fix."""


class CompileError(RuntimeError):
  """The compiler failed for a reason other than running out of memory."""


_OOM = re.compile(r"Ran out of memory (?:in memory space hbm|on HBM)|RESOURCE_EXHAUSTED.*HBM",
                  re.I | re.S)
_SIZE = r"([\d.]+)\s*([KMGT]i?B?|B)?"
_UNITS = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(number: str, unit: str | None) -> float:
  return float(number) * _UNITS[(unit or "B")[0].upper()]


def parse_out_of_memory(message: str) -> dict | None:
  """The compiler's figures from an HBM out-of-memory error, or None for another error.

  Two wordings are known: "Ran out of memory in memory space hbm. Used 24.55G of 15.75G hbm.
  Exceeded hbm capacity by 8.80G." and "Ran out of memory on HBM, the total memory required
  for HLO temporaries (31.24G) exceeds available HBM (15.75G)."
  """
  if not _OOM.search(message):
    return None
  required = available = None
  used = re.search(rf"Used {_SIZE} of {_SIZE} hbm", message, re.I)
  if used:
    required, available = _bytes(*used.group(1, 2)), _bytes(*used.group(3, 4))
  else:
    needed = re.search(rf"required[^(]*\({_SIZE}\)", message, re.I)
    limit = re.search(rf"available HBM \({_SIZE}\)", message, re.I)
    required = _bytes(*needed.group(1, 2)) if needed else None
    available = _bytes(*limit.group(1, 2)) if limit else None
  first = next((line.strip() for line in message.splitlines() if _OOM.search(line)),
               message.strip().splitlines()[0])
  return {"required_bytes": required, "available_bytes": available,
          "message": re.sub(r"^\w+:\s*", "", first)[:400]}


@dataclasses.dataclass
class Report:
  """Everything one compile found; `as_dict()` is the JSON."""
  target: dict
  run: dict
  lint: dict
  verdict: str                       # "fits", "does not fit", "no chip" (CPU targets)
  compile_seconds: float
  memory: dict | None                # compiled, per device; None if the compiler refused
  out_of_memory: dict | None         # the compiler's figures when it refused
  analytic: dict
  flops: dict
  collectives: list[dict]
  communication: dict
  step_time: dict
  notes: list[str]

  @property
  def exit_code(self) -> int:
    return DOES_NOT_FIT if self.verdict == "does not fit" else FITS

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "exit_code": self.exit_code}

  def format(self) -> str:
    return format_report(self)


def scale_config(config: ml_collections.ConfigDict, target: Target) -> tuple[
    ml_collections.ConfigDict, list[str]]:
  """A copy of `config` for `target`: across slices, mesh.dcn defaults to data parallel."""
  config = ml_collections.ConfigDict(config.to_dict())
  notes = []
  dcn = sharding.parse_axis_sizes(config.mesh.dcn, "mesh.dcn") if config.mesh.dcn else []
  fixed = math.prod(size for _, size in dcn if size != -1)
  if target.slices > 1 and not dcn:
    config.mesh.dcn = f"data:{target.slices}"
    notes.append(f"mesh.dcn was empty: data parallel across the {target.slices} slices "
                 f"(mesh.dcn=data:{target.slices}); set --config.mesh.dcn to choose")
  elif target.slices == 1 and dcn and fixed > 1:
    raise LintError(f"mesh.dcn={config.mesh.dcn!r} asks for {fixed} slices; pass "
                    f"--slices={fixed} or clear it with --config.mesh.dcn=")
  elif dcn and all(size != -1 for _, size in dcn) and fixed != target.slices:
    raise LintError(f"mesh.dcn={config.mesh.dcn!r} makes {fixed} slices but --slices="
                    f"{target.slices}; make them agree (or use -1 in mesh.dcn)")
  return config, notes


def _lint(setup, config) -> dict:
  """Replicated parameter bytes (a warning, or an error with replicated_action=fail)."""
  report = setup.layout.report
  warning = report.check_replicated(config.sharding.max_replicated_fraction,
                                    config.sharding.replicated_action)  # raises on "fail"
  return {"param_bytes": report.total_bytes, "param_bytes_per_device": report.per_device_bytes,
          "replicated_bytes": report.replicated_bytes,
          "replicated_fraction": report.replicated_fraction, "warnings": [warning] if warning
          else []}


def compile_report(config: ml_collections.ConfigDict, target: Target, *,
                   hlo_path: str | None = None) -> Report:
  """Lints, compiles the training step of `config` for `target` and reports.

  Raises:
    LintError: a config or sharding mistake (the message names the field and the fix).
  """
  config, notes = scale_config(config, target)
  kind = config.model.get("kind", "llama")
  if kind != "llama":
    # The analytic estimate, the model formula and the planner are written for the LM.
    raise LintError(f"model.kind={kind!r}: toolkit.compile reports on the Llama LM only so "
                    f"far; for other models lower the step yourself (tests/models/test_vit.py "
                    f"shows the ViT-B/16 on v5p-16)")
  try:
    setup = train_lib.build(config, devices=list(target.devices))
    lint = _lint(setup, config)
  except (ConfigError, sharding.ShardingError) as e:
    raise LintError(str(e)) from None
  except ValueError as e:  # jax's mesh_utils: the mesh does not map onto the physical chips
    raise LintError(f"mesh.ici={config.mesh.ici!r} (dcn {config.mesh.dcn!r}) does not map onto "
                    f"{target.name}'s chips: {str(e).splitlines()[0]}; choose axis sizes that "
                    f"are products of the slice's physical dimensions") from None
  spec, layout = setup.spec, setup.layout
  mesh = spec.mesh
  shape = estimate.shape_for(spec, config, layout.report, target.slices)
  abstract_batch = setup.batches.abstract()
  train_jit, _ = step_lib.jit_step(setup.step, layout, abstract_batch, mesh)
  start = time.perf_counter()
  try:
    traced = train_jit.trace(layout.abstract, abstract_batch)
  except sharding.ShardingError as e:  # activation dimensions the mesh axes do not divide
    raise LintError(str(e)) from None
  lowered = traced.lower()
  compiled = out_of_memory = None
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  # XLA raises JaxRuntimeError
    out_of_memory = parse_out_of_memory(str(e))
    if out_of_memory is None:
      first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
      raise CompileError(f"compiling for {target.name} failed: {first}") from e
  compile_seconds = time.perf_counter() - start

  analytic = estimate.memory(shape).as_dict()
  hbm = target.hbm_bytes_per_device
  memory = None
  if compiled is not None:
    stats = compiled.memory_analysis()
    memory = _memory(stats) if stats is not None else None
  if out_of_memory is not None:
    verdict = "does not fit"
  elif hbm is None:
    verdict = "no chip"
  elif memory is None:
    verdict = "fits"
    notes.append("the compiler gave no memory analysis; the verdict is only that it compiled")
  else:
    verdict = "fits" if memory["total"] <= hbm else "does not fit"
  if memory:
    memory["hbm"] = hbm
    memory["headroom"] = None if hbm is None else hbm - memory["total"]
    analytic["ratio_compiled_to_analytic"] = memory["total"] / analytic["total"]
  elif out_of_memory and out_of_memory["required_bytes"]:
    analytic["ratio_compiled_to_analytic"] = out_of_memory["required_bytes"] / analytic["total"]

  split = shape.activation_ways("batch") * shape.activation_ways("mlp")
  flops = {"model_formula_per_step": estimate.model_flops_per_step(shape),
           "model_formula_per_device": estimate.model_flops_per_step(shape) / target.chips,
           "analytic_executed_per_device": estimate.executed_flops_per_device(shape),
           "traced_per_step": program_flops(traced.jaxpr),
           "note": FLOPS_NOTE}
  flops["traced_per_device"] = flops["traced_per_step"] / split
  found: list[collectives_lib.Collective] = []
  if compiled is not None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops["xla_per_device"] = float(cost.get("flops", 0.0)) if cost else 0.0
    text = compiled.as_text()
    if hlo_path:
      with open(hlo_path, "w") as f:
        f.write(text)
    found = collectives_lib.parse(text, list(mesh.shape.items()), _slice_ids(mesh, target))
  summaries = collectives_lib.summarize(found)
  ici_formula, dcn_formula = estimate.communication(shape)
  ici_compiled = sum(s.ici_bytes for s in summaries)
  dcn_compiled = sum(s.dcn_bytes for s in summaries)
  communication = {"ici_bytes_compiled": ici_compiled, "dcn_bytes_compiled": dcn_compiled,
                   "ici_bytes_analytic": ici_formula, "dcn_bytes_analytic": dcn_formula}
  step_time = {}
  if target.is_tpu:
    executed = flops["traced_per_device"]
    source = (ici_compiled, dcn_compiled) if compiled is not None else (ici_formula, dcn_formula)
    step_time = estimate.step_seconds(executed, *source, target.peak_flops_per_device,
                                      target.ici_bytes_per_second, target.dcn_bytes_per_second)
    step_time["communication"] = "compiled" if compiled is not None else "analytic"
    step_time["model_flops_utilization"] = (
        flops["model_formula_per_device"] / target.peak_flops_per_device / step_time["total_s"])
  model = spec.model
  run = {"params": shape.param_count, "d_model": model.d_model, "n_layers": model.n_layers,
         "vocab_size": model.vocab_size, "param_dtype": model.param_dtype,
         "compute_dtype": model.compute_dtype, "remat": model.remat,
         "scan_layers": model.scan_layers, "mesh": dict(mesh.shape),
         "mesh_ici": config.mesh.ici, "mesh_dcn": config.mesh.dcn,
         "preset": spec.rules.name, "global_batch_size": config.data.global_batch_size,
         "seq_len": config.data.seq_len, "microbatches": config.train.microbatches}
  return Report(
      target=_target_dict(target), run=run, lint=lint, verdict=verdict,
      compile_seconds=compile_seconds, memory=memory, out_of_memory=out_of_memory,
      analytic=analytic, flops=flops,
      collectives=[dataclasses.asdict(s) for s in summaries], communication=communication,
      step_time=step_time, notes=notes)


FLOPS_NOTE = (
    "xla: compiled.cost_analysis(), which counts each while-loop body (the scanned layers, the "
    "micro-batch loop) at most once; on TPU it also came out below even that for long "
    "sequences, so it is shown but not used. traced: matmul FLOPs (dot_general, 2 per "
    "multiply-add) of the step's jaxpr, the program XLA compiles, with scan bodies counted "
    "length times and remat recomputation included, divided over the devices that split the "
    "work (batch axes x tensor). model formula: LlamaConfig.flops_per_token x tokens / devices")


def program_flops(jaxpr) -> float:
  """Matmul FLOPs of a (closed) jaxpr: 2 x multiply-adds of every dot_general, scan bodies
  times their length, the larger branch of a cond, other sub-jaxprs (pjit, remat,
  custom_jvp/vjp) once. A while loop's trip count is unknown here: its body counts once."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
      lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
      out = eqn.outvars[0].aval.shape
      contracted = math.prod(lhs[i] for i in lhs_contract)
      total += 2.0 * math.prod(out) * contracted
      del rhs, lhs_batch
    elif name == "scan":
      total += eqn.params["length"] * program_flops(eqn.params["jaxpr"])
    elif name == "cond":
      total += max(program_flops(b) for b in eqn.params["branches"])
    else:
      for value in eqn.params.values():
        if hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
          total += program_flops(value)
  return total


def _memory(stats) -> dict:
  parts = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
           "temporaries": stats.temp_size_in_bytes,
           "generated_code": stats.generated_code_size_in_bytes,
           "aliased": stats.alias_size_in_bytes}
  parts = {k: int(v) for k, v in parts.items()}
  parts["total"] = (parts["arguments"] + parts["outputs"] + parts["temporaries"]
                    + parts["generated_code"] - parts["aliased"])
  parts["total_definition"] = "arguments + outputs + temporaries + generated_code - aliased"
  return parts


def _slice_ids(mesh, target: Target) -> list[int] | None:
  if target.slices == 1:
    return None
  devices = list(mesh.devices.flat)
  if all(getattr(d, "slice_index", None) is not None for d in devices):
    return [int(d.slice_index) for d in devices]
  # Simulated host devices: consecutive blocks act as slices (sharding.mesh._blocked_hybrid).
  per_slice = len(target.devices) // target.slices
  order = {d.id: i // per_slice for i, d in enumerate(target.devices)}
  return [order[d.id] for d in devices]


def _target_dict(target: Target) -> dict:
  t = target.tpu
  return {"name": target.name, "slices": target.slices, "devices": len(target.devices),
          "kind": "tpu" if t else "cpu", "description": target.describe(),
          "hbm_bytes_per_device": target.hbm_bytes_per_device,
          "peak_flops_per_device": target.peak_flops_per_device,
          "ici_bytes_per_second": target.ici_bytes_per_second,
          "dcn_bytes_per_second": target.dcn_bytes_per_second}


# --- formatting ---------------------------------------------------------------------------

def human_bytes(n: float | None) -> str:
  if n is None:
    return "-"
  sign, n = ("-" if n < 0 else ""), abs(float(n))
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
    n /= 1024
  raise AssertionError


def _seconds(s: float) -> str:
  if s != s:  # nan
    return "-"
  return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.1f} s"


def format_report(report: Report) -> str:
  r, run = report, report.run
  mesh = " ".join(f"{k}={v}" for k, v in run["mesh"].items())
  lines = [
      f"target     {r.target['description']}",
      f"model      {run['params'] / 1e9:.3f} B parameters, d_model {run['d_model']}, "
      f"{run['n_layers']} layers, vocab {run['vocab_size']}; {run['param_dtype']} parameters, "
      f"{run['compute_dtype']} compute, remat {run['remat']}"
      f"{', scanned layers' if run['scan_layers'] else ''}",
      f"run        mesh {mesh} (ici {run['mesh_ici']!r}"
      f"{', dcn ' + repr(run['mesh_dcn']) if run['mesh_dcn'] else ''}), rules {run['preset']}, "
      f"batch {run['global_batch_size']} x {run['seq_len']} tokens in "
      f"{run['microbatches']} micro-batch(es)",
      f"lint       parameters {human_bytes(r.lint['param_bytes'])} in all, "
      f"{human_bytes(r.lint['param_bytes_per_device'])} per device; replicated "
      f"{human_bytes(r.lint['replicated_bytes'])} ({r.lint['replicated_fraction']:.1%})",
  ]
  lines += [f"warning    {w}" for w in r.lint["warnings"]]
  lines += [f"note       {n}" for n in r.notes]
  lines.append(f"compile    {r.compile_seconds:.1f} s")
  lines.append("")
  a = r.analytic
  lines.append("memory per device        compiled     analytic")
  rows = []
  if r.memory:
    m = r.memory
    rows = [("arguments", m["arguments"], None), ("outputs", m["outputs"], None),
            ("temporaries", m["temporaries"], None), ("generated code", m["generated_code"], None),
            ("aliased (subtracted)", m["aliased"], None)]
  rows += [("params", None, a["params"]), ("optimizer state", None, a["optimizer"]),
           ("gradients", None, a["gradients"]), ("activations", None, a["activations"]),
           ("logits", None, a["logits"]), ("weights in use", None, a["weights_in_use"])]
  for name, compiled, analytic in rows:
    lines.append(f"  {name:<21}{_cell(compiled)}{_cell(analytic)}")
  total = r.memory["total"] if r.memory else (r.out_of_memory or {}).get("required_bytes")
  ratio = a.get("ratio_compiled_to_analytic")
  lines.append(f"  {'total':<21}{_cell(total)}{_cell(a['total'])}"
               + (f"  compiled/analytic {ratio:.2f}" if ratio else ""))
  if r.memory:
    lines.append(f"  (total = {r.memory['total_definition']})")
  hbm = r.target["hbm_bytes_per_device"]
  if r.out_of_memory:
    oom = r.out_of_memory
    lines.append(f"verdict    DOES NOT FIT: the compiler needs {human_bytes(oom['required_bytes'])}"
                 f" of {human_bytes(oom['available_bytes'])} usable HBM per chip "
                 f"({human_bytes(hbm)} on the chip): {oom['message']}")
  elif hbm is None:
    lines.append("verdict    compiled (a CPU target: no chip memory to fit)")
  else:
    headroom = r.memory["headroom"] if r.memory else None
    word = "FITS" if r.verdict == "fits" else "DOES NOT FIT"
    lines.append(f"verdict    {word} in {human_bytes(hbm)} HBM per chip"
                 + (f": headroom {human_bytes(headroom)} ({headroom / hbm:.0%})"
                    if headroom is not None else ""))
  lines.append("")
  f = r.flops
  lines.append("FLOPs per step, per device")
  if "xla_per_device" in f:
    lines.append(f"  XLA cost analysis        {f['xla_per_device']:.3e}  (loop bodies at most "
                 f"once: not used)")
  lines.append(f"  traced step (matmuls)    {f['traced_per_device']:.3e}  (loops counted, remat "
               f"recompute included)")
  lines.append(f"  analytic, with remat     {f['analytic_executed_per_device']:.3e}")
  lines.append(f"  model formula            {f['model_formula_per_device']:.3e}  "
               f"({f['model_formula_per_step']:.3e} per step / {r.target['devices']} devices)")
  if r.collectives:
    lines.append("")
    lines.append("collectives per step, per device (loop trip counts applied; ring estimates)")
    lines.append(f"  {'kind':<19}{'mesh axes':<30}{'ops':>5}{'runs':>7}{'payload':>13}"
                 f"{'sent ICI':>13}{'sent DCN':>13}")
    for c in r.collectives:
      lines.append(f"  {c['kind']:<19}{c['axes'] + (' [DCN]' if c['dcn'] else ''):<30}"
                   f"{c['ops']:>5}{c['executions']:>7}{human_bytes(c['payload_bytes']):>13}"
                   f"{human_bytes(c['ici_bytes']):>13}{human_bytes(c['dcn_bytes']):>13}")
  comm = r.communication
  lines.append("")
  if r.memory is not None or not r.out_of_memory:
    lines.append(f"sent per step, per device: ICI {human_bytes(comm['ici_bytes_compiled'])} "
                 f"compiled ({human_bytes(comm['ici_bytes_analytic'])} analytic), DCN "
                 f"{human_bytes(comm['dcn_bytes_compiled'])} compiled "
                 f"({human_bytes(comm['dcn_bytes_analytic'])} analytic)")
  else:
    lines.append(f"sent per step, per device (analytic; nothing compiled): ICI "
                 f"{human_bytes(comm['ici_bytes_analytic'])}, DCN "
                 f"{human_bytes(comm['dcn_bytes_analytic'])}")
  if r.step_time:
    s = r.step_time
    lines.append(f"step time  {_seconds(s['total_s'])} estimated = compute {_seconds(s['compute_s'])}"
                 f" + ICI {_seconds(s['ici_s'])} + DCN {_seconds(s['dcn_s'])} (no overlap, "
                 f"{s['communication']} communication); model FLOPs utilization "
                 f"{s['model_flops_utilization']:.0%}")
  return "\n".join(lines)


def _cell(value) -> str:
  return f"{human_bytes(value):>13}" if value is not None else f"{'':>13}"


# --- command line -------------------------------------------------------------------------

def _choices(values: list[str], known, flag: str) -> list[str]:
  for value in values:
    if value not in known:
      raise LintError(f"{flag}: {value!r} is unknown; choose from {', '.join(known)}")
  return values


def _counts(values: list[str]) -> list[int]:
  try:
    counts = [int(v) for v in values]
  except ValueError:
    counts = [0]
  if not counts or min(counts) < 1:
    raise LintError(f"--plan_microbatches={','.join(values)}: give positive integers, e.g. 1,2,4")
  return counts


def cli() -> None:
  """`python -m toolkit.compile`: flags are defined here and nowhere else."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. Experiment file and variant, e.g. experiments/lm.py:size=7b; "
      "--config.FIELD=VALUE overrides as in toolkit.train.", lock_config=True)
  topology_flag = flags.DEFINE_string(
      "topology", None, "Required. A Cloud TPU type from the table (v4-8, v5litepod-16 / v5e-16, "
      "v5p-128, v6e-256; python -m toolkit.topology lists them) or cpu:N for N simulated host "
      "devices.")
  slices_flag = flags.DEFINE_integer("slices", 1, "Slices of that type, connected over DCN.")
  json_flag = flags.DEFINE_string("json", None, "Also write the report (or the plan search) "
                                  "as JSON to this file.")
  hlo_flag = flags.DEFINE_string("hlo", None, "Write the compiled program's HLO text here.")
  plan_flag = flags.DEFINE_boolean(
      "plan", False, "Search meshes x rules presets x remat x micro-batches, compile the "
      "candidates the analytic estimate keeps, rank those that fit, write the best as a plan.")
  budget_flag = flags.DEFINE_float("plan_budget_s", 600.0, "Wall-clock budget of --plan's "
                                   "compiles, in seconds.")
  plan_out_flag = flags.DEFINE_string("plan_out", "plan.json", "Where --plan writes the plan.")
  workers_flag = flags.DEFINE_integer("plan_workers", 0, "Parallel compile processes for "
                                      "--plan; 0 picks from CPU cores and free memory.")
  presets_flag = flags.DEFINE_list("plan_presets", "dp,fsdp,tp,fsdp_tp",
                                   "Rules presets --plan tries.")
  remat_flag = flags.DEFINE_list("plan_remat", "none,save_dots,full", "Remat policies --plan "
                                 "tries.")
  micro_flag = flags.DEFINE_list("plan_microbatches", "1,2,4,8,16,32,64", "Micro-batch "
                                 "counts --plan tries (those that divide the batch; per mesh, "
                                 "the fewest that fit by the estimate and the next are compiled).")

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    # Compile-only TPU devices need JAX itself on CPU; set before any backend starts.
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    try:
      from toolkit.target import parse_name  # pylint: disable=g-import-not-at-top
      kind, count = parse_name(topology_flag.value)
      if kind == "cpu":
        jax.config.update("jax_num_cpu_devices", count * max(slices_flag.value, 1))
      target = target_for(topology_flag.value, slices_flag.value)
      config = config_flag.value
      if plan_flag.value:
        from toolkit import planner  # pylint: disable=g-import-not-at-top
        outcome = planner.search(
            config, target, budget_s=budget_flag.value, workers=workers_flag.value,
            presets=_choices(presets_flag.value, sharding.PRESETS, "--plan_presets"),
            remats=_choices(remat_flag.value, ("none", "save_dots", "full"), "--plan_remat"),
            microbatches=_counts(micro_flag.value), log=lambda line: print(line, flush=True))
        print(planner.format_ranking(outcome))
        if json_flag.value:
          with open(json_flag.value, "w") as f:
            json.dump(outcome.as_dict(), f, indent=2, default=str)
        if not outcome.best:
          unfinished = sum(c.status == "budget" for c in outcome.candidates)
          if unfinished:
            command_line.fail(f"no candidate fits among those compiled; {unfinished} were not "
                              f"compiled within --plan_budget_s={budget_flag.value:g}: raise it, "
                              f"or narrow --plan_presets / --plan_remat", DOES_NOT_FIT)
          command_line.fail("no candidate fits (see the table above); use a larger topology, "
                            "more slices, or a smaller batch or model", DOES_NOT_FIT)
        print(planner.finish(outcome, plan_out_flag.value, sys.argv))
        return
      report = compile_report(config, target, hlo_path=hlo_flag.value)
    except (TargetError, LintError, ConfigError, sharding.ShardingError) as e:
      command_line.fail(e, BAD_INPUT)
    except CompileError as e:
      command_line.fail(e, DOES_NOT_FIT)
    print(report.format(), flush=True)
    if json_flag.value:
      with open(json_flag.value, "w") as f:
        json.dump(report.as_dict(), f, indent=2, default=str)
    sys.exit(report.exit_code)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"topology": "a TPU type such as v5p-128 or cpu:8"}))


if __name__ == "__main__":
  cli()
