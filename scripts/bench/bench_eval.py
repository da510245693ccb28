"""Benchmark: 1,000 log-likelihood requests (the harness's multiple-choice kind) through meshkit's
harness model (toolkit/evaluation/) against the harness's own Hugging Face backend (`hf`,
transformers on torch) on the same weights, on this machine's CPU.

  python scripts/bench/bench_eval.py            # 1,000 requests, a CPU-sized Llama (0.82 M)
  python scripts/bench/bench_eval.py --quick    # 40 requests, the tiny Llama: the smoke test

A random Llama the size of experiments/lm.py's `cpu` model (d_model 128, 4 layers, 4 heads, 2
KV heads, MLP 384; byte-level tokenizer with BOS and EOS: 258 tokens) is written as a Hugging
Face folder (scripts/data/tiny_hf_model.py), imported into a meshkit checkpoint and exported back
(toolkit.convert), so both evaluate the same weights. The requests are arithmetic questions and
their four candidate answers (scripts/data/eval_task_data.py), each answer one request, as a
multiple-choice task asks them. Both backends score --batch_size requests per forward pass;
meshkit's first call includes compiling one program per padded length (reported apart: the
same call again is "warm"). The largest log-likelihood difference between the two is reported
as a check. Needs the test extra (transformers, torch, lm-eval).
"""
from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags

_REQUESTS = flags.DEFINE_integer("requests", 1000, "Log-likelihood requests (4 per question).",
                                 lower_bound=4)
_BATCH = flags.DEFINE_integer("batch_size", 32, "Requests per forward pass, both backends.",
                              lower_bound=1)
_MAX_LENGTH = flags.DEFINE_integer("max_length", 128, "Tokens per input, both backends.")
_MESH = flags.DEFINE_string("mesh", "data:1", "meshkit's mesh, e.g. fsdp:4,tensor:2 (simulated "
                            "CPU devices).")
_RULES = flags.DEFINE_string("rules", "dp", "meshkit's sharding preset: dp, fsdp, tp, fsdp_tp.")
_QUICK = flags.DEFINE_bool("quick", False, "40 requests on the tiny model (seconds).")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")

# experiments/lm.py's `cpu` model as a Hugging Face Llama (its tokenizer adds BOS and EOS).
CPU_SIZED = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2)


def requests(count: int):
  """`count` (context, continuation) pairs: each question with each of its four answers."""
  from scripts.data import eval_task_data  # pylint: disable=g-import-not-at-top
  pairs = [(f"Question: What is {e['question']}?\nAnswer:", f" {choice}")
           for e in eval_task_data.choice_examples(-(-count // 4), seed=7)
           for choice in e["choices"]]
  return pairs[:count]


def models(folder: str, quick: bool):
  """(meshkit's LM, the harness's HFLM) on one random model written under `folder`."""
  from experiments import hf as hf_experiment  # pylint: disable=g-import-not-at-top
  from lm_eval.models.huggingface import HFLM  # pylint: disable=g-import-not-at-top
  from scripts.data import tiny_hf_model  # pylint: disable=g-import-not-at-top
  from toolkit import conversion  # pylint: disable=g-import-not-at-top
  from toolkit.evaluation import tokens  # pylint: disable=g-import-not-at-top
  from toolkit.evaluation.model import MeshkitLM  # pylint: disable=g-import-not-at-top
  from toolkit.inference.restore import restore_params  # pylint: disable=g-import-not-at-top
  original, workdir, exported = (os.path.join(folder, n) for n in ("hf", "run", "exported"))
  model = tiny_hf_model.write(original, **({} if quick else CPU_SIZED))
  conversion.import_checkpoint(original, workdir)
  conversion.export_checkpoint(workdir, exported)
  config = hf_experiment.get_config(f"{original},rules={_RULES.value}")
  config.mesh.ici = _MESH.value
  params, model_cfg, mesh, rules, _ = restore_params(config, workdir)
  meshkit = MeshkitLM(model_cfg, params, mesh, rules, tokens.codec_for(config),
                      _MAX_LENGTH.value, _BATCH.value)
  hf = HFLM(pretrained=exported, device="cpu", batch_size=_BATCH.value, add_bos_token=True,
            max_length=_MAX_LENGTH.value, dtype="float32")
  return meshkit, hf, model.num_parameters(), dict(mesh.shape)


def timed(lm, instances) -> tuple[float, list]:
  start = time.perf_counter()
  results = lm.loglikelihood(instances, disable_tqdm=True)
  return time.perf_counter() - start, results


def main(argv) -> None:
  del argv
  from ml_collections import ConfigDict  # pylint: disable=g-import-not-at-top
  from toolkit import command_line, runtime  # pylint: disable=g-import-not-at-top
  from toolkit.evaluation import harness  # pylint: disable=g-import-not-at-top
  command_line.quiet_logging()
  runtime.start(mesh=ConfigDict(dict(ici=_MESH.value, dcn="")))
  harness.require()
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
  count = 40 if _QUICK.value else _REQUESTS.value
  instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests(count))]
  with tempfile.TemporaryDirectory(prefix="bench-eval-") as folder:
    meshkit, hf, parameters, mesh = models(folder, _QUICK.value)
    cold, ours = timed(meshkit, instances)
    warm, _ = timed(meshkit, instances)
    theirs_s, theirs = timed(hf, instances)
  difference = float(np.max(np.abs(np.array([o[0] for o in ours]) -
                                   np.array([t[0] for t in theirs]))))
  result = {"requests": count, "parameters": parameters, "batch_size": _BATCH.value,
            "mesh": mesh, "meshkit_first_s": cold, "meshkit_warm_s": warm, "hf_s": theirs_s,
            "meshkit_passes": sum(meshkit.scorer.forward_calls.values()) // 2,
            "max_abs_loglikelihood_difference": difference,
            "load_average": os.getloadavg()[0]}
  print(f"{count} log-likelihood requests, {parameters / 1e6:.2f} M-parameter Llama, batch "
        f"{_BATCH.value}, meshkit on mesh {mesh}; load average {result['load_average']:.1f}")
  print(f"  meshkit  {cold:7.2f} s first call (compiles included), {warm:7.2f} s warm "
        f"({count / warm:,.0f} requests/s; {result['meshkit_passes']} forward passes)")
  print(f"  hf       {theirs_s:7.2f} s ({count / theirs_s:,.0f} requests/s)")
  print(f"  hf time / meshkit time: {theirs_s / warm:.2f} warm, {theirs_s / cold:.2f} first "
        f"call (above 1: meshkit is faster); max |log-likelihood difference| {difference:.1e}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
