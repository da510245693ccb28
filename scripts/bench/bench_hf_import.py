"""Importing a Hugging Face checkpoint onto 8 devices: the time it takes and the host memory it
needs beyond the imported arrays themselves.

  python scripts/bench/bench_hf_import.py --d_model=1024 --layers=4     # a ~314 MB, 3-shard model

Writes a random Llama checkpoint (safetensors shards and their index, written with the
`safetensors` library) into --folder (default: a temporary folder), then imports it in a fresh
process on 8 simulated CPU devices under fsdp_tp and prints one JSON line:

  checkpoint_bytes, largest_tensor_bytes, seconds (the import), held_bytes (what the devices
  hold afterwards: on a CPU the devices' memory is host memory), peak_overhead_bytes (peak
  resident memory during the import minus the resident memory before it minus held_bytes),
  and its ratio to the largest tensor.

The peak is the kernel's own high-water mark (VmHWM, reset through /proc/self/clear_refs just
before the import). --naive also measures, in another fresh process, loading every tensor
with `safetensors.load_file` and placing the arrays afterwards, the way a converter without
slicing would (naive_peak_overhead_bytes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status(key: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


def make_checkpoint(folder: str, d_model: int, layers: int, shards: int = 3) -> dict:
  """A random untied Llama (vocab 16 x d_model, MLP 2.75 x d_model, 64-wide heads, 4 query
  heads per KV head) as `shards` safetensors files and the index; returns its config.json."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  heads, vocab, mlp = d_model // 64, 16 * d_model, d_model * 11 // 4
  kv = max(heads // 4, 1)
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": d_model, "intermediate_size": mlp, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5,
            "rope_theta": 500_000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
  shapes = {"model.embed_tokens.weight": (vocab, d_model), "model.norm.weight": (d_model,),
            "lm_head.weight": (vocab, d_model)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (d_model,),
                   p + "post_attention_layernorm.weight": (d_model,),
                   p + "self_attn.q_proj.weight": (heads * 64, d_model),
                   p + "self_attn.k_proj.weight": (kv * 64, d_model),
                   p + "self_attn.v_proj.weight": (kv * 64, d_model),
                   p + "self_attn.o_proj.weight": (d_model, heads * 64),
                   p + "mlp.gate_proj.weight": (mlp, d_model),
                   p + "mlp.up_proj.weight": (mlp, d_model),
                   p + "mlp.down_proj.weight": (d_model, mlp)})
  total = sum(4 * int(np.prod(s)) for s in shapes.values())
  rng = np.random.default_rng(0)
  names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
  weight_map, pending, filled, shard = {}, {}, 0, 0
  os.makedirs(folder, exist_ok=True)
  for name, shape in shapes.items():
    pending[name] = rng.standard_normal(shape, np.float32) * 0.02
    weight_map[name] = names[shard]
    filled += pending[name].nbytes
    if filled >= total * (shard + 1) / shards and shard < shards - 1:
      save_file(pending, os.path.join(folder, names[shard]), metadata={"format": "pt"})
      pending, shard = {}, shard + 1
  save_file(pending, os.path.join(folder, names[shard]), metadata={"format": "pt"})
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f)
  return config


def _reset_peak() -> int:
  """The resident size now, with the kernel's high-water mark reset to it."""
  before = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return before


def measure(folder: str, naive: bool) -> dict:
  """Imports `folder` onto this process's devices (fsdp 4 x tensor 2) slice by slice, or
  with `naive` whole; see the module doc."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from models import LlamaConfig  # pylint: disable=g-import-not-at-top
  from toolkit import hf  # pylint: disable=g-import-not-at-top
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top
  hf_folder = hf.HFFolder(folder, "--folder")
  cfg = hf_folder.model_config(LlamaConfig())
  mesh = sharding.make_mesh([("fsdp", 4), ("tensor", 2)], [])
  layout = state_lib.layout(cfg, optax.identity(), sharding.Rules.preset("fsdp_tp"), mesh)
  hf_folder.check(cfg)  # headers (and the lm_head/embedding comparison): not the import
  sizes = [4 * int(np.prod(t.shape)) for t in hf_folder.tensors.values()]
  result = {"checkpoint_bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}
  before = _reset_peak()
  start = time.perf_counter()
  if naive:
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    loaded = {}
    for name in sorted(set(t.file for t in hf_folder.tensors.values())):
      loaded.update(load_file(name))
    arrays = [jax.device_put(v, jax.devices()[0]) for v in loaded.values()]
  else:
    arrays = jax.tree.leaves(hf.read_params(hf_folder, cfg, layout.shardings["params"],
                                            progress=lambda _: None))
  jax.block_until_ready(arrays)
  result["seconds"] = time.perf_counter() - start
  result["held_bytes"] = sum(s.data.nbytes for a in arrays for s in a.addressable_shards)
  result["peak_overhead_bytes"] = _status("VmHWM") - before - result["held_bytes"]
  result["overhead_per_largest_tensor"] = (result["peak_overhead_bytes"]
                                           / result["largest_tensor_bytes"])
  return result


def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  d_model = flags.DEFINE_integer("d_model", 1024, "Width; vocab is 16x, the MLP 2.75x.",
                                 lower_bound=64)
  layers = flags.DEFINE_integer("layers", 4, "Layers.", lower_bound=1)
  folder = flags.DEFINE_string("folder", None, "Where the checkpoint goes (default: a "
                               "temporary folder, removed afterwards); an existing checkpoint "
                               "there is reused.")
  naive = flags.DEFINE_bool("naive", False, "Also measure load_file + device_put.")
  measure_only = flags.DEFINE_enum("measure", None, ["sliced", "naive"], "Internal: import "
                                   "--folder in this process that way and print the result.")

  def run(argv) -> None:
    del argv
    from toolkit import runtime  # pylint: disable=g-import-not-at-top
    runtime.start()  # no TPU or GPU: JAX on the CPU, without libtpu's start-up lines
    if measure_only.value:
      print(json.dumps(measure(folder.value, measure_only.value == "naive")), flush=True)
      return
    with tempfile.TemporaryDirectory() as scratch:
      path = folder.value or os.path.join(scratch, "checkpoint")
      if not os.path.isfile(os.path.join(path, "config.json")):
        make_checkpoint(path, d_model.value, layers.value)
      env = {**os.environ, "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
      result = {}
      for mode in ("sliced", "naive") if naive.value else ("sliced",):
        done = subprocess.run([sys.executable, __file__, f"--measure={mode}", f"--folder={path}"],
                              env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode:
          command_line.fail(f"the {mode} import failed: "
                            f"{done.stderr.strip().splitlines()[-1]}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        result.update(measured if mode == "sliced" else
                      {f"naive_{k}": measured[k] for k in ("seconds", "peak_overhead_bytes")})
    print(json.dumps(result))

  app.run(run, flags_parser=lambda argv: command_line.parse_flags(argv))


if __name__ == "__main__":
  main()
