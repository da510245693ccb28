"""Checkpoint tiers: the loop's saves into the workdir's checkpoints (the persistent tier) and
into the local tier: frequent checkpoints on this host's own storage (a RAM disk such as
/dev/shm, a local SSD) beside the persistent ones (a shared disk or gs://).

  --config.train.local_checkpoint_dir=/dev/shm/my_run --config.train.local_checkpoint_every=10

Every `local_checkpoint_every` steps that are not a persistent checkpoint step, the state goes
to `local_checkpoint_dir/checkpoints` the same way as to the workdir (`checkpoint.Checkpoints`:
asynchronous, fingerprinted, the data position with it); the last LOCAL_KEEP are kept. A
restart resumes from the newest step of either tier that restores: a local step newer than
the newest persistent one first (a damaged one is set aside like a persistent one), else the
persistent tier. A crash or a hang then costs at most `local_checkpoint_every` steps instead of
`checkpoint_every`, while the workdir is written as rarely as before; a host that is lost takes
its local tier with it, and the restart uses the persistent one.

The folder belongs to one run: its `run.json` names the workdir, and another run's folder is
refused. In a run of several processes each process writes its own shards, and a copy of the
previous process's, into `<folder>/process_<i>` on its host (host_shards.py): a restart that
lost a host, or got a new one with an empty disk, restores from the copies on the others.
"""
from __future__ import annotations

import json
import os

import jax
import ml_collections

from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.training.checkpoints import checkpoint, host_shards

LOCAL_KEEP = 2
_MARKER = "run.json"


def open_tier(config: ml_collections.ConfigDict, workdir: str
              ) -> checkpoint.Checkpoints | host_shards.HostShards | None:
  """The run's local tier, or None when `train.local_checkpoint_dir` is unset: an Orbax folder
  in one process, host_shards.HostShards in several. ConfigError for a folder that is not on
  this host or belongs to another run."""
  folder = config.train.get("local_checkpoint_dir", "")
  if not folder:
    return None
  field = f"train.local_checkpoint_dir={folder!r}"
  if workdir_lib.is_url(folder):
    raise ConfigError(f"{field} is an object store; the local tier is this host's own storage "
                      f"(a RAM disk such as /dev/shm/RUN or a local disk): give a local folder, "
                      f"or '' to turn it off")
  owner = workdir_lib.absolute(workdir)
  if jax.process_count() > 1:  # each process its own folder, its shards and a peer's
    try:
      _claim(os.path.join(folder, f"process_{jax.process_index()}"), owner, field)
      problem = None
    except ConfigError as e:
      problem = str(e)
    # Every process stops with the same error, or none does (the next steps are collectives).
    if (first := next(filter(None, host_shards.allgather_json(problem)), None)) is not None:
      raise ConfigError(first)
    return host_shards.HostShards(folder, LOCAL_KEEP).open()
  _claim(folder, owner, field)
  return checkpoint.Checkpoints(os.path.join(folder, "checkpoints"), keep=LOCAL_KEEP)


def _claim(folder: str, owner: str, field: str) -> None:
  """Marks `folder` as the run's (workdir `owner`); ConfigError if it is another run's."""
  marker = os.path.join(folder, _MARKER)
  try:
    if os.path.exists(marker):
      with open(marker, encoding="utf-8") as f:
        saved = json.load(f).get("workdir")
    else:
      saved = owner
      os.makedirs(folder, exist_ok=True)
      with open(marker, "w", encoding="utf-8") as f:
        json.dump({"workdir": owner}, f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{field} cannot be used ({e}); give a writable local folder") from None
  if saved != owner:
    raise ConfigError(f"{field} holds the local checkpoints of another run (workdir {saved}); "
                      f"give this run its own folder, or remove that one")


def due(config: ml_collections.ConfigDict, step: int) -> bool:
  """Whether the local tier saves after `step` (a persistent save at that step wins)."""
  every = config.train.get("local_checkpoint_every", 0)
  return bool(config.train.get("local_checkpoint_dir", "")) and every > 0 and step % every == 0


def newer_steps(local: checkpoint.Checkpoints | None, own: checkpoint.Checkpoints) -> list[int]:
  """The local tier's steps newer than the persistent tier's newest, oldest first."""
  if local is None:
    return []
  newest = max(own.all_steps(), default=-1)
  return [step for step in local.all_steps() if step > newest]


def save(run_: "Run", at_step: int, state, position: dict,
         tier: checkpoint.Checkpoints | None = None) -> None:
  """Starts an async checkpoint of `state` into `tier` (default: the workdir's) with the data
  position after step at_step - 1's batch (the Grain iterator state, if any); records the
  saves that have finished since."""
  assert position["step"] == at_step, (position, at_step)
  config = run_.config
  with run_.goodput.phase("checkpoint"):
    (tier or run_.checkpoints).save(
        at_step, state, run_.config_dict,
        {**position, "seed": config.seed, "source": config.data.source})
  write_save_timings(run_)


def write_save_timings(run_: "Run") -> None:
  """A "checkpoint" record per finished save ("local_checkpoint" for the local tier's): how
  long the loop was blocked (the copy off the devices) and how long until its files were
  written, in metrics.jsonl."""
  for tier in run_.tiers:
    kind = "local_checkpoint" if tier is run_.local else "checkpoint"
    while tier.timings and tier.timings[0].seconds is not None:
      timing = tier.timings.pop(0)
      run_.writer.write(timing.step, kind, {
          "blocking_seconds": timing.blocking_seconds, "seconds": timing.seconds,
          "blocking_fraction": timing.blocking_seconds / max(timing.seconds, 1e-9)})
