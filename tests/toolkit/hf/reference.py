"""Shared pieces of the Hugging Face tests: tiny random HF Llama folders (built locally with
transformers, scripts/data/tiny_hf_model.py), meshkit's logits for a folder's weights imported
onto 8 devices, and the reference logits from transformers itself.

Tolerances, stated once: HF_PARITY for "the same model in PyTorch and in JAX" (different
kernels and summation orders, float32, 256 positions; issue 12's bound), and ROUND_TRIP for
transformers running meshkit's exported weights against meshkit on the same prompt.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sharding
from models import LlamaConfig
from tests import extras
from toolkit import hf
from toolkit.training import state as state_lib

torch = extras.require("torch")  # a skip without the test extra, a failure under CI=true
transformers = extras.require("transformers")
from scripts.data import tiny_hf_model  # noqa: E402  pylint: disable=wrong-import-position

HF_PARITY = 1e-4   # max |logit difference|, float32 (issue 12)
ROUND_TRIP = 1e-5  # max |logit difference| after export, float32 (issue 12)
PROMPT_LENGTH = 256

# The configurations the parity tests cover (overrides of tiny_hf_model.TINY): multi-head and
# grouped-query attention, tied and untied embeddings, rope_theta 5e5, head_dim != d/heads,
# Llama 3's RoPE scaling (TINY's) and none.
CONFIGS = {
    "mha_tied_theta5e5": dict(num_key_value_heads=4, tie_word_embeddings=True,
                              rope_scaling=None, rope_theta=500_000.0),
    "gqa_untied_head_dim24_llama3": dict(num_key_value_heads=2, head_dim=24,
                                         tie_word_embeddings=False),
    "gqa_tied_llama3": dict(num_attention_heads=8, num_key_value_heads=2),
}


def write_folder(path, name: str = "gqa_tied_llama3", seed: int = 0, **overrides):
  """A tiny random HF Llama folder (CONFIGS[name] + overrides) at `path`; returns the
  transformers model (eval mode) for reference logits."""
  return tiny_hf_model.write(str(path), seed=seed, **{**CONFIGS[name], **overrides})


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def mesh_and_rules(preset: str = "fsdp_tp"):
  return sharding.make_mesh([("fsdp", 4), ("tensor", 2)], []), sharding.Rules.preset(preset)


def import_params(path, preset: str = "fsdp_tp", cfg: LlamaConfig | None = None):
  """(params on 8 devices, model config, graphdef) read from the folder at `path`."""
  folder = hf.HFFolder(str(path))
  cfg = cfg or folder.model_config(LlamaConfig())
  mesh, rules = mesh_and_rules(preset)
  layout = state_lib.layout(cfg, optax.identity(), rules, mesh)
  params = hf.read_params(folder, cfg, layout.shardings["params"], progress=lambda _: None)
  return params, cfg, layout.graphdef


def meshkit_logits(graphdef, params, tokens: np.ndarray) -> np.ndarray:
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
  return np.asarray(forward(params, jnp.asarray(tokens)))


def prompt(vocab_size: int, length: int = PROMPT_LENGTH, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab_size, size=(1, length))
