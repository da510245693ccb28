"""Moving a model between meshkit's Orbax checkpoints and Hugging Face folders
(`python -m toolkit.convert`). The format itself is `toolkit.hf`, below training; this package
sits above training because both directions need its checkpoints.

- `importer`: a Hugging Face folder -> a workdir whose step-0 checkpoint trains and serves;
- `exporter`: a workdir's checkpoint -> a folder that transformers loads;
- `adapters`: a LoRA checkpoint's adapters out, merged or as a PEFT adapter;
- `output`: the output folder, refused when it holds anything.
"""
from toolkit.conversion.exporter import export_checkpoint
from toolkit.conversion.importer import import_checkpoint

__all__ = ["export_checkpoint", "import_checkpoint"]
