"""Input data: byte-level text and synthetic tokens (`text`), pre-tokenized shards (`shards`),
images (`images`), Grain pipelines over them (`grain_batches`), and how batches reach the
devices (`feed`). `from_config(config, spec)` picks the batches a run reads."""
from toolkit.data.feed import BatchIterator, local_rows
from toolkit.data.inputs import from_config, token_unit
from toolkit.data.text import Batches, decode, encode

__all__ = ["Batches", "BatchIterator", "GrainBatches", "decode", "encode", "from_config",
           "local_rows", "token_unit"]


def __getattr__(name: str):
  """GrainBatches on first use: importing Grain costs runs that do not read through it."""
  if name == "GrainBatches":
    from toolkit.data.grain_batches import GrainBatches  # pylint: disable=g-import-not-at-top
    return GrainBatches
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
