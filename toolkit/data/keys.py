"""Names of batch entries the training tasks read (toolkit/training/objectives/tasks.py), kept apart from
the data modules that fill them: those import Grain and the chat template, which the training
command imports only for the data that needs them (tests/toolkit/training/test_metrics.py)."""

# DPO's reference log-probabilities of each pair's two sides, (pairs, 2) float32: served with
# the data when dpo.reference="precomputed" (toolkit/data/preference.py,
# toolkit/training/dpo_reference.py), computed in the step from a frozen copy when "frozen".
REFERENCE_LOGPS = "reference_logps"
# GRPO's reference log-probability of each position's target, (rows, length) float32, when the
# state holds a frozen reference copy (toolkit/training/objectives/tasks.py `grpo_reference`).
REFERENCE_TOKEN_LOGPS = "reference_token_logps"

# GRPO's reductions that average over the batch's completion tokens: their batches name the
# completion mask "loss_weights", so micro-batches are combined by their tokens
# (toolkit/training/step.py weighted_loss_and_grads); the others name it "completion_weights".
TOKEN_MEAN_LOSSES = ("bnpo", "dapo")


def mask_key(loss: str) -> str:
  """The name of a GRPO batch's completion mask for the reduction `loss`."""
  return "loss_weights" if loss in TOKEN_MEAN_LOSSES else "completion_weights"
