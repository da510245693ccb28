"""What a run's --workdir may be. No JAX import: the launchers in scripts/ use this too.

Checkpoints, metrics, TensorBoard files and plots are written through local paths, so a
multi-host run needs one folder that every host sees at the same path: a shared filesystem
(Filestore, NFS, Lustre) or a bucket mounted on every host with gcsfuse. Object-store URLs
(gs://, s3://) are refused rather than silently written to a local folder named "gs:".
"""
from __future__ import annotations

SHARED = ("one folder every host sees at the same path: a shared filesystem (Filestore, NFS) "
          "or a bucket mounted on every host with gcsfuse, e.g. /mnt/gcs/runs/lm")


def problem(workdir: str) -> str | None:
  """Why `workdir` cannot be used, naming the fix; None when it can."""
  if not workdir:
    return "--workdir is empty; give a directory for checkpoints and metrics"
  if "://" in workdir:
    scheme = workdir.split("://", 1)[0]
    return (f"--workdir={workdir}: {scheme}:// URLs are not supported (files are written "
            f"through local paths); use {SHARED}")
  return None


def argument(text: str) -> str:
  """An argparse `type=` for --workdir in the launchers."""
  import argparse  # pylint: disable=g-import-not-at-top
  if (why := problem(text)) is not None:
    raise argparse.ArgumentTypeError(why.split(": ", 1)[-1] if text else why)
  return text
