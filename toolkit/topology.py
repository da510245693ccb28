"""`python -m toolkit.topology [TYPE ...]`: the accelerator tables (chips, hosts, topology,
memory, peak FLOP/s, bandwidths): Cloud TPU types (v5p-128, v5e-16, ...) and GPU clusters
(h100x64: 8 nodes of 8 H100s), all of them or the named ones (toolkit/accelerators.py holds
the tables)."""
from __future__ import annotations

import sys

from toolkit import accelerators


def cli(argv: list[str] | None = None) -> int:
  """Prints the table; exit status 2 with one `error:` line for an unknown type."""
  argv = sys.argv if argv is None else argv
  names = argv[1:]
  try:
    gpus = [accelerators.gpu_cluster(n) for n in names if accelerators.is_gpu_name(n)]
    tpus = [accelerators.accelerator(n) for n in names if not accelerators.is_gpu_name(n)]
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  tables = []
  if tpus or not names:
    tables.append(accelerators.format_table(tpus))
  if gpus or not names:
    tables.append(accelerators.format_gpu_table(gpus))
  print("\n\n".join(tables))
  return 0


if __name__ == "__main__":
  sys.exit(cli())
