"""The Hugging Face checkpoint format: config.json <-> model config and the tensor table per
architecture (`architectures`, `llama`), reading safetensors slice by slice into given
shardings (`folder`, `reader`), writing safetensors shards (`writer`).

It depends only on `sharding`, `models` and `toolkit.errors`, not on training: training's
`train.init_from=hf:DIR` reads weights through it, and the import/export commands
(`toolkit.conversion`, `python -m toolkit.convert`) add the Orbax side.
"""
from toolkit.hf.architectures import ARCHITECTURES, Architecture, for_hf_config, for_model
from toolkit.hf.folder import HFFolder, special_tokens
from toolkit.hf.reader import read_params
from toolkit.hf.tensors import TensorMap
from toolkit.hf.writer import MAX_SHARD_BYTES, write_config, write_weights

__all__ = ["ARCHITECTURES", "Architecture", "HFFolder", "MAX_SHARD_BYTES", "TensorMap",
           "for_hf_config", "for_model", "read_params", "special_tokens", "write_config",
           "write_weights"]
