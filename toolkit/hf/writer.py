"""Writing a Hugging Face model folder: config.json and safetensors shards of at most 2 GB with
`model.safetensors.index.json`, as `save_pretrained` lays them out.

The shards are streamed: a shard's header (every tensor's name, dtype, shape and byte range)
is known from the shapes alone, so it is written first and then each tensor's bytes as they
arrive, one tensor at a time. The `safetensors` library's writers take a whole dict of
tensors per file instead, which would hold up to a shard (2 GB) on the host.

The folder written is local: a gs:// export is written into a local staging folder and then
uploaded (`toolkit.conversion.output.staged`), since a shard is streamed to its file.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable

import numpy as np

from toolkit import workdir
from toolkit.hf.folder import CONFIG, INDEX_FILE, SINGLE_FILE
from toolkit.hf.tensors import TensorMap

MAX_SHARD_BYTES = 2 * 10**9  # what transformers' save_pretrained uses ("2GB")
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}
# (entry, index into its stacked axes: (layer,), (layer, expert) or ()) -> that tensor in HF
# layout, as a C-contiguous array
Fetch = Callable[[TensorMap, tuple[int, ...]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Planned:
  """One HF tensor to write."""
  entry: TensorMap
  at: tuple[int, ...]  # index into the entry's stacked axes
  nbytes: int

  @property
  def name(self) -> str:
    return self.entry.hf_name(*self.at)


def plan(table: list[TensorMap], n_layers: int, itemsize: int,
         max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[Planned]]:
  """The tensors grouped into shards in table order (layers in order), each shard at most
  `max_shard_bytes` unless one tensor alone is bigger."""
  tensors = [Planned(entry, at, math.prod(entry.hf_shape) * itemsize)
             for entry in table for at, _ in entry.hf_tensors(n_layers)]
  shards: list[list[Planned]] = [[]]
  for tensor in sorted(tensors, key=lambda t: (bool(t.at), t.at[:1])):
    if shards[-1] and sum(t.nbytes for t in shards[-1]) + tensor.nbytes > max_shard_bytes:
      shards.append([])
    shards[-1].append(tensor)
  return shards


def write_shard(path: str, tensors: list[Planned], dtype_name: str, fetch: Fetch,
                progress: Callable[[Planned], None] = lambda _: None) -> None:
  """One safetensors file: header first, then each tensor's bytes as `fetch` returns them."""
  header: dict = {"__metadata__": {"format": "pt"}}
  offset = 0
  for tensor in tensors:
    header[tensor.name] = {"dtype": _SAFETENSORS_DTYPES[dtype_name],
                           "shape": list(tensor.entry.hf_shape),
                           "data_offsets": [offset, offset + tensor.nbytes]}
    offset += tensor.nbytes
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for tensor in tensors:
      array = fetch(tensor.entry, tensor.at)
      if array.shape != tensor.entry.hf_shape or array.nbytes != tensor.nbytes:
        raise ValueError(f"{tensor.name}: got shape {array.shape}, {array.nbytes} bytes; "
                         f"planned {tensor.entry.hf_shape}, {tensor.nbytes}")
      # As raw bytes: Python's buffer protocol has no bfloat16.
      f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
      progress(tensor)


def write_weights(out: str, table: list[TensorMap], n_layers: int, dtype_name: str,
                  fetch: Fetch, max_shard_bytes: int = MAX_SHARD_BYTES,
                  progress: Callable[[Planned], None] = lambda _: None) -> list[str]:
  """`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards and the index, in
  the local folder `out`. Returns the file names written."""
  itemsize = np.dtype("float16" if dtype_name == "bfloat16" else dtype_name).itemsize
  shards = plan(table, n_layers, itemsize, max_shard_bytes)
  names = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
  for name, tensors in zip(names, shards):
    write_shard(os.path.join(out, name), tensors, dtype_name, fetch, progress)
  if len(shards) == 1:
    return names
  index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
           "weight_map": {t.name: name for name, s in zip(names, shards) for t in s}}
  write_json(os.path.join(out, INDEX_FILE), index)
  return names + [INDEX_FILE]


def write_json(path: str, value: dict) -> None:
  """`value` as the JSON file `path` (local or gs://), written whole."""
  workdir.write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_config(out: str, config: dict) -> str:
  path = workdir.join(out, CONFIG)
  write_json(path, config)
  return path
