"""`python -m toolkit.convert` / `meshkit-convert`: Hugging Face checkpoints in and out.

  python -m toolkit.convert import --hf=runs/hf_tiny --workdir=runs/hf_import
  python -m toolkit.convert export --workdir=runs/hf_import --out=runs/hf_export

(`python scripts/data/tiny_hf_model.py --out=runs/hf_tiny` makes a tiny random model to try them.)
`import` also takes --config=experiments/lm.py:cpu (the mesh and rules to place the weights);
`export` takes --step=N (default the latest) and --hf_source=DIR (tokenizer files from there),
and for a run with LoRA adapters one of --merge_lora (the adapters merged into the weights: a
plain model folder) and --peft (adapter_config.json + adapter_model.safetensors, which
`peft.PeftModel.from_pretrained` loads on top of the base model).

`import` writes a workdir whose step-0 checkpoint `toolkit.train` continues (fine-tuning) and
`toolkit.generate` / `toolkit.serve` load; `export` writes config.json, safetensors shards and
the source folder's tokenizer files. The work is `toolkit.conversion` (docs/huggingface.md).
"""
from __future__ import annotations

IMPORT, EXPORT = "import", "export"
# Flags that only one command reads: giving them to the other is a mistake.
_ONLY = {"hf": IMPORT, "config": IMPORT, "out": EXPORT, "step": EXPORT, "hf_source": EXPORT,
         "max_shard_mb": EXPORT, "merge_lora": EXPORT, "peft": EXPORT}


def cli() -> None:
  """`python -m toolkit.convert import|export`: flags are defined here and nowhere else.

  Exit status: 0 when the folder was written; 2 for a command-line mistake; 1 for a bad
  Hugging Face folder, checkpoint or output folder. Every mistake is one `error:` line on
  stderr, and nothing is written.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "import: experiment file giving mesh, rules, optimizer and data (default: "
      "the training defaults); its model section is replaced by the folder's config.json.",
      lock_config=True)
  hf_flag = flags.DEFINE_string("hf", None, "import: a Hugging Face model folder (config.json, "
                                "model.safetensors or its sharded index).")
  workdir_flag = flags.DEFINE_string("workdir", None, "import: the new workdir (must not exist "
                                     "or be empty); export: the workdir to read.")
  out_flag = flags.DEFINE_string("out", None, "export: the new Hugging Face folder (must not "
                                 "exist or be empty).")
  step_flag = flags.DEFINE_integer("step", None, "export: the checkpoint step (default: the "
                                   "latest).", lower_bound=0)
  source_flag = flags.DEFINE_string("hf_source", None, "export: the folder the model came from, "
                                    "for its tokenizer files, token ids and "
                                    "max_position_embeddings (default: train.init_from's).")
  shard_flag = flags.DEFINE_integer("max_shard_mb", 2000, "export: the largest safetensors "
                                    "shard, in MB (10^6 bytes).", lower_bound=1)
  merge_flag = flags.DEFINE_boolean("merge_lora", False, "export: a run with LoRA adapters, "
                                    "written as one model with each adapter merged into its "
                                    "weight (W + alpha / rank x A B).")
  peft_flag = flags.DEFINE_boolean("peft", False, "export: a run with LoRA adapters, written "
                                   "as a PEFT adapter folder (adapter_config.json, "
                                   "adapter_model.safetensors) for its base model.")

  def main(argv) -> None:
    command = argv[1]
    command_line.quiet_logging()
    for name, owner in _ONLY.items():
      if owner != command and flags.FLAGS[name].present:
        command_line.fail(f"--{name} applies to `{owner}`, not `{command}`; leave it out",
                          command_line.USAGE_EXIT)
    needed = ({"hf": "a Hugging Face model folder, e.g. --hf=runs/hf_tiny",
               "workdir": "a new workdir, e.g. --workdir=runs/hf_import"} if command == IMPORT
              else {"workdir": "the workdir to export, e.g. --workdir=runs/hf_import",
                    "out": "a new folder, e.g. --out=runs/hf_export"})
    for name, what in needed.items():
      if flags.FLAGS[name].value is None:
        command_line.fail(f"--{name} is required for `{command}`; give {what}",
                          command_line.USAGE_EXIT)
    if merge_flag.value and peft_flag.value:
      command_line.fail("--merge_lora and --peft each choose how LoRA adapters are written; "
                        "give one of them", command_line.USAGE_EXIT)
    lora = "merge" if merge_flag.value else "peft" if peft_flag.value else ""
    # Imported after the flags are checked: a usage mistake is reported without loading JAX.
    from toolkit import runtime  # pylint: disable=g-import-not-at-top
    # The CPU when there is no accelerator; the devices an import's --config mesh needs.
    runtime.start(mesh=config_flag.value.mesh if config_flag.value is not None else None)
    import sharding  # pylint: disable=g-import-not-at-top
    from toolkit import conversion  # pylint: disable=g-import-not-at-top
    from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
    try:
      if command == IMPORT:
        conversion.import_checkpoint(hf_flag.value, workdir_flag.value, config_flag.value)
      else:
        conversion.export_checkpoint(workdir_flag.value, out_flag.value, step_flag.value,
                                     source_flag.value, shard_flag.value * 10**6, lora)
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, commands=(IMPORT, EXPORT), config_required=False))


if __name__ == "__main__":
  cli()
