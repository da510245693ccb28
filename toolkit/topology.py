"""`python -m toolkit.topology [TYPE ...]`: the Cloud TPU accelerator table (chips, hosts,
topology, memory, peak FLOP/s, bandwidths), all of it or the named types
(toolkit/accelerators.py holds the table)."""
from __future__ import annotations

import sys

from toolkit import accelerators


def cli(argv: list[str] | None = None) -> int:
  """Prints the table; exit status 2 with one `error:` line for an unknown type."""
  argv = sys.argv if argv is None else argv
  try:
    types = [accelerators.accelerator(name) for name in argv[1:]]
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(accelerators.format_table(types))
  return 0


if __name__ == "__main__":
  sys.exit(cli())
