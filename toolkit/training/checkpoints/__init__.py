"""Checkpoints of a training run:

- `checkpoint`: Orbax's CheckpointManager for the state (async), with the config, the data
  position and the state's fingerprints saved beside it; restores onto any mesh;
- `integrity`: the fingerprints, computed on the devices and checked after a restore;
- `resume`: where a run starts (its newest checkpoint that restores, `resume_from`,
  `init_from`, a fresh state) and falling back past a damaged step;
- `storage`: the storage a run writes to, checked before training, its write failures as one
  `StorageError`;
- `tiers`: the persistent tier and the local tier of frequent saves on the host's own storage;
- `host_shards`: the local tier of a run of several processes, with a peer's copy of each host's
  shards.
"""
