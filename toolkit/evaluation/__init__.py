"""Evaluation on the tasks the field reports, through EleutherAI's lm-evaluation-harness
(`lm-eval`, an optional dependency: `pip install -e '.[eval]'`): the harness's `LM` on meshkit's
sharded model (`model`: log-likelihoods from batched forward passes, `scoring`; generation
through the KV-cache engine), task loading and results (`harness`), the tokenizer a checkpoint
trained with (`tokens`), a checkpoint's evaluation (`offline`, `python -m toolkit.evaluate`) and
tasks every N training steps (`periodic`, `train.eval_tasks`).

It sits above `inference` (its engine generates) and `training` (the loop runs its periodic
work, handed in by `toolkit.train`). Only `model` imports lm_eval at import time; the rest
imports it when tasks are loaded.
"""
