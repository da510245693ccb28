"""Evaluation on the tasks the field reports, through EleutherAI's lm-evaluation-harness
(`lm-eval`, an optional dependency: `pip install -e '.[eval]'`). It sits above `inference`
(its engine generates) and `training` (the loop runs its periodic work, handed in by
`toolkit.train`). Only `model` imports lm_eval at import time.

- `model`: the harness's `LM` on meshkit's sharded model;
- `scoring`: log-likelihoods of many sequences in few forward passes;
- `harness`: task loading and results;
- `tokens`: the tokenizer a checkpoint trained with;
- `exact_match`: a chat model's held-out exact match, answered greedily;
- `offline`: a checkpoint's evaluation (`python -m toolkit.evaluate`);
- `periodic`: tasks every N training steps (`train.eval_tasks`);
- `click_baselines`: the baselines a click model is compared with (scikit-learn's logistic
  regression, matrix factorisation).
"""
