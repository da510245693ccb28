"""`python -m toolkit.serve`: an HTTP JSON endpoint over the continuous batcher, with
OpenAI's completions and chat completions (toolkit/serving/server.py has the endpoints and
their contract, toolkit/serving/openai_api.py the OpenAI routes). A recommendation model's
checkpoint (model.kind="dlrm") gets the scoring route instead, its requests batched across
clients (toolkit/serving/score_api.py).

  python -m toolkit.serve --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu --port=8000
  curl -s localhost:8000/generate -d '{"prompt": "The ", "max_tokens": 40, "temperature": 0.8}'
  python -m toolkit.serve --config=experiments/dlrm.py:movielens --checkpoint=runs/dlrm_movielens
"""
from __future__ import annotations

import os
import threading
import time


def cli() -> None:
  """`python -m toolkit.serve`: flags are defined here and nowhere else."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from toolkit import command_line, generate, runtime  # pylint: disable=g-import-not-at-top
  from toolkit import xla_flags  # pylint: disable=g-import-not-at-top
  from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from toolkit.inference import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from toolkit.inference import offline, requests, restore  # pylint: disable=g-import-not-at-top
  from toolkit.serving import openai_protocol  # pylint: disable=g-import-not-at-top
  from toolkit.inference.codec import Codec  # pylint: disable=g-import-not-at-top
  from toolkit.inference.sampling import RequestError  # pylint: disable=g-import-not-at-top
  from toolkit.serving.server import Server  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. The experiment file the checkpoint was trained with, e.g. "
      "experiments/lm.py:cpu; its mesh and sharding rules place the model.", lock_config=True)
  checkpoint_flag = flags.DEFINE_string("checkpoint", None, "Required. A training workdir or "
                                        "its checkpoints/ folder; the latest step is served.")
  host_flag, port_flag, queue_flag, timeout_flag = _define_server_flags()
  batch_flag = flags.DEFINE_integer("batch_size", 16, "Cache slots: requests decoded together.",
                                    lower_bound=1)
  cache_flag = flags.DEFINE_integer("cache_length", offline.DEFAULT_CACHE_LENGTH,
                                    "KV cache positions per request: prompt + max_tokens must "
                                    "fit.", lower_bound=2)
  model_name_flag, chat_template_flag = _define_openai_flags()
  score_flags = _define_score_flags()
  sampling_flags = generate.define_sampling_flags()
  engine_flags = generate.define_engine_flags()  # paged cache, chunked prefill, weights
  tokenizer_flag = generate.define_tokenizer_flag()
  cache_dir_flag = command_line.define_runtime_flags()

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    runtime.start(cache_dir_flag.value, mesh=config_flag.value.mesh,
                  xla_flags=xla_flags.setting_of(config_flag.value))
    command_line.check_platform()
    if config_flag.value.model.get("kind") == "dlrm":
      _serve_scores(config_flag.value, checkpoint_flag.value, host_flag.value, port_flag.value,
                    queue_flag.value, timeout_flag.value, score_flags)
      return
    try:
      defaults = requests.sampling_defaults(**{k: f.value for k, f in sampling_flags.items()})
      params, model_cfg, mesh, rules, step = restore.restore_params(config_flag.value,
                                                                     checkpoint_flag.value)
      codec = Codec.load(tokenizer_flag.value).check(model_cfg.vocab_size)
      template = (chat_template_flag.value
                  or openai_protocol.trained_chat_template(config_flag.value))
      openai_protocol.chat_encoder(codec, template)  # fails before the warm-up
      try:
        defaults.validate(model_cfg.vocab_size)
        options = generate.engine_options(engine_flags)
        engine = options.engine(model_cfg, params, mesh, rules, cache_flag.value)
        batcher = engine_lib.Batcher(engine, batch_flag.value, max_queue=queue_flag.value,
                                     **options.batcher())
      except RequestError as e:
        raise ConfigError(f"--{e}") from None
      print(f"restored step {step}; mesh {dict(mesh.shape)}, rules {rules.name}; "
            f"{engine.describe_weights()}; KV cache {batcher.cache_pages} pages of "
            f"{engine.page_size} positions; compiling every step shape before listening ...",
            flush=True)
      start = time.perf_counter()
      shapes = batcher.warmup(log=lambda line: print(line, flush=True))
      print(f"compiled {shapes} shapes in {time.perf_counter() - start:.1f} s", flush=True)
      info = {"step": step, "batch_size": batch_flag.value, "cache_length": cache_flag.value,
              "mesh": dict(mesh.shape), "rules": rules.name}
      model_name = model_name_flag.value or _workdir_name(checkpoint_flag.value)
      server = Server(batcher, defaults, host_flag.value, port_flag.value, timeout_flag.value,
                      info, codec, model_name, template).start()
    except (ConfigError, sharding.ShardingError, RequestError) as e:
      command_line.fail(e)
    _serve_until_stopped(server, model_name)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"checkpoint": "a training workdir, e.g. "
                                                 "--checkpoint=runs/lm_cpu"}))


def _define_server_flags():
  """--host, --port, --max_queue and --request_timeout: every server's."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return (flags.DEFINE_string("host", "127.0.0.1", "Address to bind; 0.0.0.0 exposes the "
                              "server to the network."),
          flags.DEFINE_integer("port", 8000, "TCP port; 0 picks a free one.", lower_bound=0,
                               upper_bound=65535),
          flags.DEFINE_integer("max_queue", 1024, "Requests that may wait for a slot; more get "
                               "503 (/generate, /v1/score) or 429 (/v1).", lower_bound=1),
          flags.DEFINE_float("request_timeout", 600.0, "Seconds before a request gets 504.",
                             lower_bound=1.0))


def _define_openai_flags():
  """--model_name and --chat_template, the OpenAI routes' (toolkit/serving/openai_api.py)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return (flags.DEFINE_string("model_name", "", "The model name of the OpenAI routes (GET "
                              "/v1/models); default: the checkpoint's workdir name, e.g. "
                              "lm_cpu."),
          flags.DEFINE_string("chat_template", "", "Jinja chat template (text or a .jinja "
                              "file) for /v1/chat/completions; default: the one a fine-tune's "
                              "config trained with (data.chat_template), else the --tokenizer "
                              "folder's, else a plain 'role: content' template."))


def _define_score_flags() -> dict:
  """The scoring server's flags (recommendation checkpoints only)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from toolkit.inference import score_requests  # pylint: disable=g-import-not-at-top
  return {
      "max_batch": flags.DEFINE_integer(
          "max_batch", 2048, "Recommendation models: the most candidates scored in one "
          "compiled call, from every waiting request.", lower_bound=1),
      "max_wait_ms": flags.DEFINE_float(
          "max_wait_ms", 0.0, "Recommendation models: how long a call waits for more requests "
          "after the first; 0 takes only those already waiting (requests gather while the "
          "previous call runs).", lower_bound=0.0),
      "max_candidates": flags.DEFINE_integer(
          "max_candidates", score_requests.MAX_CANDIDATES_DEFAULT, "Recommendation models: "
          "the most candidates in one request (at most --max_batch).", lower_bound=1)}


def _serve_scores(config, checkpoint: str, host: str, port: int, max_queue: int,
                  timeout_s: float, score_flags: dict) -> None:
  """The scoring server of a click model's checkpoint, until SIGINT/SIGTERM."""
  import sharding  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from toolkit.inference.sampling import RequestError  # pylint: disable=g-import-not-at-top
  from toolkit.serving import score_api  # pylint: disable=g-import-not-at-top
  try:
    server = score_api.start(
        config, checkpoint, host, port, score_flags["max_batch"].value,
        score_flags["max_wait_ms"].value / 1000, score_flags["max_candidates"].value,
        max_queue, timeout_s, log=lambda line: print(line, flush=True))
  except (ConfigError, sharding.ShardingError, RequestError) as e:
    command_line.fail(e)
  _serve_until_stopped(server, routes="POST /v1/score; GET /health, /metrics")


def _serve_until_stopped(server, model_name: str = "", routes: str = "") -> None:
  """Announces the server, then waits for SIGINT/SIGTERM (or the decode loop to die)."""
  import signal  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if not routes:
    print(f"chat template: {server.service.chat_template}", flush=True)
    routes = (f"POST /generate, /v1/completions, /v1/chat/completions; GET /v1/models, "
              f"/health, /metrics; model name {model_name!r}")
  print(f"serving on {server.url} ({routes}); Ctrl-C stops", flush=True)
  stopping = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stopping.set())
  while not stopping.wait(1.0):
    if not server.service.loop_alive():
      print("error: the decode loop stopped", file=sys.stderr, flush=True)
      break
  server.stop()
  print("stopped", flush=True)


def _workdir_name(checkpoint: str) -> str:
  """runs/lm_cpu and runs/lm_cpu/checkpoints -> lm_cpu."""
  path = os.path.normpath(checkpoint.rstrip("/"))
  if os.path.basename(path) == "checkpoints":
    path = os.path.dirname(path)
  return os.path.basename(path) or "meshkit"


if __name__ == "__main__":
  cli()
