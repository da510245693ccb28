"""Input data. `from_config(config, spec)` picks the batches a run reads.

- `inputs`: which batches a config's `data.source` reads;
- `text`: byte-level text and synthetic tokens;
- `shards`: pre-tokenized text shards;
- `preparation`: text files and JSONL into shards with a train and a val split;
- `packing`: several whole documents per row, each attending only to itself;
- `images`: image classification data;
- `grain_batches`: Grain pipelines over shards and images, in an order that resumes exactly;
- `feed`: how batches reach the devices;
- `chat`, `chat_template`: conversations for fine-tuning, and chat templates rendered as
  transformers renders them;
- `instruct`: synthetic instruction tasks whose answers are checked exactly;
- `preference`: preference pairs for DPO;
- `prompts`: prompts and answers for GRPO;
- `criteo`: click logs in the Criteo format, read, and generated with a planted click model;
- `movielens`: MovieLens-100k's ratings as click examples with their features, split by time;
- `clicks`: click examples of either as Grain data sources, held out by time;
- `keys`: the names of the batch entries the tasks read.
"""
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
