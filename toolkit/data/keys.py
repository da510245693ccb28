"""Names of batch entries the training tasks read (toolkit/training/tasks.py), kept apart from
the data modules that fill them: those import Grain and the chat template, which the training
command imports only for the data that needs them (tests/toolkit/training/test_metrics.py)."""

# DPO's reference log-probabilities of each pair's two sides, (pairs, 2) float32, when
# dpo.reference="precomputed" (toolkit/data/preference.py, toolkit/training/dpo_reference.py).
REFERENCE_LOGPS = "reference_logps"
