"""Mixtral-style mixture-of-experts LM on byte-level text (CPython's docs, no download), with
its experts split over the `expert` mesh axis.

Launch (8 simulated devices as fsdp 2 x expert 4: each device holds 2 of the 8 experts):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m toolkit.train --config=experiments/moe.py:cpu --workdir=runs/moe_cpu

It takes 2.7-13 min on a 2-core machine (measured: 2.7 min quiet, 13 min with its cores busy)
and leaves a checkpoint at step 300, the router metrics of every step in metrics.jsonl
(load_balance_loss, expert_load_min, expert_load_max, dropped_fraction), loss.png and a sample.

Expected result, as a test checks it (tests/test_documented_results.py), on the `tiny` variant
trained for 100 steps (--config.train.steps=100): the held-out loss falls by more than 1.5
nats per token, and at the last step the least-loaded expert has at least 0.5 of the mean
load, load_balance_loss lies between 0.9 and 1.5 and nothing is dropped. The `cpu` run's own
loss and router figures are not checked by a test (its 300 steps take minutes), so none is
promised here; its experts' loads at the end move from one seed or machine to another.

Variants after the colon, comma separated:
  cpu            (default) `moe_cpu`: 8 experts of width 192, 2 per token, in each of 4
                 layers (as many weights per token as lm.py:cpu's dense model), capacity
                 dispatch (the faster one on CPU), mesh data:1,fsdp:-1,expert:4, rules
                 fsdp_ep, learning rate 1e-3, 300 steps
  tiny           the unit-test size (`moe_tiny`, dropless), 10 steps
  size=NAME      model preset: moe_tiny, moe_cpu, 8x7b (Mixtral 8x7B; a pod-scale batch of
                 256 x 4096 tokens and mesh fsdp:-1,expert:8, for toolkit.compile)
  dispatch=NAME  dropless (sort + ragged_dot, the default) or capacity (one-hot einsums,
                 --config.model.capacity_factor=1.25)
  exchange=NAME  how dropless crosses the expert axis: ring (default, runs anywhere) or
                 ragged_all_to_all (TPU/GPU only)
  every=N        a mixture of experts in every N-th layer, dense MLPs in the others
  rules=NAME     sharding preset: fsdp_ep (default) or fsdp_tp_ep (add tensor:2 to mesh.ici)

Will Mixtral 8x7B fit on a v5p-128? (libtpu; see docs/moe.md for the report):

  python -m toolkit.compile --config=experiments/moe.py:size=8x7b,exchange=ragged_all_to_all \\
      --topology=v5p-128
"""
from experiments import lm

_VARIANTS = ("cpu", "tiny")
_KEYS = ("size", "dispatch", "exchange", "every", "rules")
_MOE_SIZES = ("moe_tiny", "moe_cpu", "8x7b")
_MODEL_FIELDS = {"dispatch": "moe_dispatch", "exchange": "expert_exchange"}


def get_config(arg: str | None = None):
  variant, keyed = lm.parse_arg(arg, "experiments/moe.py", _VARIANTS, _KEYS)
  tiny = variant == "tiny"
  size = keyed.pop("size", "moe_tiny" if tiny else "moe_cpu")
  if size not in _MOE_SIZES:
    raise ValueError(f"experiments/moe.py: size={size!r} is unknown; choose from "
                     f"{', '.join(_MOE_SIZES)} (dense sizes: experiments/lm.py)")
  config = lm.get_config("tiny" if tiny else "cpu")   # the shared LM experiment
  lm.set_model(config, size)
  if size == "moe_cpu":
    # XLA:CPU runs ragged_dot as a dense matmul per expert group (E times the work), so on
    # CPU capacity dispatch trains 3x faster than dropless at this size (scripts/bench/bench_moe.py).
    config.model.moe_dispatch = "capacity"
  config.mesh.ici = "data:1,fsdp:-1,expert:8" if size == "8x7b" else "data:1,fsdp:-1,expert:4"
  config.sharding.preset = "fsdp_ep"
  # At the dense LM's 3e-3 these small byte-level routers collapse onto a few experts (the
  # residual stream's shared direction outweighs the tokens' differences) and stay there;
  # at 1e-3 they recover by the end of the schedule (measured: docs/moe.md).
  config.optimizer.learning_rate = 1e-3
  for key, value in keyed.items():
    if key == "rules":
      config.sharding.preset = value
    elif key == "every":
      if not value.isdigit():
        raise ValueError(f"experiments/moe.py: every={value!r} is not a layer count; give "
                         f"e.g. every=2")
      config.model.moe_every = int(value)
    else:
      config.model[_MODEL_FIELDS[key]] = value
  return config
