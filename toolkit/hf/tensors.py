"""How one meshkit parameter is laid out in Hugging Face tensors, and reading any slice of it.

Hugging Face stores a linear layer as `weight` (out_features, in_features), one tensor per
layer; meshkit stores `x @ w` weights (in, out), with heads as their own axes, all layers
stacked along a leading `layers` axis. A `TensorMap` says how: each HF axis splits into one
or more meshkit axes (q_proj's rows are heads x head_dim), and `order` permutes the split axes
into meshkit's order. Every conversion, whole or a device's slice, goes through it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np

LAYER = "{layer}"  # stands for the layer index in the HF name of a per-layer tensor
EXPERT = "{expert}"  # and the expert index in the name of a per-expert tensor (Mixtral)


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """One meshkit parameter <-> one HF tensor (or one per layer, stacked).

  path: meshkit's parameter path, e.g. "layers/attention/wq".
  name: the HF tensor name; LAYER in it marks a per-layer tensor (stacked in meshkit), EXPERT
    (after LAYER) a per-expert one, stacked along meshkit's next axis (`experts` of them).
  split: for each HF axis, the sizes of the meshkit axes it holds, outermost first;
    q_proj (heads * head_dim, embed) is ((heads, head_dim), (embed,)).
  order: meshkit's axes (after the layers axis) as positions among the split axes;
    q_proj -> wq (embed, heads, head_dim) is (2, 0, 1).
  """
  path: str
  name: str
  split: tuple[tuple[int, ...], ...]
  order: tuple[int, ...]
  experts: int = 0

  @property
  def stacked(self) -> bool:
    return LAYER in self.name

  def stack_shape(self, n_layers: int) -> tuple[int, ...]:
    """meshkit's leading axes that index separate HF tensors: (layers,), (layers, experts)
    or ()."""
    return (((n_layers,) if self.stacked else ())
            + ((self.experts,) if EXPERT in self.name else ()))

  def hf_tensors(self, n_layers: int) -> Iterator[tuple[tuple[int, ...], str]]:
    """(index into the stacked axes, HF name) of every HF tensor this parameter holds."""
    for at in itertools.product(*map(range, self.stack_shape(n_layers))):
      yield at, self.hf_name(*at)

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """One layer's HF tensor shape."""
    return tuple(math.prod(sizes) for sizes in self.split)

  @property
  def layer_shape(self) -> tuple[int, ...]:
    """One layer's meshkit shape."""
    flat = [size for sizes in self.split for size in sizes]
    return tuple(flat[axis] for axis in self.order)

  def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
    return self.name.replace(LAYER, str(layer)).replace(EXPERT, str(expert))

  def to_meshkit(self, array: np.ndarray) -> np.ndarray:
    """One layer's HF tensor -> meshkit's layout."""
    flat = [size for sizes in self.split for size in sizes]
    return np.transpose(np.reshape(array, flat), self.order)

  def to_hf(self, array: np.ndarray) -> np.ndarray:
    """One layer's meshkit array -> the HF tensor (C order, ready to write)."""
    return np.ascontiguousarray(np.reshape(np.transpose(array, np.argsort(self.order)),
                                           self.hf_shape))

  def read(self, read_hf: Callable[[tuple[slice, ...]], np.ndarray],
           index: Sequence[slice]) -> np.ndarray:
    """meshkit's slice `index` of one layer (one slice per meshkit axis, normalized: start and
    stop set, step 1), reading only the HF rows and columns it needs: `read_hf(hf_index)`
    returns that block of the HF tensor (a safetensors `get_slice(...)[hf_index]`).

    An HF axis that holds several meshkit axes (heads x head_dim) is read over the range its
    outermost axis's slice covers, then cut down to the inner axes' slices."""
    split_slices: list[slice] = [slice(None)] * len(self.order)
    for meshkit_axis, axis in enumerate(self.order):
      split_slices[axis] = index[meshkit_axis]
    hf_index, block_shape, inner, position = [], [], [], 0
    for sizes in self.split:
      slices = split_slices[position:position + len(sizes)]
      position += len(sizes)
      rest = math.prod(sizes[1:])
      outer = slices[0]
      hf_index.append(slice(outer.start * rest, outer.stop * rest))
      block_shape += [outer.stop - outer.start, *sizes[1:]]
      inner += [slice(None), *slices[1:]]
    block = np.reshape(read_hf(tuple(hf_index)), block_shape)
    return np.transpose(block[tuple(inner)], self.order)


def normalize(index: Sequence[slice], shape: Sequence[int]) -> tuple[slice, ...]:
  """Slices with explicit start and stop (what jax's device index maps leave open)."""
  normalized = []
  for s, size in zip(index, shape):
    start, stop, step = s.indices(size)
    if step != 1:
      raise ValueError(f"strided device slice {s} is not supported")
    normalized.append(slice(start, stop))
  return tuple(normalized)
