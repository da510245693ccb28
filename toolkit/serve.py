"""`python -m toolkit.serve`: an HTTP JSON endpoint over the continuous batcher
(toolkit/inference/server.py has the endpoints and their contract).

  python -m toolkit.serve --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu --port=8000
  curl -s localhost:8000/generate -d '{"prompt": "The ", "max_tokens": 40, "temperature": 0.8}'
"""
from __future__ import annotations

import threading
import time


def cli() -> None:
  """`python -m toolkit.serve`: flags are defined here and nowhere else."""
  import signal  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from toolkit import command_line, generate, runtime  # pylint: disable=g-import-not-at-top
  from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from toolkit.inference import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from toolkit.inference import offline, requests, restore  # pylint: disable=g-import-not-at-top
  from toolkit.inference.codec import Codec  # pylint: disable=g-import-not-at-top
  from toolkit.inference.sampling import RequestError  # pylint: disable=g-import-not-at-top
  from toolkit.inference.server import Server  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. The experiment file the checkpoint was trained with, e.g. "
      "experiments/lm.py:cpu; its mesh and sharding rules place the model.", lock_config=True)
  checkpoint_flag = flags.DEFINE_string("checkpoint", None, "Required. A training workdir or "
                                        "its checkpoints/ folder; the latest step is served.")
  host_flag = flags.DEFINE_string("host", "127.0.0.1", "Address to bind; 0.0.0.0 exposes the "
                                  "server to the network.")
  port_flag = flags.DEFINE_integer("port", 8000, "TCP port; 0 picks a free one.", lower_bound=0,
                                   upper_bound=65535)
  batch_flag = flags.DEFINE_integer("batch_size", 16, "Cache slots: requests decoded together.",
                                    lower_bound=1)
  cache_flag = flags.DEFINE_integer("cache_length", offline.DEFAULT_CACHE_LENGTH,
                                    "KV cache positions per request: prompt + max_tokens must "
                                    "fit.", lower_bound=2)
  queue_flag = flags.DEFINE_integer("max_queue", 1024, "Requests that may wait for a slot; "
                                    "more get 503.", lower_bound=1)
  timeout_flag = flags.DEFINE_float("request_timeout", 600.0, "Seconds before a request gets "
                                    "504.", lower_bound=1.0)
  sampling_flags = generate.define_sampling_flags()
  tokenizer_flag = generate.define_tokenizer_flag()
  cache_dir_flag = command_line.define_runtime_flags()

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    runtime.start(cache_dir_flag.value, mesh=config_flag.value.mesh)
    command_line.check_platform()
    try:
      defaults = requests.sampling_defaults(**{k: f.value for k, f in sampling_flags.items()})
      params, model_cfg, mesh, rules, step = restore.restore_params(config_flag.value,
                                                                     checkpoint_flag.value)
      codec = Codec.load(tokenizer_flag.value).check(model_cfg.vocab_size)
      try:
        defaults.validate(model_cfg.vocab_size)
        engine = engine_lib.Engine(model_cfg, params, mesh, rules, cache_flag.value)
        batcher = engine_lib.Batcher(engine, batch_flag.value, max_queue=queue_flag.value)
      except RequestError as e:
        raise ConfigError(f"--{e}") from None
      print(f"restored step {step}; mesh {dict(mesh.shape)}, rules {rules.name}; compiling "
            f"every prefill and decode shape before listening ...", flush=True)
      start = time.perf_counter()
      shapes = batcher.warmup(log=lambda line: print(line, flush=True))
      print(f"compiled {shapes} shapes in {time.perf_counter() - start:.1f} s", flush=True)
      info = {"step": step, "batch_size": batch_flag.value, "cache_length": cache_flag.value,
              "mesh": dict(mesh.shape), "rules": rules.name}
      server = Server(batcher, defaults, host_flag.value, port_flag.value, timeout_flag.value,
                      info, codec).start()
    except (ConfigError, sharding.ShardingError, RequestError) as e:
      command_line.fail(e)
    print(f"serving on {server.url} (POST /generate, GET /health, GET /metrics); Ctrl-C stops",
          flush=True)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, lambda *_: stopping.set())
    while not stopping.wait(1.0):
      if not server.service.loop_alive():
        print("error: the decode loop stopped", file=sys.stderr, flush=True)
        break
    server.stop()
    print("stopped", flush=True)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"checkpoint": "a training workdir, e.g. "
                                                 "--checkpoint=runs/lm_cpu"}))


if __name__ == "__main__":
  cli()
