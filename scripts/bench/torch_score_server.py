"""The baseline that scripts/bench/bench_score.py measures the scoring server against: the same
DLRM in plain PyTorch eager mode (nn.EmbeddingBag, nn.Linear), the checkpoint's weights, behind
the same route and request format (POST /v1/score, parsed by the same code), each request
scored on its own as it arrives.

  python scripts/bench/torch_score_server.py --config=experiments/dlrm.py:cpu \
    --checkpoint=runs/dlrm_cpu --port=0

Prints `serving on http://127.0.0.1:PORT (...)` once it listens, as toolkit.serve does.
"""
from __future__ import annotations

import asyncio
import signal

import jax
import numpy as np
import torch
from absl import app, flags
from aiohttp import web
from flax import nnx
from ml_collections import config_flags

from models.dlrm import DLRMConfig
from toolkit.inference.restore import restore_params
from toolkit.inference.sampling import RequestError
from toolkit.inference.score_requests import Features, parse_score_request
from toolkit.serving.http_request import BodyError, read_json

_CONFIG = config_flags.DEFINE_config_file("config", None, "The experiment file the checkpoint "
                                          "was trained with.", lock_config=False)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A training workdir.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 0, "TCP port; 0 picks a free one.")
KNUTH = 2654435761


class TorchDLRM(torch.nn.Module):
  """models/dlrm.py's DLRM, in PyTorch: sum-pooled bags, bottom MLP, DCN-v2, top MLP."""

  def __init__(self, cfg: DLRMConfig, params: dict):
    super().__init__()
    self.cfg = cfg
    as_tensor = lambda a: torch.from_numpy(np.asarray(a, np.float32).copy())
    self.tables = torch.nn.ModuleList(
        torch.nn.EmbeddingBag.from_pretrained(as_tensor(params[f"table{t}"]), mode="sum")
        for t in range(len(cfg.table_rows)))

    def linears(layers: dict) -> torch.nn.ModuleList:
      out = torch.nn.ModuleList()
      for i in range(len(layers) // 2):
        weight = as_tensor(layers[f"w{i}"])
        linear = torch.nn.Linear(*weight.shape)
        linear.weight.data, linear.bias.data = weight.T.contiguous(), as_tensor(layers[f"b{i}"])
        out.append(linear)
      return out

    self.bottom = linears(params["bottom"]) if cfg.dense_features else None
    self.top = linears(params["top"])
    cross = params["cross"]
    self.cross = [(as_tensor(cross[f"u{l}"]) @ as_tensor(cross[f"v{l}"]) if cfg.cross_rank
                   else as_tensor(cross[f"w{l}"]), as_tensor(cross[f"b{l}"]))
                  for l in range(cfg.cross_layers)]

  @staticmethod
  def _mlp(layers, x, last_relu: bool):
    for i, layer in enumerate(layers):
      x = layer(x)
      if i < len(layers) - 1 or last_relu:
        x = torch.relu(x)
    return x

  def forward(self, dense, ids, lengths) -> torch.Tensor:
    """Click probabilities of (n, F) dense, (n, T, bag) ids and (n, T) lengths (numpy)."""
    n, tables, bag = ids.shape
    pooled = []
    for t, rows in enumerate(self.cfg.table_rows):
      rows_of = ids[:, t].astype(np.int64) % 2**32
      if self.cfg.hash_ids:
        rows_of = rows_of * KNUTH % 2**32 % rows
      keep = np.arange(bag)[None, :] < lengths[:, t, None]
      offsets = np.concatenate([[0], np.cumsum(lengths[:, t])[:-1]])
      pooled.append(self.tables[t](torch.from_numpy(rows_of[keep]),
                                   torch.from_numpy(offsets.astype(np.int64))))
    if self.bottom is not None:
      pooled.insert(0, self._mlp(self.bottom, torch.from_numpy(dense), True))
    x0 = x = torch.cat(pooled, dim=1)
    for weight, bias in self.cross:
      x = x0 * (x @ weight + bias) + x
    return torch.sigmoid(self._mlp(self.top, x, False)[:, 0])


def main(argv) -> None:
  del argv
  config = _CONFIG.value
  config.mesh.ici = "data:1"
  params, model_cfg, *_ = restore_params(config, _CHECKPOINT.value, devices=jax.devices()[:1])
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(params) if isinstance(params, nnx.State)
                        else params)
  model = TorchDLRM(model_cfg, params).eval()
  features = Features.of(config.data.source)

  async def score(request: web.Request) -> web.Response:
    try:
      inputs = parse_score_request(await read_json(request), features, model_cfg.table_rows,
                                   model_cfg.hash_ids)
    except BodyError as e:
      return web.json_response({"error": e.message}, status=e.status)
    except RequestError as e:
      return web.json_response({"error": str(e)}, status=400)
    with torch.inference_mode():
      scores = model(inputs.dense, inputs.ids, inputs.lengths).numpy()
    return web.json_response({"scores": [round(float(s), 7) for s in scores],
                              "candidates": len(scores)})

  async def serve() -> None:
    application = web.Application(client_max_size=8 << 20)
    application.add_routes([web.post("/v1/score", score)])
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, _HOST.value, _PORT.value).start()
    host, port = runner.addresses[0][:2]
    print(f"serving on http://{host}:{port} (POST /v1/score; PyTorch {torch.__version__} "
          f"eager, {torch.get_num_threads()} threads)", flush=True)
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
      asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await runner.cleanup()

  asyncio.run(serve())


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "checkpoint"])
  app.run(main)
