"""The report of one ahead-of-time compile (toolkit.planning.aot): its fields, its JSON and its
text as `python -m toolkit.compile` prints it."""
from __future__ import annotations

import dataclasses

FITS, DOES_NOT_FIT, BAD_INPUT = 0, 1, 2  # the command's exit codes


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
  # Async collective start/done pairs and synchronous collectives by kind, and the overlap
  # flags compiled with (aot._overlap); None when nothing compiled.
  overlap: dict | None = None

  @property
  def exit_code(self) -> int:
    return DOES_NOT_FIT if self.verdict == "does not fit" else FITS

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "exit_code": self.exit_code}

  def format(self, header: bool = True) -> str:
    return format_report(self, header)


_COUNT_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def human_count(n: float) -> str:
  """A count (of parameters) in the unit that reads best: 0.85 M, 1.2 B, 136.6 K, 512.

  The unit is the largest of K, M, B, T that the count reaches half of (so 850,000 is
  0.85 M, as the docs write a 0.9 M-parameter model, and 136,600 is 136.6 K); one decimal,
  two below 1. Below 500 the count itself."""
  sign, n = ("-" if n < 0 else ""), abs(float(n))
  for unit, size in _COUNT_UNITS:
    if n >= size / 2:
      value = n / size
      return f"{sign}{value:.2f} {unit}" if round(value, 2) < 1 else f"{sign}{value:.1f} {unit}"
  return f"{sign}{n:.0f}"


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


def format_report(report: Report, header: bool = True) -> str:
  """The report as `python -m toolkit.compile` prints it; without the `header_lines` (target,
  model, layout, lint) when `header` is False: the command prints those before compiling."""
  head = header_lines(report.target, report.run, report.lint) if header else []
  return "\n".join(head + _run_lines(report) + [""] + _memory_lines(report) + [""]
                   + _flops_lines(report) + _overlap_lines(report)
                   + _communication_lines(report))


def _run_lines(r: Report) -> list[str]:
  lines = [f"note       {n}" for n in r.notes]
  lines.append(f"compile    {r.compile_seconds:.1f} s")
  return lines


def header_lines(target: dict, run: dict, lint: dict) -> list[str]:
  """What is known before compiling: the target, the model, the step and the layout, the
  parameters' lint."""
  mesh = " ".join(f"{k}={v}" for k, v in run["mesh"].items())
  lines = [
      f"target     {target['description']}",
      f"model      {human_count(run['params'])} parameters, d_model {run['d_model']}, "
      f"{run['n_layers']} layers, vocab {run['vocab_size']}; {run['param_dtype']} parameters, "
      f"{run['compute_dtype']} compute, remat {run['remat']}"
      f"{', scanned layers' if run['scan_layers'] else ''}",
      *_lora_lines(run),
      f"step       attention {_attention(run)}; vocabulary loss {_loss(run)}",
      f"run        mesh {mesh} (ici {run['mesh_ici']!r}"
      f"{', dcn ' + repr(run['mesh_dcn']) if run['mesh_dcn'] else ''}), rules {run['preset']}, "
      f"batch {run['global_batch_size']} x {run['seq_len']} tokens in "
      f"{run['microbatches']} micro-batch(es)",
      f"lint       parameters {human_bytes(lint['param_bytes'])} in all, "
      f"{human_bytes(lint['param_bytes_per_device'])} per device; replicated "
      f"{human_bytes(lint['replicated_bytes'])} ({lint['replicated_fraction']:.1%}); "
      f"optimizer state {human_bytes(lint.get('opt_state_bytes_per_device'))} per device",
  ]
  lines += [f"warning    {w}" for w in lint["warnings"]]
  return lines


def _lora_lines(run: dict) -> list[str]:
  """The LoRA line: what trains and what is frozen (nothing without adapters)."""
  if not run.get("lora_rank"):
    return []
  return [f"lora       rank {run['lora_rank']} on {','.join(run['lora_targets'])}: "
          f"{human_count(run['trainable_params'])} trainable parameters; the base frozen in "
          f"{run['param_dtype']}, without gradients or optimizer state"]


def _attention(run: dict) -> str:
  chosen = run["attention"]
  return chosen if run["attention_setting"] == chosen else f"{chosen} (model.attention=auto)"


def _loss(run: dict) -> str:
  z = f", z-loss {run['z_loss']:g}" if run["z_loss"] else ""
  if not run["loss_chunk_positions"]:
    return "over full logits (model.loss_chunk=0)" + z
  return (f"in chunks of {run['loss_chunk_positions']} positions per row (model.loss_chunk="
          f"{run['loss_chunk']} tokens per device)" + z)


def _memory_lines(r: Report) -> list[str]:
  a = r.analytic
  lines = ["memory per device        compiled     analytic"]
  rows = []
  if r.memory:
    m = r.memory
    rows = [("arguments", m["arguments"], None), ("outputs", m["outputs"], None),
            ("temporaries", m["temporaries"], None), ("generated code", m["generated_code"], None),
            ("aliased (subtracted)", m["aliased"], None)]
  rows += [("params", None, a["params"]), ("optimizer state", None, a["optimizer"]),
           ("gradients", None, a["gradients"]), ("activations", None, a["activations"]),
           ("logits", None, a["logits"]), ("weights in use", None, a["weights_in_use"])]
  if a.get("reference"):
    rows.append(("frozen reference", None, a["reference"]))
  for name, compiled, analytic in rows:
    lines.append(f"  {name:<21}{_cell(compiled)}{_cell(analytic)}")
  total = r.memory["total"] if r.memory else (r.out_of_memory or {}).get("required_bytes")
  ratio = a.get("ratio_compiled_to_analytic")
  lines.append(f"  {'total':<21}{_cell(total)}{_cell(a['total'])}"
               + (f"  compiled/analytic {ratio:.2f}" if ratio else ""))
  if r.memory:
    lines.append(f"  (total = {r.memory['total_definition']})")
  return lines + [_verdict_line(r)]


def _verdict_line(r: Report) -> str:
  hbm = r.target["hbm_bytes_per_device"]
  if r.out_of_memory:
    oom = r.out_of_memory
    return (f"verdict    DOES NOT FIT: the compiler needs {human_bytes(oom['required_bytes'])}"
            f" of {human_bytes(oom['available_bytes'])} usable HBM per chip "
            f"({human_bytes(hbm)} on the chip): {oom['message']}")
  if hbm is None:
    return "verdict    compiled (a CPU target: no chip memory to fit)"
  headroom = r.memory["headroom"] if r.memory else None
  word = "FITS" if r.verdict == "fits" else "DOES NOT FIT"
  return (f"verdict    {word} in {human_bytes(hbm)} HBM per chip"
          + (f": headroom {human_bytes(headroom)} ({headroom / hbm:.0%})"
             if headroom is not None else ""))


def _flops_lines(r: Report) -> list[str]:
  f = r.flops
  lines = ["FLOPs per step, per device"]
  if "xla_per_device" in f:
    lines.append(f"  XLA cost analysis        {f['xla_per_device']:.3e}  (loop bodies at most "
                 f"once: not used)")
  kernel = (f", {r.run['attention']} attention {f['kernel_attention_per_device']:.3e} by formula"
            if f.get("kernel_attention_per_device") else "")
  lines.append(f"  traced step (matmuls)    {f['traced_per_device']:.3e}  (loops counted, remat "
               f"recompute included{kernel})")
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
  return lines


def _overlap_lines(r: Report) -> list[str]:
  """One line: how many collectives were scheduled async (start/done pairs, which can overlap
  compute) and how many run synchronously, and the flags a TPU compile ran with."""
  o = r.overlap
  if not o:
    return []
  total = o["async_pair_count"] + o["synchronous_count"]
  line = (f"async      {o['async_pair_count']} of {total} collectives scheduled async"
          f"{_by_kind(o['async_pairs'], ' (start/done pairs: ', ')')}"
          f"{_by_kind(o['synchronous'], '; synchronous: ')}")
  flags = o.get("flags")
  if flags is not None:
    ours, yours = flags["preset"], " ".join(flags["yours"])
    if ours:
      line += (f"; {flags['variable']}: {len(ours)} overlap flags of toolkit/xla_flags.py"
               + (f" and yours: {yours}" if yours else ""))
    else:
      line += f"; {flags['variable']}: " + (f"yours only: {yours}" if yours else
                                             "empty (libtpu's defaults)")
  return ["", line]


def _by_kind(counts: dict[str, int], before: str = "", after: str = "") -> str:
  """{'all-gather': 12, 'all-reduce': 1} -> before + 'all-gather 12, all-reduce 1' + after."""
  if not counts:
    return ""
  return before + ", ".join(f"{kind} {n}" for kind, n in counts.items()) + after


def _communication_lines(r: Report) -> list[str]:
  comm = r.communication
  lines = [""]
  if r.memory is not None or not r.out_of_memory:
    lines.append(f"sent per step, per device: ICI {human_bytes(comm['ici_bytes_compiled'])} "
                 f"compiled ({human_bytes(comm['ici_bytes_analytic'])} analytic), DCN "
                 f"{human_bytes(comm['dcn_bytes_compiled'])} compiled "
                 f"({human_bytes(comm['dcn_bytes_analytic'])} analytic)")
  else:
    lines.append(f"sent per step, per device (analytic; nothing compiled): ICI "
                 f"{human_bytes(comm['ici_bytes_analytic'])}, DCN "
                 f"{human_bytes(comm['dcn_bytes_analytic'])}")
  if r.step_time.get("memory_bytes") is not None:
    lines.append(f"memory traffic per step, per device (compiled): "
                 f"{human_bytes(r.step_time['memory_bytes'])} outside the matmuls (at the HBM "
                 f"bandwidth), {human_bytes(r.step_time['matmul_memory_bytes'])} in them "
                 f"(streamed under their FLOPs)")
  if r.step_time:
    s = r.step_time
    if "hidden_s" in s:
      overlap = (f" - {_seconds(s['hidden_s'])} of ICI hidden behind compute by the async "
                 f"collectives ({s['communication']} communication; "
                 f"{_seconds(s['no_overlap_s'])} without overlap)")
    else:
      overlap = f" (no overlap, {s['communication']} communication)"
    memory = f" + memory {_seconds(s['memory_s'])}" if s.get("memory_bytes") is not None else ""
    lines.append(f"step time  {_seconds(s['total_s'])} estimated = compute "
                 f"{_seconds(s['compute_s'])}{memory} + ICI {_seconds(s['ici_s'])} + DCN "
                 f"{_seconds(s['dcn_s'])}{overlap}; model FLOPs utilization "
                 f"{s['model_flops_utilization']:.0%}")
  return lines


def _cell(value) -> str:
  return f"{human_bytes(value):>13}" if value is not None else f"{'':>13}"


def format_decode(r: dict, title: str, hbm_bytes: int | None = None) -> str:
  """The decode step's report (toolkit/inference/decode_cost.py's costs) as lines; `title`
  names the model and the target, `hbm_bytes` the chip's memory the total is held against."""
  cache = f"paged, pages of {r['page_size']}" if r["page_size"] else "contiguous"
  weights = r["quantize"] if r["quantize"] != "none" else r["model_config"]["param_dtype"]
  ratio = r["weight_bytes_per_device"] / r["bfloat16_weight_bytes_per_device"]
  total = human_bytes(r["total_bytes_per_device"])
  if hbm_bytes:
    verdict = "fits" if r["total_bytes_per_device"] <= hbm_bytes else "does not fit"
    total += f" of {human_bytes(hbm_bytes)}: {verdict}"
  return (f"decode step, {title} (mesh {r['mesh']}, rules {r['rules']}), batch {r['batch']}, "
          f"cache {r['cache_length']} ({cache}), weights {weights}, layers "
          f"{'unrolled' if r['unrolled'] else 'scanned (cost counts one layer)'}:\n"
          f"  bytes accessed per device  {human_bytes(r['bytes_accessed_per_device'])} "
          f"(the KV cache: {human_bytes(r['cache_bytes_per_device'])} per device)\n"
          f"  FLOPs per device           {r['flops_per_device']:.4g}\n"
          f"  weights per device         {human_bytes(r['weight_bytes_per_device'])} "
          f"({ratio:.2f}x bfloat16's)\n"
          f"  temporaries per device     {human_bytes(r['temp_bytes_per_device'])}\n"
          f"  total per device           {total} (arguments + outputs + temporaries)")
