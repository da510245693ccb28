"""`python -m toolkit.compile`: will this config fit, and how will it run, on a TPU pod?
Answered from a laptop by the real compiler (toolkit/planning/aot.py explains the report).

  python -m toolkit.compile --config=experiments/lm.py:size=7b --topology=v5p-128
  python -m toolkit.compile --config=experiments/lm.py:size=7b --topology=v5p-128 --slices=2 \\
      --json=report.json
  python -m toolkit.compile --config=experiments/lm.py:cpu --topology=cpu:8   # no libtpu
  python -m toolkit.compile --config=experiments/lm.py:size=1b --topology=v5e-16 --plan
  python -m toolkit.compile --config=experiments/lm.py:size=7b --topology=v5e-8 --decode \\
      --quantize=int8 --decode_batch=8 --cache_length=64

Exit status: 0 fits (or a CPU target), 1 does not fit (or the compiler failed otherwise: its
first line is the error), 2 bad input (flags, config, sharding lint), each as one `error:` line.
`--plan` searches meshes, rules, remat, micro-batches, attention and loss chunking instead
(toolkit/planning/planner.py). `--decode` compiles the generation engine's decode step instead, for
the config's model, mesh and rules with the weights as `--quantize` serves them: weights per
device (and their ratio to bfloat16's), the compiler's total per device against the chip's HBM,
bytes accessed and FLOPs (toolkit/inference/decode_cost.py).
"""
from __future__ import annotations

import json
import os
import sys

import jax

import sharding
from toolkit import command_line
from toolkit import workdir
from toolkit import xla_flags
from toolkit.errors import ConfigError
from toolkit.planning.aot import CompileError, LintError, compile_report, parse_out_of_memory
from toolkit.planning.report import BAD_INPUT, DOES_NOT_FIT
from toolkit.planning.target import TargetError, target_for


def _choices(values: list[str], known, flag: str) -> list[str]:
  for value in values:
    if value not in known:
      raise LintError(f"{flag}: {value!r} is unknown; choose from {', '.join(known)}")
  return values


def _counts(values: list[str], flag: str = "--plan_microbatches", least: int = 1) -> list[int]:
  try:
    counts = [int(v) for v in values]
  except ValueError:
    counts = [least - 1]
  if not counts or min(counts) < least:
    kind = "positive integers, e.g. 1,2,4" if least else "integers >= 0, e.g. 2048,0"
    raise LintError(f"{flag}={','.join(values)}: give {kind}")
  return counts


def _plan(config, target, flag_values: dict, budget_s: float) -> None:
  """--plan: search, print the ranking, write the plan (and the JSON); exits non-zero when
  nothing fits."""
  from toolkit.planning import planner  # pylint: disable=g-import-not-at-top
  from models import attention  # pylint: disable=g-import-not-at-top
  from models.stack import REMAT_POLICIES  # pylint: disable=g-import-not-at-top
  chunks = flag_values["plan_loss_chunk"]
  outcome = planner.search(
      config, target, budget_s=budget_s, workers=flag_values["plan_workers"],
      presets=_choices(flag_values["plan_presets"], sharding.PRESETS, "--plan_presets"),
      remats=_choices(flag_values["plan_remat"], REMAT_POLICIES, "--plan_remat"),
      microbatches=_counts(flag_values["plan_microbatches"]),
      attentions=_choices(flag_values["plan_attention"], attention.CHOICES, "--plan_attention"),
      loss_chunks=_counts(chunks, "--plan_loss_chunk", least=0) if chunks else None,
      log=lambda line: print(line, flush=True))
  print(planner.format_ranking(outcome))
  if flag_values["json"]:
    workdir.write_text(flag_values["json"], json.dumps(outcome.as_dict(), indent=2, default=str))
  if not outcome.best:
    unfinished = sum(c.status == "budget" for c in outcome.candidates)
    if unfinished:
      command_line.fail(f"no candidate fits among those compiled; {unfinished} were not "
                        f"compiled within --plan_budget_s={budget_s:g}: raise it, "
                        f"or narrow --plan_presets / --plan_remat", DOES_NOT_FIT)
    command_line.fail("no candidate fits (see the table above); use a larger topology, "
                      "more slices, or a smaller batch or model", DOES_NOT_FIT)
  print(planner.finish(outcome, flag_values["plan_out"], sys.argv))


def _decode(config, target, flag_values: dict) -> None:
  """--decode: the decode step's report (and JSON); exits 1 when it does not fit."""
  from toolkit.inference import decode_cost  # pylint: disable=g-import-not-at-top
  from toolkit.planning.report import format_decode  # pylint: disable=g-import-not-at-top
  from toolkit.training import config as config_lib  # pylint: disable=g-import-not-at-top
  if flag_values["plan"] or flag_values["hlo"]:
    raise LintError("--decode reports the decode step: drop --plan and --hlo, or --decode")
  kind = config.model.get("kind", "llama")
  if kind != "llama":
    raise LintError(f"--decode: model.kind={kind!r} has no decode step; the generation "
                    f"engine serves the Llama LM")
  spec = config_lib.resolve(config, list(target.devices))
  try:
    compiled = decode_cost.compile_step(
        spec.model, spec.mesh, spec.rules, flag_values["decode_batch"],
        flag_values["cache_length"], flag_values["page_size"], flag_values["quantize"])
  except Exception as e:  # pylint: disable=broad-except  # XLA raises JaxRuntimeError
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    if parse_out_of_memory(str(e)) is None:
      raise CompileError(f"compiling the decode step for {target.name} failed: {first}") from e
    command_line.fail(f"the decode step does not fit {target.name}: {first}; serve fewer "
                      f"slots (--decode_batch), a shorter --cache_length or --quantize=int8",
                      DOES_NOT_FIT)
  report = {"topology": target.name, **decode_cost.costs(compiled)}
  hbm = target.hbm_bytes_per_device
  print(format_decode(report, f"the config's model on {target.name}", hbm), flush=True)
  if flag_values["json"]:
    workdir.write_text(flag_values["json"], json.dumps(report, indent=2, default=str))
  if hbm is not None and report["total_bytes_per_device"] > hbm:
    sys.exit(DOES_NOT_FIT)


def _define_decode_flags(flags) -> None:
  """--decode and the decode step's shape (absl's `flags` module)."""
  flags.DEFINE_boolean(
      "decode", False, "Compile the generation engine's decode step (toolkit.serve's) instead "
      "of the train step: weights and memory per device, bytes accessed, FLOPs.")
  flags.DEFINE_enum("quantize", "none", ["none", "bfloat16", "int8"], "--decode: the weights "
                    "as served (none: the model's dtype; int8: per-channel scales).")
  flags.DEFINE_integer("decode_batch", 16, "--decode: cache slots decoded per step.",
                       lower_bound=1)
  flags.DEFINE_integer("cache_length", 4096, "--decode: KV cache positions per slot.",
                       lower_bound=1)
  flags.DEFINE_integer("page_size", 16, "--decode: positions per cache page; 0: the contiguous "
                       "cache.", lower_bound=0)


def _check_outputs(flag_values: dict) -> None:
  """Refuses a gs:// output (--json, --hlo, --plan_out) that Cloud Storage would refuse, before
  minutes of compiling rather than after."""
  names = ("json", "hlo", "plan_out") if flag_values["plan"] else ("json", "hlo")
  for name in names:
    value = flag_values[name]
    if value and workdir.is_url(value):
      if (why := workdir.problem(value, f"--{name}", reach=True)) is not None:
        raise ConfigError(why)


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
  flags.DEFINE_string("plan_out", "plan.json", "Where --plan writes the plan.")
  flags.DEFINE_integer("plan_workers", 0, "Parallel compile processes for --plan; 0 picks "
                       "from CPU cores and free memory.")
  flags.DEFINE_list("plan_presets", "dp,fsdp,tp,fsdp_tp,fsdp_ep,fsdp_tp_ep,fsdp_cp,fsdp_pp",
                    "Rules presets --plan tries (the *_ep ones on meshes with an expert axis, "
                    "for mixtures of experts; fsdp_cp on meshes with a sequence axis, from "
                    "8192 positions; fsdp_pp across slices, a pipeline stage per slice).")
  flags.DEFINE_list("plan_remat", "none,save_dots,minimal,save_attention,full",
                    "Remat policies --plan tries.")
  flags.DEFINE_list("plan_microbatches", "1,2,4,8,16,32,64", "Micro-batch counts --plan "
                    "tries (those that divide the batch; per mesh, the fewest that fit by the "
                    "estimate and the next are compiled).")
  flags.DEFINE_list("plan_attention", "auto,xla", "model.attention values --plan tries "
                    "(auto is splash on TPU).")
  flags.DEFINE_list("plan_loss_chunk", "", "model.loss_chunk values --plan tries (0: full "
                    "logits); empty: the config's own and 0.")
  _define_decode_flags(flags)

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    # Compile-only TPU devices need JAX itself on CPU; set before any backend starts.
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    try:
      from toolkit.planning.target import parse_name  # pylint: disable=g-import-not-at-top
      kind, count = parse_name(topology_flag.value)
      if kind == "cpu":
        jax.config.update("jax_num_cpu_devices", count * max(slices_flag.value, 1))
      # A TPU's overlap flags go to LIBTPU_INIT_ARGS before libtpu loads in target_for.
      xla_flags.prepare_tpu_compile(kind, xla_flags.setting_of(config_flag.value),
                                    slices_flag.value, log=lambda line: print(line, flush=True))
      target = target_for(topology_flag.value, slices_flag.value)
      flag_values = flags.FLAGS.flag_values_dict()
      _check_outputs(flag_values)
      config = config_flag.value
      if flag_values["decode"]:
        _decode(config, target, flag_values)
        return
      if plan_flag.value:
        _plan(config, target, flag_values, budget_flag.value)
        return
      report = compile_report(config, target, hlo_path=hlo_flag.value,
                              log=lambda line: print(line, flush=True))
    except (TargetError, LintError, ConfigError, sharding.ShardingError) as e:
      command_line.fail(e, BAD_INPUT)
    except CompileError as e:
      command_line.fail(e, DOES_NOT_FIT)
    print(report.format(header=False), flush=True)  # the header came before compiling
    if json_flag.value:
      workdir.write_text(json_flag.value, json.dumps(report.as_dict(), indent=2, default=str))
    sys.exit(report.exit_code)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"topology": "a TPU type such as v5p-128 or cpu:8"}))


if __name__ == "__main__":
  cli()
