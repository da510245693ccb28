"""Moving a model between meshkit's Orbax checkpoints and Hugging Face folders: `importer`
(HF folder -> a workdir whose step-0 checkpoint `toolkit.train` continues and
`toolkit.generate` / `toolkit.serve` load) and `exporter` (a workdir's checkpoint -> an HF
folder that transformers loads). `python -m toolkit.convert` is the command.

The format itself (config.json, tensor names and layouts, safetensors) is `toolkit.hf`, below
training; this package sits above training because both directions need its checkpoints.
"""
from toolkit.conversion.exporter import export_checkpoint
from toolkit.conversion.importer import import_checkpoint

__all__ = ["export_checkpoint", "import_checkpoint"]
