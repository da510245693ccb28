"""Training.

  from toolkit import training
  result = training.run(config, workdir)     # what `python -m toolkit.train` runs
  setup = training.build(config)             # mesh, data, optimizer, abstract state, step

- `config`, `ranges`: the config's defaults and its one validation pass, and every numeric
  field's range;
- `setup`: a run's pieces that do not depend on its workdir (`build(config)`);
- `state`: the train state as an explicit pytree, its shardings and its creation;
- `step`: the training step, composed of small pure functions;
- `objectives/`: what a model is trained to minimize (tasks, losses, DPO, GRPO);
- `checkpoints/`: saving, fingerprints, the resume order, storage faults, the local tier;
- `init_from`: starting from existing weights with a fresh optimizer;
- `rowwise_adagrad`: row-wise Adagrad for embedding tables, touching only the rows looked up;
- `dpo_reference`: DPO's reference log-probabilities computed once;
- `loop`, `startup`: the loop (`run(config, workdir)`) and what a run does before its first
  step;
- `programs`: compiled programs kept beside JAX's compilation cache;
- `metrics`, `goodput`, `profiler`: metric files and plots, where the wall time went, profiler
  windows;
- `watchdog`, `stragglers`, `stop_signal`: a hang, a slow host, a stop by signal.
"""
from toolkit.training.loop import NonFiniteLoss, RunResult, run
from toolkit.training.setup import Setup, build

__all__ = ["NonFiniteLoss", "RunResult", "Setup", "build", "run"]
