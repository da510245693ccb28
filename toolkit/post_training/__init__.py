"""Post-training that joins the training step and the KV-cache engine:

- `rollouts`: G completions of each prompt sampled on the training mesh from the parameters
  being trained, in place, and the GRPO step's batch from them;
- `grpo_task`: GRPO as a training task (data.source="prompts"): the reward function, the
  batches sampled from the state being trained, the held-out greedy eval.

It sits above `training` (the step and the objective, toolkit/training/objectives/grpo.py) and
`inference` (the engine that samples).
"""
