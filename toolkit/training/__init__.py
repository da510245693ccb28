"""Training: config resolution (`config`), the train state (`state`), the step (`step`), what
a model is trained to do (`tasks`), checkpoints, metrics, and the loop (`loop`).

  from toolkit import training
  result = training.run(config, workdir)     # what `python -m toolkit.train` runs
  setup = training.build(config)             # mesh, data, optimizer, abstract state, step
"""
from toolkit.training.loop import NonFiniteLoss, RunResult, run
from toolkit.training.setup import Setup, build

__all__ = ["NonFiniteLoss", "RunResult", "Setup", "build", "run"]
