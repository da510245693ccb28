"""Experiment files: each defines `get_config(arg)` returning an ml_collections.ConfigDict."""
