"""Post-training that joins the training step and the KV-cache engine: reinforcement learning
with rollouts sampled on the training mesh (`rollouts`), the training parameters in place.

It sits above `training` (the step and the objective, toolkit/training/grpo.py) and
`inference` (the engine that samples).
"""
