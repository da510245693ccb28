"""Model modules (Flax NNX) and their frozen configs. Models speak only logical axis names."""
from models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
