"""What a model is trained to minimize, apart from what runs around the step:

- `tasks`: a model family's task (its loss, eval metrics and summary) composed into the step:
  the language model, classification, click prediction, preference tuning (DPO) and GRPO;
- `losses`: the next-token loss, in one pass or in chunks of the vocabulary;
- `dpo`: direct preference optimization's objective and its variants;
- `grpo`: group relative policy optimization's objective on fixed rollouts;
- `checks`: the validation pass's checks of the DPO and GRPO config sections;
- `click_metrics`: AUC and log loss of click predictions over a whole evaluation set.

What runs around the step for post-training (rollouts, GRPO's batches) is toolkit/post_training/.
"""
