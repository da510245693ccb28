"""meshkit's toolkit: the commands users type, each only its flags and cli(), over one
subpackage per concern.

- `train`, `sample`, `generate`, `predict`, `serve`, `evaluate`, `sweep`, `supervise`,
  `convert`: the commands that run (`python -m toolkit.NAME`);
- `compile`, `cost`, `topology`: the commands that answer before a run (will it fit, what it
  costs, the accelerator tables);
- `malloc_setting`: prints the malloc setting a command runs with;
- `errors`, `command_line`: the one user-mistake exception, and CLI mistakes as one line;
- `runtime`, `xla_flags`: JAX's process settings, and the flags that overlap collectives;
- `workdir`: a local folder or a Cloud Storage URL;
- `accelerators`: the TPU and GPU tables;
- `allocator`: glibc's huge-page malloc setting for every command;
- `data/`, `hf/`, `training/`, `planning/`, `pod/`, `inference/`, `serving/`, `evaluation/`,
  `post_training/`, `conversion/`, `tuning/`: the concerns.

A command starts with glibc's huge-page malloc setting, as `make` gives it (`allocator`):
this package re-starts `python -m toolkit.NAME` once with it, before anything heavy loads.
"""
from toolkit import allocator as _allocator

_allocator.restart_with_huge_pages()
