"""A byte-level text corpus found on every machine: the Python standard library.

The ``*.py`` files under ``sysconfig.get_paths()['stdlib']`` (without
``site-packages`` / ``dist-packages``), in sorted order of their relative
paths, are concatenated as raw bytes up to a cap. Every ``valid_every``-th
file goes to the validation split, the rest to training; tokens are bytes
(vocabulary 256). The content depends only on the Python version.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

VOCAB_SIZE = 256
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Path] = None) -> list[Path]:
  """Every ``*.py`` under the stdlib, sorted by relative path (deterministic)."""
  root = stdlib_dir() if root is None else Path(root)
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
    for name in filenames:
      if name.endswith(".py"):
        path = Path(dirpath) / name
        found.append((path.relative_to(root).as_posix(), path))
  return [path for _, path in sorted(found)]


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
  """Train and validation bytes (uint8 arrays) and where they came from."""

  train: np.ndarray
  valid: np.ndarray
  num_files: int
  root: str

  @property
  def vocab_size(self) -> int:
    return VOCAB_SIZE

  def describe(self) -> str:
    return (
      f"{self.num_files} stdlib .py files from {self.root}: "
      f"{self.train.size / 1e6:.2f} MB train, "
      f"{self.valid.size / 1e6:.2f} MB valid"
    )


def load_stdlib_corpus(
  max_mb: float = 8.0, valid_every: int = 20, root: Optional[Path] = None
) -> ByteCorpus:
  """Concatenate stdlib sources (at most ``max_mb`` MB) and split them.

  Args:
    max_mb: cap on the total bytes read (train + valid), in units of 1e6.
    valid_every: every ``valid_every``-th file (0, k, 2k, ...) is validation.
    root: the directory to read (default: the running Python's stdlib).
  """
  root = stdlib_dir() if root is None else Path(root)
  budget = int(max_mb * 1e6)
  train, valid, total, used = [], [], 0, 0
  for i, path in enumerate(stdlib_files(root)):
    if total >= budget:
      break
    try:
      data = path.read_bytes()
    except OSError:
      continue
    data = data[: budget - total]
    (valid if i % valid_every == 0 else train).append(data)
    total += len(data)
    used += 1
  if not train or not valid:
    raise RuntimeError(f"no Python sources found under {root}")
  as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8).copy()
  return ByteCorpus(
    train=as_array(train), valid=as_array(valid), num_files=used, root=str(root)
  )


def batch_iterator(
  data: np.ndarray, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[np.ndarray]:
  """Endless ``[batch_size, seq_len + 1]`` int32 windows at random offsets.

  Windows start at uniform random positions drawn from
  ``np.random.default_rng(seed)``, so the stream is reproducible; column
  ``t + 1`` is the next-token target of column ``t``.
  """
  data = np.asarray(data, dtype=np.uint8)
  if data.size < seq_len + 2:
    raise ValueError(f"{data.size=} bytes is too short for {seq_len=}")
  rng = np.random.default_rng(seed)
  offsets = np.arange(seq_len + 1)
  while True:
    starts = rng.integers(0, data.size - seq_len - 1, size=batch_size)
    yield data[starts[:, None] + offsets[None, :]].astype(np.int32)


def decode(tokens) -> str:
  """Bytes back to text (invalid UTF-8 replaced)."""
  return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode(
    "utf-8", errors="replace"
  )
