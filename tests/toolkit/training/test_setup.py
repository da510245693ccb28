"""The MFU line's peak (`toolkit.training.setup.peak_flops_total`)."""
import jax

import sharding
from toolkit.training import config as config_lib, setup as setup_lib


def test_cpu_peak_is_the_hosts_however_many_devices_the_mesh_holds(monkeypatch):
  """Simulated CPU devices share the host's cores: a 1-device run and an 8-device run have the
  same peak (a per-device constant for 8 devices showed MFU 325 % on 1 device)."""
  measured = []
  monkeypatch.setattr(setup_lib, "matmul_flops_per_second",
                      lambda size, repeats, device: measured.append(device) or 270e9)
  config = config_lib.defaults()
  one = sharding.make_mesh([("data", 1)], [], jax.devices()[:1])
  eight = sharding.make_mesh([("fsdp", 8)])
  assert setup_lib.peak_flops_total(config, one) == setup_lib.peak_flops_total(config, eight)
  assert setup_lib.peak_flops_total(config, eight) == 270e9 and len(measured) == 3
  # A configured per-device peak scales with the devices.
  config.train.peak_flops_per_device = 5e9
  assert setup_lib.peak_flops_total(config, eight) == 8 * 5e9
  assert setup_lib.peak_flops_total(config, one) == 5e9


def test_matmul_peak_is_measured():
  assert setup_lib.matmul_flops_per_second(256, 2) > 1e8


def test_matmul_peak_on_every_device_at_once_is_per_device():
  devices = jax.devices()
  assert len(devices) == 8  # tests/conftest.py
  every = setup_lib.matmul_flops_per_second(256, 3, devices=devices)
  # Eight simulated devices share the host's cores: each gets at most what one alone gets,
  # with room for timing noise.
  assert 1e7 < every < 2 * setup_lib.matmul_flops_per_second(256, 3)
