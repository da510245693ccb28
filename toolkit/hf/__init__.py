"""The Hugging Face checkpoint format. It depends only on `sharding`, `models` and
`toolkit.errors`, not on training: `train.init_from=hf:DIR` reads weights through it, and
`toolkit.conversion` adds the Orbax side.

- `architectures`: the one table of architectures meshkit reads and writes;
- `llama`, `mixtral`: config.json <-> model config, and the tensor table of each;
- `tensors`: how one parameter is laid out in Hugging Face tensors;
- `folder`: a model folder on disk, checked;
- `reader`: safetensors read slice by slice into sharded parameters;
- `writer`: a model folder written as safetensors shards.
"""
from toolkit.hf.architectures import ARCHITECTURES, Architecture, for_hf_config, for_model
from toolkit.hf.folder import HFFolder, special_tokens
from toolkit.hf.reader import read_params
from toolkit.hf.tensors import TensorMap
from toolkit.hf.writer import MAX_SHARD_BYTES, write_config, write_weights

__all__ = ["ARCHITECTURES", "Architecture", "HFFolder", "MAX_SHARD_BYTES", "TensorMap",
           "for_hf_config", "for_model", "read_params", "special_tokens", "write_config",
           "write_weights"]
