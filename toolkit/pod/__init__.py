"""Pods, what runs during a job:

- `distributed`: joining the processes of a job into one JAX program;
- `local`: a pod simulated with local processes on one machine;
- `elastic`: hosts lost and returned mid-run, the job shrunk and grown back;
- `supervisor`: restarting a crashed or hung job from its last checkpoint.

What is known before a run (targets, compiles, estimates, the planner, costs) is
toolkit/planning/. The accelerator table itself is `toolkit.accelerators` (the launchers use
it too).
"""
