"""The suite's XLA:CPU code generation (tests/codegen.py): set for this process and its children,
only where the installed jaxlib knows the flags, and dropped for the runs documented as a user's."""
import os

import jax
import numpy as np

from tests import codegen, tiny_runs


def test_the_fusion_emitters_flag_only_where_jaxlib_has_it():
  # Read from the releases' libjax_common.so: 0.10.2 and 0.11.0 name the flag, 0.11.1, 0.11.2,
  # 0.12.0.1 and 0.12.1 do not (and XLA ends a process whose XLA_FLAGS has an unknown name).
  for version in ("0.10.2", "0.11.0"):
    assert codegen.flags(version) == (codegen.OPTIMIZATION_LEVEL, codegen.FUSION_EMITTERS)
  for version in ("0.11.1", "0.11.2", "0.12.0.1", "0.12.1", "1.0.0"):
    assert codegen.flags(version) == (codegen.OPTIMIZATION_LEVEL,)


def test_this_process_and_its_children_compile_with_them():
  flags = os.environ["XLA_FLAGS"].split()
  assert set(codegen.flags()) <= set(flags)
  assert len(flags) == len(set(flags)), "a worker adds none twice"
  assert jax.jit(lambda x: x * 2.0 + 1.0)(np.float32(3.0)) == 7.0  # the backend took them


def test_a_users_run_has_xlas_defaults():
  env = tiny_runs.default_codegen_env(devices=1)["XLA_FLAGS"].split()
  assert not set(codegen.flags()) & set(env)
  assert "--xla_force_host_platform_device_count=1" in env
  assert codegen.without("--a=1 --xla_backend_optimization_level=3 "
                         "--xla_cpu_use_fusion_emitters=true --b") == ["--a=1", "--b"]
