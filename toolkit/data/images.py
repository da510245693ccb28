"""Image classification data: sources (scikit-learn's digits, `.npz` arrays, a folder of
images per class, synthetic) and the augmentations, as Grain transforms.

Every source yields examples {"image": (H, W, C) float32 in [0, 1], "label": int32}. The
training transforms see a batch's local rows {"image": (rows, H, W, C), "label", "position"};
each row's randomness comes from (seed, its global position in the data order), so an
augmented batch depends on neither the process count nor the Grain worker count. The held-out
split gets only `Normalize`, never augmentation.
"""
from __future__ import annotations

import dataclasses
import os
import zipfile

import grain
import numpy as np

from toolkit.errors import ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


@dataclasses.dataclass(frozen=True)
class ImageShape:
  size: int
  channels: int
  num_classes: int


class ArrayImages:
  """In-memory images (N, H, W, C) float32 and labels (N,) int32: a Grain data source."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, name: str):
    self.images, self.labels, self.name = images, labels, name

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {"image": self.images[index], "label": self.labels[index]}

  def __repr__(self) -> str:  # Grain keeps it in the iterator state
    return f"ArrayImages({self.name!r}, {len(self)})"


class FolderImages:
  """Image files decoded on demand (in Grain's workers), resized to the model's size."""

  def __init__(self, paths: list[str], labels: np.ndarray, shape: ImageShape, name: str):
    self.paths, self.labels, self.shape, self.name = paths, labels, shape, name

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    from PIL import Image  # pylint: disable=g-import-not-at-top  # Pillow comes with matplotlib
    path = self.paths[index]
    try:
      with Image.open(path) as image:
        image = image.convert("L" if self.shape.channels == 1 else "RGB")
        image = image.resize((self.shape.size, self.shape.size), Image.BILINEAR)
        pixels = np.asarray(image, np.float32) / 255.0
    except (OSError, ValueError) as e:
      raise ConfigError(f"image {path} cannot be decoded ({e}); remove or replace it") from None
    if pixels.ndim == 2:
      pixels = pixels[:, :, None]
    return {"image": pixels, "label": self.labels[index]}

  def __repr__(self) -> str:
    return f"FolderImages({self.name!r}, {len(self)})"


class SyntheticImages:
  """Noise images with labels i % classes: for smoke tests and ahead-of-time compiles."""

  def __init__(self, count: int, shape: ImageShape, salt: int):
    self.count, self.shape, self.salt = count, shape, salt

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.salt, int(index)])
    s = self.shape
    return {"image": rng.random((s.size, s.size, s.channels), np.float32),
            "label": np.int32(int(index) % s.num_classes)}

  def __repr__(self) -> str:
    return f"SyntheticImages({self.count}, {self.salt})"


# --- loading ----------------------------------------------------------------------------------

def _check_arrays(images: np.ndarray, labels: np.ndarray, shape: ImageShape, where: str,
                  field: str) -> tuple[np.ndarray, np.ndarray]:
  if images.ndim == 3:
    images = images[..., None]
  want = (shape.size, shape.size, shape.channels)
  if images.ndim != 4 or images.shape[1:] != want:
    raise ConfigError(f"{where}: images have shape {images.shape}, expected (N, {want[0]}, "
                      f"{want[1]}, {want[2]}) for model.image_size={shape.size}, "
                      f"model.channels={shape.channels}; resize the images or set those fields")
  if len(images) == 0:
    raise ConfigError(f"{where}: the dataset is empty; give at least one image ({field})")
  if labels.shape != (len(images),):
    raise ConfigError(f"{where}: labels have shape {labels.shape}, expected ({len(images)},): "
                      f"one integer label per image")
  if labels.min() < 0 or labels.max() >= shape.num_classes:
    raise ConfigError(f"{where}: labels span {labels.min()}..{labels.max()}, outside 0.."
                      f"{shape.num_classes - 1}; set model.num_classes={int(labels.max()) + 1}")
  if np.issubdtype(images.dtype, np.integer):
    images = images.astype(np.float32) / 255.0
  return images.astype(np.float32), labels.astype(np.int32)


def load_npz(path: str, shape: ImageShape, field: str) -> ArrayImages:
  """An `.npz` with arrays `images` (N, H, W[, C]; uint8 0-255 or float 0-1) and `labels`."""
  if not os.path.isfile(path):
    raise ConfigError(f"{field}={path!r} does not exist; give an .npz file with arrays "
                      f"'images' and 'labels'")
  try:
    with np.load(path) as archive:
      missing = [k for k in ("images", "labels") if k not in archive.files]
      if missing:
        raise ConfigError(f"{path} has no array {missing[0]!r} (it has "
                          f"{', '.join(archive.files) or 'none'}); save images= and labels=")
      images, labels = archive["images"], archive["labels"]
  except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
    raise ConfigError(f"{path} is not a readable .npz file ({e}); rewrite it with "
                      f"numpy.savez(path, images=..., labels=...)") from None
  images, labels = _check_arrays(images, labels, shape, path, field)
  return ArrayImages(images, labels, path)


def load_folder(directory: str, shape: ImageShape, field: str,
                class_names: list[str] | None = None) -> tuple[FolderImages, list[str]]:
  """`directory/<class name>/<image files>`; classes in sorted order (or `class_names`)."""
  if not os.path.isdir(directory):
    raise ConfigError(f"{field}={directory!r} is not a directory; give a folder with one "
                      f"sub-folder of images per class")
  found = sorted(e.name for e in os.scandir(directory) if e.is_dir())
  names = class_names or found
  extra = sorted(set(found) - set(names))
  if extra:
    raise ConfigError(f"{directory}: class folder {extra[0]!r} is not among the training "
                      f"classes ({', '.join(names)})")
  if len(names) > shape.num_classes:
    raise ConfigError(f"{directory} has {len(names)} class folders but model.num_classes="
                      f"{shape.num_classes}; set model.num_classes={len(names)}")
  paths, labels = [], []
  for label, name in enumerate(names):
    folder = os.path.join(directory, name)
    if not os.path.isdir(folder):
      continue
    for file in sorted(os.listdir(folder)):
      if file.lower().endswith(IMAGE_SUFFIXES):
        paths.append(os.path.join(folder, file))
        labels.append(label)
  if not paths:
    raise ConfigError(f"{directory}: the dataset is empty (no {'/'.join(IMAGE_SUFFIXES)} files "
                      f"in its class folders); check {field}")
  return FolderImages(paths, np.asarray(labels, np.int32), shape, directory), names


def load_digits(shape: ImageShape) -> ArrayImages:
  """scikit-learn's 1,797 handwritten digits, 8x8, values 0-16 scaled to [0, 1]."""
  try:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError("data.source='digits' needs scikit-learn: pip install -e '.[vision]'"
                      ) from None
  digits = datasets.load_digits()
  images, labels = _check_arrays(digits.images.astype(np.float32) / 16.0, digits.target,
                                 shape, "scikit-learn digits", "data.source")
  return ArrayImages(images, labels, "sklearn.datasets.load_digits")


def split(source: ArrayImages | FolderImages, held_out_fraction: float):
  """A fixed held-out split (the same for every seed): every example's fate is drawn once."""
  order = np.random.default_rng(20261130).permutation(len(source))
  count = max(1, int(round(len(source) * held_out_fraction)))
  if count >= len(source):
    raise ConfigError(f"{source.name}: {len(source)} example(s) leave nothing to train on after "
                      f"holding out data.eval_fraction={held_out_fraction}")
  held, train = np.sort(order[:count]), np.sort(order[count:])
  if isinstance(source, ArrayImages):
    return (ArrayImages(source.images[train], source.labels[train], source.name + ":train"),
            ArrayImages(source.images[held], source.labels[held], source.name + ":held_out"))
  pick = lambda idx, tag: FolderImages([source.paths[i] for i in idx], source.labels[idx],
                                       source.shape, source.name + tag)
  return pick(train, ":train"), pick(held, ":held_out")


def load_splits(data_config, shape: ImageShape):
  """(train source, held-out source) for `data.source` in digits / npz / image_folder /
  synthetic; the held-out split is `data.eval_path` when given, else a fixed fraction."""
  d = data_config
  if d.source == "synthetic":
    return SyntheticImages(1024, shape, salt=0), SyntheticImages(256, shape, salt=1)
  if d.source == "digits":
    return split(load_digits(shape), d.eval_fraction)
  if d.source == "npz":
    train = load_npz(d.path, shape, "data.path")
    if d.eval_path:
      return train, load_npz(d.eval_path, shape, "data.eval_path")
    return split(train, d.eval_fraction)
  train, names = load_folder(d.path, shape, "data.path")
  if d.eval_path:
    return train, load_folder(d.eval_path, shape, "data.eval_path", names)[0]
  return split(train, d.eval_fraction)


# --- transforms -------------------------------------------------------------------------------

class RandomCropFlip(grain.transforms.Map):
  """Pads each image by `padding` pixels (zeros) and crops back at a random offset; flips it
  left-right with probability 1/2 when `flip`. Randomness per row from (seed, position)."""

  def __init__(self, padding: int, flip: bool, seed: int):
    self.padding, self.flip, self.seed = padding, flip, seed

  def map(self, element: dict) -> dict:
    images, p = element["image"], self.padding
    out = np.empty_like(images)
    size_y, size_x = images.shape[1:3]
    padded = np.pad(images, ((0, 0), (p, p), (p, p), (0, 0))) if p else images
    for row, position in enumerate(element["position"]):
      rng = np.random.default_rng([self.seed, int(position)])
      y, x = rng.integers(0, 2 * p + 1, size=2)
      image = padded[row, y:y + size_y, x:x + size_x]
      out[row] = image[:, ::-1] if self.flip and rng.random() < 0.5 else image
    return {**element, "image": out}


class Normalize(grain.transforms.Map):
  """(image - mean) / std, every channel alike."""

  def __init__(self, mean: float, std: float):
    self.mean, self.std = mean, std

  def map(self, element: dict) -> dict:
    return {**element, "image": ((element["image"] - self.mean) / self.std).astype(np.float32)}
