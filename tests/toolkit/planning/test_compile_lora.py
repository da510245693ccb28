"""`toolkit.compile` and the analytic estimate with LoRA adapters: the frozen base has no
gradient and no optimizer state, the adapters' AdamW moments are all the optimizer holds, and
a Llama-3.1-8B fine-tune on v5e-8 (docs/compile.md's table) fits with LoRA (rank 16, base in
bfloat16) where full fine-tuning with AdamW does not: by the estimate, and by the compiler
(the full one refused in seconds; the LoRA one, a compile of minutes, in the slow half)."""
import dataclasses

import jax
import pytest

from experiments import lm
from tests import tiers
from tests.toolkit.planning.test_compile import _sharded_bytes, needs_libtpu
from toolkit import training
from toolkit.planning import aot, estimate, target as target_lib
from toolkit.training import state as state_lib

GIB = 2**30
V5E_HBM = 16 * GIB


def _lora(config, rank: int):
  config.model.update(lora_rank=rank, param_dtype="bfloat16")
  return config


@pytest.mark.tpu_aot
def test_lora_step_compiles_with_optimizer_state_for_the_adapters_only():
  needs_libtpu()
  config = _lora(lm.get_config("cpu"), 8)
  tpu = target_lib.target_for("v5e-8")
  report = aot.compile_report(config, tpu)
  assert report.verdict == "fits"
  state = training.build(config, devices=list(tpu.devices)).layout.abstract
  trainable = state_lib.split_trainable(state["params"])[0]
  adapters = _sharded_bytes(trainable)
  # Exactly AdamW's two moments of each adapter (and a few scalar counts), nothing for the
  # base; the report's figure is the state's own, the estimate's the same to 2 %.
  assert report.lint["opt_state_bytes_per_device"] == _sharded_bytes(state["opt_state"])
  assert 2 * adapters <= _sharded_bytes(state["opt_state"]) <= 2 * adapters + 64
  assert report.analytic["optimizer"] == pytest.approx(2 * adapters, rel=0.02)
  assert report.analytic["gradients"] == pytest.approx(adapters, rel=0.02)
  assert report.analytic["params"] == pytest.approx(_sharded_bytes(state["params"]), rel=0.02)
  # The compiled step's inputs: the state (base in bfloat16) and the batch, padded to tiles.
  assert report.memory["arguments"] >= _sharded_bytes(state)
  assert ("lora       rank 8 on q,k,v,o,gate,up,down: 77.8 K trainable parameters; the base "
          "frozen in bfloat16") in report.format()  # 4 layers x 19,456


def _config_8b(lora_rank: int):
  """docs/compile.md's 8b fine-tune: Llama 3.1 8B's shapes, batch 8 x 4096 over fsdp=8."""
  config = lm.get_config("size=8b")
  config.data.global_batch_size = 8
  return _lora(config, lora_rank) if lora_rank else config


@pytest.mark.tpu_aot
def test_the_compiler_refuses_the_8b_full_adamw_fine_tune_on_v5e_8():
  """The full row of docs/compile.md's LoRA table from the compiler itself (it refuses in
  seconds)."""
  needs_libtpu()
  report = aot.compile_report(_config_8b(0), target_lib.target_for("v5e-8"))
  assert report.verdict == "does not fit" and report.memory is None
  assert report.out_of_memory["required_bytes"] > report.out_of_memory["available_bytes"]
  # AdamW's two float32 moments of every weight, split 8 ways (and a few scalar counts).
  params = report.lint["param_bytes_per_device"]
  assert 2 * params <= report.lint["opt_state_bytes_per_device"] <= 2 * params + 64


@pytest.mark.slow  # ~35 s on 2 quiet cores (~5 min on busy ones): the 8b LoRA step's compile
@pytest.mark.tpu_aot
@tiers.full(tiers.COMPILE, by="tests/toolkit/planning/test_compile_lora.py::"
                              "test_lora_step_compiles_with_optimizer_state_for_the_adapters_only")
def test_the_8b_lora_fine_tune_compiles_and_fits_on_v5e_8():
  """The LoRA row of docs/compile.md's table: rank 16 on every projection, the base in
  bfloat16, fits a 16 GiB chip by the compiler's own figure, with AdamW moments of the
  adapters only (measured 6.59 GiB per chip, optimizer state 222.00 MiB)."""
  needs_libtpu()
  report = aot.compile_report(_config_8b(16), target_lib.target_for("v5e-8"))
  assert report.verdict == "fits", report.format()
  assert report.memory["total"] < 0.5 * V5E_HBM  # measured 6.59 GiB: far from the edge
  # Two float32 moments of the 41.9 M adapters (B whole on every chip) and scalar counts.
  assert report.lint["opt_state_bytes_per_device"] == pytest.approx(222 * 2**20, rel=0.01)


def _estimate(lora_rank: int) -> tuple[estimate.Memory, estimate.Shape]:
  """The analytic memory of a Llama-3.1-8B fine-tune, batch 8 x 4096 over fsdp=8, on TPU."""
  config = _config_8b(lora_rank)
  setup = training.build(config, devices=jax.devices()[:8])
  shape = dataclasses.replace(estimate.shape_for(setup.spec, config, setup.layout.report),
                              platform="tpu")
  return estimate.memory(shape), shape


def test_the_estimate_fits_an_8b_lora_fine_tune_on_v5e_8_but_not_full_adamw():
  (lora, lora_shape), (full, _) = _estimate(16), _estimate(0)
  print(f"\n8b on v5e-8, analytic per chip: LoRA {lora.total / GIB:.2f} GiB (optimizer "
        f"{lora.optimizer / GIB:.3f}), full AdamW {full.total / GIB:.2f} GiB (optimizer "
        f"{full.optimizer / GIB:.2f})")
  assert lora.total < V5E_HBM < full.total
  # Rank 16 on every projection: 42 M float32 adapters, their gradient and two moments (the
  # B matrices whole on every chip: their output axes are not split by fsdp), nothing more.
  assert lora_shape.trainable_count == 41_943_040
  assert lora.optimizer == 2 * lora.gradients == 2 * lora_shape.trainable_bytes
  assert lora.optimizer < 0.05 * full.optimizer
  assert full.optimizer == pytest.approx(2 * full.params)
