"""Preference tuning with DPO: rank-16 LoRA adapters trained so that the model prefers the
chosen completion of each pair over the rejected one, against its own frozen base as the
reference (toolkit/training/objectives/dpo.py, toolkit/data/preference.py; docs/post_training.md).

  python -m toolkit.train --config=experiments/lm.py:cpu --workdir=runs/lm_cpu
  python -m toolkit.convert export --workdir=runs/lm_cpu --out=runs/lm_cpu_hf
  python -m toolkit.train --config=experiments/dpo.py:cpu,base=runs/lm_cpu_hf \\
      --workdir=runs/dpo_repeat

The documented result (tests/test_documented_results.py): the held-out pairs whose chosen
completion the model finds likelier go from <= 65 % before to >= 90 % after, with a preference
accuracy >= 90 %, on each of seeds 0, 1, 2 (measured: 50.8 % before; 99.2-100 % after,
with a preference accuracy of 99.2-100 %, on each of seeds 0-5; ~45 s a run on 2 cores).

The pairs are synthetic:repeat's ("repeat kqzvd" -> chosen "kqzvd", rejected another
instruction's word) through experiments/sft.py's byte template; the eval line gives the
held-out pairs' preference accuracy (the implicit rewards, 0 before training when every reward
is 0), the share whose chosen completion the model itself finds likelier, and the reward
margin.

Variants after the colon, comma separated:
  cpu          (default) the CPU LM (byte-level), 16 pairs a step, 400 steps, one device
  tiny         the unit-test size: 2 layers, d_model 32, 64 pairs, 4 steps
  base=DIR     start from the Hugging Face folder DIR (train.init_from=hf:DIR)
  task=NAME    the synthetic task: repeat (default), upper, reverse or add; or your files:
               --config.data.path=train.jsonl --config.data.eval_path=held_out.jsonl
Single fields: --config.dpo.beta=0.5, --config.dpo.loss=ipo, --config.dpo.loss=robust
--config.dpo.label_smoothing=0.1, ...; every weight instead of adapters: --config.model.lora_rank=0
(the reference then is the starting weights' log-probabilities, precomputed before step 1,
or --config.dpo.reference=frozen for a copy of the weights in the train state; a smaller
learning rate, e.g. --config.optimizer.learning_rate=3e-4)
"""
from experiments import lm, sft
from toolkit.training.config import defaults

_VARIANTS = ("cpu", "tiny")
_KEYS = ("base", "task")
LORA_RANK = 16
# As for experiments/sft.py's adapters, a short warm-up makes the step where the preference is
# learnt late: with 100 of a 600-step schedule (16 pairs a step, beta 0.1) the demo's model
# went from 51 % of the held-out pairs' chosen completions likelier to 93 % at step 200 and
# 100 % from step 400; with 20 warm-up steps of 200 at 8 pairs a step, 61 % at the end.
WARMUP_STEPS = 100


def get_config(arg: str | None = None):
  variant, keyed = lm.parse_arg(arg, "experiments/dpo.py", _VARIANTS, _KEYS)
  config = defaults()
  lm.set_model(config, "tiny" if variant == "tiny" else "cpu")
  config.model.update(lora_rank=LORA_RANK, lora_alpha=2.0 * LORA_RANK, lora_dropout=0.0)
  config.data.update(source="preference", path="synthetic:repeat", tokenizer="bytes",
                     chat_template=sft.BYTE_TEMPLATE, seq_len=28, global_batch_size=16,
                     eval_batches=8)
  config.mesh.ici = "data:1,fsdp:1,tensor:1"  # on a CPU simulated devices share its cores
  config.sharding.preset = "fsdp"
  config.optimizer.update(learning_rate=3e-3, warmup_steps=WARMUP_STEPS, weight_decay=0.0)
  config.train.update(steps=400, sample_tokens=0, log_every=25, eval_every=100,
                      checkpoint_every=200)
  if variant == "tiny":
    config.data.update(path="synthetic:repeat:64", eval_batches=2)
    config.train.update(steps=4, log_every=2, eval_every=4, checkpoint_every=2)
  if "task" in keyed:
    sft.set_task(config, keyed["task"])
  if "base" in keyed:
    sft.set_base(config, keyed["base"])
  return config
