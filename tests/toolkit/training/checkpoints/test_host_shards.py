"""The local tier's copies of a multi-process run (toolkit/training/checkpoints/host_shards.py), in one
process: its files hold every shard of every layout (sharded, partly and fully replicated,
bfloat16, scalars) and restore bitwise from the own copy or, without it, from the peer copy;
a damaged copy is told apart by its checksum; steps another process count wrote, or whose
shards no host holds, are set aside with one warning. A 2-process pod that loses a host is in
tests/toolkit/pod/test_multiprocess.py."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from toolkit.training.checkpoints import host_shards
from toolkit.training.checkpoints.checkpoint import DamagedCheckpoint

CONFIG = {"model": {"d_model": 8}, "train": {"steps": 10}}


def _state():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))

  def put(x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))
  values = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7
  return {"step": put(jnp.int32(7)),
          "params": {"w": put(values, "fsdp", "data"),             # sharded both ways
                     "b": put(values[0].astype(jnp.bfloat16), "fsdp"),  # replicated over data
                     "scale": put(values[1])},                      # fully replicated
          "rng": put(jnp.array([3, 4], jnp.uint32))}


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.sharding == y.sharding and x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                  np.asarray(y.astype(jnp.float32)))


@pytest.fixture
def saved(tmp_path):
  tier, state = host_shards.HostShards(str(tmp_path), keep=2).open(), _state()
  for step in (1, 2, 3):
    tier.save(step, state, CONFIG, {"step": step, "seed": 0})
  tier.wait()
  return tier, state


def test_the_last_steps_restore_bitwise_from_the_own_copy(saved):
  tier, state = saved
  assert sorted(os.listdir(tier.directory)) == ["2", "3"] and tier.all_steps() == [2, 3]
  assert tier.saved_config(3) == CONFIG
  assert tier.state_parts(3) == {"step", "params", "rng"}
  restored, position = tier.restore(3, _abstract(state))
  _assert_equal(restored, state)
  assert position == {"step": 3, "seed": 0} and tier.note == ""
  assert [t.step for t in tier.timings] == [1, 2, 3]
  assert all(t.seconds is not None and t.seconds >= t.blocking_seconds for t in tier.timings)


def test_without_its_own_copy_a_process_restores_from_the_peer_copy(saved):
  tier, state = saved
  for name in ("own.json", "own.bin"):
    os.remove(os.path.join(tier.directory, "3", name))
  restored, position = tier.restore(3, _abstract(state))
  _assert_equal(restored, state)
  assert position == {"step": 3, "seed": 0}
  assert tier.note == " (process 0's shards from the copy on process 0's host)"


def test_a_damaged_copy_fails_its_checksum_and_the_other_copy_serves(saved):
  tier, state = saved
  own = os.path.join(tier.directory, "3", "own.bin")
  with open(own, "r+b") as f:
    f.seek(40)
    byte = f.read(1)
    f.seek(40)
    f.write(bytes([byte[0] ^ 1]))
  restored, _ = tier.restore(3, _abstract(state))
  _assert_equal(restored, state)
  assert "process 0's shards from the copy" in tier.note
  os.remove(os.path.join(tier.directory, "3", "peer.json"))
  with pytest.raises(DamagedCheckpoint, match=(
      r"step 3 cannot be restored: the shards of process 0: its own copy on process 0's host "
      r"is damaged \(own.bin does not match its checksum\), the copy is not on process 0's "
      r"host")):
    tier.restore(3, _abstract(state))


def test_another_layout_is_damage_named_with_the_array(saved):
  tier, state = saved
  other = dict(_abstract(state))
  w = state["params"]["w"]
  other["params"] = {**other["params"], "w": jax.ShapeDtypeStruct(
      w.shape, w.dtype, sharding=NamedSharding(w.sharding.mesh, P("data", "fsdp")))}
  with pytest.raises(DamagedCheckpoint, match=r"written for another layout \(params/w differs"):
    tier.restore(3, other)


def test_steps_no_restart_can_use_are_set_aside_with_a_warning(saved):
  tier, _ = saved
  meta_path = os.path.join(tier.directory, "3", "own.json")
  with open(meta_path, encoding="utf-8") as f:
    meta = json.load(f)
  for name in ("own", "peer"):
    with open(os.path.join(tier.directory, "3", f"{name}.json"), "w", encoding="utf-8") as f:
      json.dump({**meta, "processes": 4}, f)
  for name in ("own.json", "peer.json"):
    os.remove(os.path.join(tier.directory, "2", name))
  reopened = host_shards.HostShards(os.path.dirname(tier.folder), keep=2).open()
  damaged = os.path.join(tier.folder, "damaged_checkpoints")
  assert reopened.warnings == [
      f"warning: local checkpoint step 2 cannot be used (the shards of process 0 are on no "
      f"host (neither its own folder nor process 0's holds them)); moved it to {damaged}",
      f"warning: local checkpoint step 3 cannot be used (written by 4 processes, this run has "
      f"1); moved it to {damaged}"]
  assert reopened.all_steps() == [] and sorted(os.listdir(damaged)) == ["2", "3"]


def test_the_processes_meet_before_each_collective_that_moves_copies(saved, monkeypatch):
  """The copies move over the devices in a new (rotated) order, a new group for Gloo, which
  gives a group 30 s to assemble: every process first passes a barrier over the step's group
  (host_shards._meet), on saving and on restoring from a peer's copy."""
  tier, state = saved
  calls = []

  def recorded(name, real):
    def call(*args):
      calls.append(args[0] if name == "_meet" else name)  # a barrier by its name
      return real(*args)
    return call
  for name in ("_meet", "_rotated", "_assemble"):
    monkeypatch.setattr(host_shards, name, recorded(name, getattr(host_shards, name)))
  arrays = len(jax.tree.leaves(state))
  tier.save(4, state, CONFIG, {"step": 4, "seed": 0})
  tier.wait()
  assert calls == ["local checkpoint step 4"] + ["_rotated"] * arrays, calls
  calls.clear()
  tier.restore(4, _abstract(state))  # from the own copies: nothing moves between processes
  assert calls == ["_assemble"] * arrays, calls
  for name in ("own.json", "own.bin"):
    os.remove(os.path.join(tier.directory, "4", name))
  calls.clear()
  tier.restore(4, _abstract(state))
  moved = [c for c in calls if c != "_rotated"]  # (the peer copy's layout is checked first)
  assert moved == ["local checkpoint step 4 from the peers' copies"] + ["_assemble"] * arrays, calls
