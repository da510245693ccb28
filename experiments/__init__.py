"""Experiment files: each defines `get_config(arg)` returning an ml_collections.ConfigDict, and
some `get_sweep(arg)`; the docstring holds the launch command and the expected result.

- `lm`: the Llama-style LM on byte-level text (the CPU demo's);
- `moe`: the mixture-of-experts LM;
- `vit`: Vision Transformer image classifiers;
- `hf`: fine-tuning a Hugging Face Llama from its folder;
- `sft`: supervised fine-tuning on conversations;
- `dpo`: preference tuning with DPO;
- `grpo`: reinforcement learning with GRPO on a verifiable task;
- `dlrm`: click prediction with DLRM-DCNv2 (Criteo-format logs, MovieLens-100k).
"""
