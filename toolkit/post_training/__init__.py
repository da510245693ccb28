"""Post-training beyond supervised fine-tuning: preference tuning (`dpo`: direct preference
optimization's objective and its variants)."""
