"""Hyperparameter tuning.

- `search`: search spaces (`get_sweep(arg)`) and the trials they expand to;
- `runner`: sweeps, behind `python -m toolkit.sweep`;
- `population`, `trial_state`: many trials in one compiled program, and the state each trial
  holds its own copy of;
- `results`: the trials' table, plot and the best trial's launch command;
- `seeds`: one experiment over several seeds.
"""
