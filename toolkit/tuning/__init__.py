"""Hyperparameter tuning: search spaces (`search`), population training of many trials in one
program (`population`), the sweep runner (`runner`) and its results (`results`)."""
