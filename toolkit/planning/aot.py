"""Will this config fit, and how will it run, on a TPU pod? Answered from a laptop by the real
compiler (`python -m toolkit.compile` is the command): the training step is lowered and compiled for a named topology's devices without
having them, and the report sets what the compiler says next to what the formulas say.

  python -m toolkit.compile --config=experiments/lm.py:size=7b --topology=v5p-128
  python -m toolkit.compile --config=experiments/lm.py:size=7b --topology=v5p-128 --slices=2 \\
      --json=report.json
  python -m toolkit.compile --config=experiments/lm.py:cpu --topology=cpu:8   # no libtpu
  python -m toolkit.compile --config=experiments/lm.py:size=1b --topology=v5e-16 --plan

The step is the training run's own: `toolkit.training.build(config, devices)` on the target's
devices (the same `sharding.make_mesh`, rules, model, optimizer and step; a -1 in mesh.ici
fills from the target's device count), jitted by `toolkit.training.step.jit_step` and compiled on
abstract inputs. TPU targets need libtpu (`pip install -e '.[tpu]'`); their devices come from
`toolkit.planning.target` (the accelerator table's `topology_desc_kwargs`).

The report, printed and as JSON (--json):
  memory per device   compiled.memory_analysis(): arguments, outputs, temporaries, generated
                      code; total = arguments + outputs + temporaries + generated code - aliased
                      (donated state: outputs that reuse argument buffers), against the chip's
                      HBM from the table: fits / does not fit, and the headroom. When the
                      compiler itself refuses ("Ran out of memory ... hbm") its figures are
                      the verdict.
  analytic            params, optimizer, gradients, activations under the remat policy,
                      logits, weights in use (`toolkit.planning.estimate`), and compiled / analytic
  FLOPs               compiled.cost_analysis() (which counts a loop body once: scanned layers,
                      micro-batches), the same with loops counted, and the model formula
  collectives         from compiled.as_text(), by kind and mesh axes, bytes per step with loop
                      trip counts applied; what crosses slices (DCN) is flagged
  async               collectives scheduled async (start/done pairs) and synchronous, by
                      kind (`toolkit.planning.scheduling`), and the overlap flags libtpu compiled
                      with (toolkit/xla_flags.py; toolkit.compile sets them)
  memory traffic      bytes the compiled program's instructions read and write, loops
                      counted (`toolkit.planning.traffic`): outside the matmuls, and in them
  step time           compute at the chip's peak, plus the memory traffic outside the
                      matmuls at its HBM bandwidth, plus communication at the table's ICI/DCN
                      bandwidth, less the ICI time the async collectives can hide behind that
                      work (each kind's bytes times its share of async instructions, at most
                      the compute and memory time); the bound without overlap beside it
Exit status: 0 fits (or a CPU target), 1 does not fit (or the compiler failed otherwise: its
first line is the error), 2 bad input (flags, config, sharding
lint: replicated parameters above the limit with replicated_action=fail, dimensions that do not
divide their mesh axes, a batch the data axes do not divide), each as one `error:` line.
`--plan` searches meshes, rules, remat and micro-batches instead (`toolkit.planning.planner`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import ml_collections

import sharding
from models import lora
from models import pipeline as pipeline_lib
from toolkit import workdir
from toolkit import xla_flags
from toolkit.errors import ConfigError
from toolkit.planning import collectives as collectives_lib
from toolkit.planning import estimate
from toolkit.planning import scheduling
from toolkit.planning import traffic as traffic_lib
from toolkit.planning import report as report_lib
from toolkit.planning.report import Report
from toolkit.planning.target import Target
from toolkit.training import setup as setup_lib
from toolkit.training import step as step_lib


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
  opt_state = jax.tree.leaves(setup.layout.abstract["opt_state"])
  return {"param_bytes": report.total_bytes, "param_bytes_per_device": report.per_device_bytes,
          # exact, from the state layout: what the optimizer holds (with LoRA: for adapters)
          "opt_state_bytes_per_device": sum(
              math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in opt_state),
          "replicated_bytes": report.replicated_bytes,
          "replicated_fraction": report.replicated_fraction, "warnings": [warning] if warning
          else []}


def compile_report(config: ml_collections.ConfigDict, target: Target, *,
                   hlo_path: str | None = None, log=None) -> Report:
  """Lints, compiles the training step of `config` for `target` and reports. `log` (a
  callable taking a line), when given, gets the report's header (target, model, layout, lint)
  and a "compiling" line before the compile, which takes minutes for a large model.

  Raises:
    LintError: a config or sharding mistake (the message names the field and the fix).
    CompileError: the compiler failed for another reason than memory.
  """
  config, notes = scale_config(config, target)
  setup, lint = _build_for(config, target)
  spec, layout = setup.spec, setup.layout
  shape = estimate.shape_for(spec, config, layout.report, target.slices)
  if log is not None:
    log("\n".join(report_lib.header_lines(_target_dict(target), _run_dict(config, spec, shape),
                                          lint)))
    log(f"compiling the train step for {target.name} (minutes for a billion-parameter model) ...")
  traced, compiled, out_of_memory, compile_seconds = _compile(setup, target)
  memory, analytic, verdict = _memory_verdict(compiled, out_of_memory, shape, target, notes)
  flops = _flops(shape, target, traced, compiled)
  if flops["model_formula_per_device"] > flops["traced_per_device"] * (1 + 1e-6):
    notes.append(_undercount_note(flops))
  found: list[collectives_lib.Collective] = []
  overlap, memory_traffic = None, None
  if compiled is not None:
    text = compiled.as_text()
    memory_traffic = traffic_lib.memory_traffic(text)
    if hlo_path:
      workdir.write_text(hlo_path, text)  # a local file or a gs:// object
    found = collectives_lib.parse(text, list(spec.mesh.shape.items()),
                                  _slice_ids(spec.mesh, target))
    overlap = _overlap(text, target)
  if shape.activation_ways("layers") > 1:
    notes.append(_pipeline_note(found, shape.activation_ways("layers"),
                                config.model.pipeline_microbatches, config.train.microbatches,
                                config.model.get("pipeline_repeats", 1)))
  summaries = collectives_lib.summarize(found)
  communication = _communication(shape, summaries)
  step_time = _step_time(flops, communication, target, memory_traffic)
  if step_time and overlap:
    step_time.update(_hidden(step_time, summaries, overlap, target))
  return Report(
      target=_target_dict(target), run=_run_dict(config, spec, shape), lint=lint,
      verdict=verdict, compile_seconds=compile_seconds, memory=memory,
      out_of_memory=out_of_memory, analytic=analytic, flops=flops,
      collectives=[dataclasses.asdict(s) for s in summaries], communication=communication,
      step_time=step_time, notes=notes, overlap=overlap)


def _overlap(hlo_text: str, target: Target) -> dict:
  """Whether the compiled step overlaps its collectives with compute: async start/done pairs
  and synchronous collectives by kind (toolkit/planning/scheduling.py), and for a TPU the flags
  libtpu compiled with (LIBTPU_INIT_ARGS as it loaded: toolkit.xla_flags's preset, the
  user's own)."""
  overlap = scheduling.read(hlo_text).as_dict()
  overlap["flags"] = xla_flags.in_effect("tpu") if target.is_tpu else None
  return overlap


def _pipeline_note(found: list[collectives_lib.Collective], stages: int, microbatches: int,
                   accumulated: int, repeats: int = 1) -> str:
  """The pipeline's bubble: from the compiled loop's trip count (how often the activations'
  shift between stages, a collective-permute over `stage`, runs per step, over the
  `accumulated` training micro-batches that each run the pipeline) beside the formula."""
  formula = pipeline_lib.bubble_fraction(stages, microbatches, repeats)
  shifts = [c.count for c in found if c.kind == "collective-permute" and "stage" in c.axes]
  work = repeats * microbatches
  rounds = f" x {repeats} rounds" if repeats > 1 else ""
  text = (f"pipeline: {stages} stages x {microbatches} micro-batches{rounds}, bubble "
          f"(S-1)/({'R' if repeats > 1 else ''}M+S-1) = {formula:.1%}")
  if shifts:
    # The shift ops inside the pipeline's loops run once per iteration; a few outside run once.
    trips = max(shifts, key=lambda n: (shifts.count(n), n)) // accumulated
    text += (f"; compiled: the stage shift runs {trips} times per pass, bubble "
             f"1 - {work}/{trips} = {1 - work / trips:.1%}")
  return text


def _build_for(config: ml_collections.ConfigDict, target: Target):
  """The run's setup on the target's devices, and the lint of its parameter shardings."""
  kind = config.model.get("kind", "llama")
  if kind != "llama":
    # The analytic estimate, the model formula and the planner are written for the LM.
    raise LintError(f"model.kind={kind!r}: toolkit.compile reports on the Llama LM only so "
                    f"far; for other models lower the step yourself (tests/models/test_vit.py "
                    f"shows the ViT-B/16 on v5p-16)")
  try:
    setup = setup_lib.build(config, devices=list(target.devices))
    return setup, _lint(setup, config)
  except (ConfigError, sharding.ShardingError) as e:
    raise LintError(str(e)) from None
  except ValueError as e:  # jax's mesh_utils: the mesh does not map onto the physical chips
    raise LintError(f"mesh.ici={config.mesh.ici!r} (dcn {config.mesh.dcn!r}) does not map onto "
                    f"{target.name}'s chips: {str(e).splitlines()[0]}; choose axis sizes that "
                    f"are products of the slice's physical dimensions") from None


def _compile(setup, target: Target):
  """(traced, compiled or None, the compiler's out-of-memory figures or None, seconds)."""
  abstract_batch = setup.batches.abstract()
  train_jit, _ = step_lib.jit_step(setup.step, setup.layout, abstract_batch, setup.spec.mesh)
  start = time.perf_counter()
  try:
    traced = train_jit.trace(setup.layout.abstract, abstract_batch)
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
  return traced, compiled, out_of_memory, time.perf_counter() - start


def _memory_verdict(compiled, out_of_memory, shape, target: Target, notes: list[str]):
  """(compiled memory per device or None, the analytic estimate, the verdict)."""
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
  return memory, analytic, verdict


def traced_flops_per_device(shape, jaxpr) -> float:
  """The step's FLOPs per device that its time estimate and MFU use: the traced program's
  matmuls (`program_flops`; its shapes are global) over the devices that split the work,
  plus the attention a trace cannot count (`estimate.kernel_attention_flops_per_device`)."""
  return (program_flops(jaxpr) / shape.work_ways
          + estimate.kernel_attention_flops_per_device(shape))


def _flops(shape, target: Target, traced, compiled) -> dict:
  flops = {"model_formula_per_step": estimate.model_flops_per_step(shape),
           "model_formula_per_device": estimate.model_flops_per_step(shape) / target.chips,
           "analytic_executed_per_device": estimate.executed_flops_per_device(shape),
           "traced_per_step": program_flops(traced.jaxpr),
           "traced_per_device": traced_flops_per_device(shape, traced.jaxpr),
           "kernel_attention_per_device": estimate.kernel_attention_flops_per_device(shape),
           "note": FLOPS_NOTE}
  if compiled is not None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops["xla_per_device"] = float(cost.get("flops", 0.0)) if cost else 0.0
  return flops


def _undercount_note(flops: dict) -> str:
  """Why MFU reads above what the step achieves: model FLOPs exceed the traced count, which
  holds the same work plus remat's recomputation and attention's masked pairs. Said, not
  clamped."""
  return (f"the model formula's {flops['model_formula_per_device']:.3e} FLOPs per device exceed "
          f"the traced step's {flops['traced_per_device']:.3e}, so the step time is short and "
          f"MFU too high: either the step skips work the formula counts (a MoE capacity factor "
          f"below 1 drops assignments) or the count misses some (a loop or kernel "
          f"toolkit.planning.aot.program_flops leaves out and the estimate does not add: a bug)")


def _communication(shape, summaries) -> dict:
  ici_formula, dcn_formula = estimate.communication(shape)
  return {"ici_bytes_compiled": sum(s.ici_bytes for s in summaries),
          "dcn_bytes_compiled": sum(s.dcn_bytes for s in summaries),
          "ici_bytes_analytic": ici_formula, "dcn_bytes_analytic": dcn_formula}


def _step_time(flops: dict, communication: dict, target: Target,
               memory_traffic: traffic_lib.Traffic | None) -> dict:
  """Compute at the chip's peak, the compiled program's memory traffic outside the matmuls at
  its HBM bandwidth, and communication at the table's bandwidths (TPU only)."""
  if not target.is_tpu:
    return {}
  kind = "compiled" if memory_traffic is not None else "analytic"
  step_time = estimate.step_seconds(
      flops["traced_per_device"], communication[f"ici_bytes_{kind}"],
      communication[f"dcn_bytes_{kind}"], target.peak_flops_per_device,
      target.ici_bytes_per_second, target.dcn_bytes_per_second,
      memory_traffic.memory_bytes if memory_traffic else 0.0, target.hbm_bytes_per_second)
  step_time["communication"] = kind
  if memory_traffic is not None:
    step_time["memory_bytes"] = memory_traffic.memory_bytes
    step_time["matmul_memory_bytes"] = memory_traffic.matmul_bytes
  step_time["model_flops_utilization"] = (
      flops["model_formula_per_device"] / target.peak_flops_per_device / step_time["total_s"])
  return step_time


def _hidden(step_time: dict, summaries, overlap: dict, target: Target) -> dict:
  """The ICI time the compiled schedule can hide behind compute: each kind's ICI bytes times
  the share of its instructions scheduled async (start/done pairs), up to the compute and
  memory time;
  DCN transfers and synchronous collectives stay exposed. The instruction share stands in for
  the byte share (the schedule names instructions, not transfers). Returns the fields to
  update: hidden_s, no_overlap_s (the bound without overlap) and total_s with the hidden time
  taken off (model_flops_utilization with it)."""
  pairs, synchronous = overlap["async_pairs"], overlap["synchronous"]
  share = {k: pairs.get(k, 0) / (pairs.get(k, 0) + synchronous.get(k, 0))
           for k in set(pairs) | set(synchronous) if pairs.get(k, 0) + synchronous.get(k, 0)}
  hideable = sum(s.ici_bytes * share.get(s.kind, 0.0) for s in summaries)
  busy = step_time["compute_s"] + step_time.get("memory_s", 0.0)
  hidden = min(busy, hideable / target.ici_bytes_per_second)
  total = step_time["total_s"] - hidden
  return {"hidden_s": hidden, "no_overlap_s": step_time["total_s"], "total_s": total,
          "model_flops_utilization": step_time["model_flops_utilization"]
          * step_time["total_s"] / total}


def _run_dict(config: ml_collections.ConfigDict, spec, shape) -> dict:
  model, mesh = spec.model, spec.mesh
  return {"params": shape.param_count, "d_model": model.d_model, "n_layers": model.n_layers,
          "vocab_size": model.vocab_size, "param_dtype": model.param_dtype,
          "compute_dtype": model.compute_dtype, "remat": model.remat,
          "attention": shape.attention, "attention_setting": model.attention,
          "loss_chunk": model.loss_chunk, "loss_chunk_positions": shape.loss_chunk_positions,
          "z_loss": model.z_loss, "scan_layers": model.scan_layers, "mesh": dict(mesh.shape),
          "mesh_ici": config.mesh.ici, "mesh_dcn": config.mesh.dcn,
          "preset": spec.rules.name, "global_batch_size": shape.global_batch_size,
          "seq_len": config.data.seq_len, "microbatches": config.train.microbatches,
          "lora_rank": getattr(model, "lora_rank", 0), "lora_targets": lora.targets(model),
          "trainable_params": (shape.param_count if shape.trainable_count is None
                               else shape.trainable_count)}


FLOPS_NOTE = (
    "xla: compiled.cost_analysis(), which counts each while-loop body (the scanned layers, the "
    "micro-batch loop) at most once; on TPU it also came out below even that for long "
    "sequences, so it is shown but not used. traced: matmul FLOPs (dot_general, 2 per "
    "multiply-add) of the step's jaxpr, the program XLA compiles, with scan bodies counted "
    "length times and remat recomputation included, divided over the devices that split the "
    "work (batch axes x tensor x sequence x pipeline stages); the splash kernel's matmuls "
    "(inside a Pallas call) and causal blockwise attention's (in while loops of unknown trip "
    "count) are left out of the program and added by the analytic count "
    "(toolkit.planning.estimate.attention_flops_per_token). A mixture of experts' ragged dots count "
    "every row of their buffer: the ring of experts multiplies the tokens gathered from its "
    "expert-axis peers, of which its own experts get about 1/(expert ways). model formula: "
    "LlamaConfig.flops_per_token x tokens / devices (a token's k experts; causal attention at "
    "half the (query, key) pairs, as MaxText counts it), the numerator of MFU")


def program_flops(jaxpr) -> float:
  """Matmul FLOPs of a (closed) jaxpr: 2 x multiply-adds of every dot_general (and ragged
  dot), scan bodies times their length, the larger branch of a cond, a shard_map body (one
  device's share) times the devices of its mesh, other sub-jaxprs (pjit, remat,
  custom_jvp/vjp) once. Left out, for `estimate.kernel_attention_flops_per_device` to count:
  a Pallas kernel (its jaxpr is one grid step's) and a while loop, whose trip count is
  unknown here (in the train step: causal blockwise attention's block loops)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "ragged_dot_general"):
      # A ragged dot multiplies each row with its group's matrix: counted like a dot whose
      # rows all belong to a group (the ring's buffer counts whole; see FLOPS_NOTE).
      numbers = (eqn.params["dimension_numbers"] if name == "dot_general" else
                 eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers)
      (lhs_contract, _), _ = numbers
      lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
      total += 2.0 * math.prod(out) * math.prod(lhs[i] for i in lhs_contract)
    elif name == "scan":
      total += eqn.params["length"] * program_flops(eqn.params["jaxpr"])
    elif name == "shard_map":
      total += eqn.params["mesh"].size * program_flops(eqn.params["jaxpr"])
    elif name == "cond":
      total += max(program_flops(b) for b in eqn.params["branches"])
    elif name in ("while", "pallas_call"):
      continue
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
