"""Supervised fine-tuning on conversations: the loss on the assistant's tokens only, through the
model's chat template (toolkit/data/chat.py; docs/post_training.md).

The documented result: the CPU demo's model (`make demo`: the CPU LM after 300 steps on
CPython's docs), fine-tuned for 400 steps on one simulated device, learns to repeat words it
never saw when asked to:

  python -m toolkit.train --config=experiments/lm.py:cpu --workdir=runs/lm_cpu
  python -m toolkit.convert export --workdir=runs/lm_cpu --out=runs/lm_cpu_hf
  python scripts/dev/chat_exact_match.py --config=experiments/sft.py:cpu,base=runs/lm_cpu_hf
  python -m toolkit.train --config=experiments/sft.py:cpu,base=runs/lm_cpu_hf \\
      --workdir=runs/sft_repeat
  python scripts/dev/chat_exact_match.py --config=experiments/sft.py:cpu,base=runs/lm_cpu_hf \\
      --checkpoint=runs/sft_repeat

Expected result: held-out exact match from <= 5 % before to >= 90 % after fine-tuning on each
of seeds 0, 1, 2 (measured: 0 % before; 99.6, 100 and 98.0 % as the trials of one population
on one CPU device, as the commands run, tests/test_documented_results.py; 100 % on each in a
process of 8 simulated devices, and on seeds 3, 4, 5). With `,lora=16` added to both configs
(1,000 steps, docs/post_training.md): with rank-16 LoRA adapters on the frozen base, from
<= 5 % before to >= 90 % after on each of seeds 0, 1, 2 (measured: 0 % before; 100 % on each
as one population, on one device and in a process of 8, and on seeds 3, 4, 5).

Variants after the colon, comma separated:
  cpu          (default) the CPU LM (0.9 M parameters, byte-level) fine-tuned on
               synthetic:repeat (toolkit/data/instruct.py) through BYTE_TEMPLATE: rows of 28
               tokens, one conversation each, 16 a step, 400 steps at a peak learning rate of
               3e-3 after WARMUP_STEPS, one device (from scratch without base=)
  tiny         the unit-test size: 2 layers, d_model 32, 256 conversations, 4 steps
  1b           Llama 3.2 1B's shapes (models/llama_config.py "1b", bfloat16 compute), sequences
               of 4096 tokens packed, fsdp over every chip: with base=DIR (the Hugging Face
               folder of meta-llama/Llama-3.2-1B-Instruct) its weights, tokenizer and chat
               template; without, the synthetic task through BYTE_TEMPLATE (for toolkit.compile)
  base=DIR     start from the Hugging Face folder DIR: its config.json's model, its weights
               (train.init_from=hf:DIR), its tokenizer when it has a tokenizer.json
  task=NAME    the synthetic task: repeat (default), upper, reverse or add; or your files:
               --config.data.path=train.jsonl --config.data.eval_path=held_out.jsonl
  packing=on|off  several conversations per row (data.packing), or one
  lora=RANK    LoRA adapters of rank RANK (alpha 2 x RANK) on every projection, the base
               frozen (models/lora.py): only the adapters train, at LORA_LEARNING_RATE
               (cpu: for LORA_STEPS steps after LORA_WARMUP_STEPS)
Single fields: --config.data.train_on=all, --config.data.overlong=drop, ...
"""
from experiments import lm
from toolkit.training import init_from
from toolkit.training.config import defaults

# A chat template for byte-level models (no tokenizer folder): each turn on its own line, the
# role's initial, a colon and the content, the assistant's turn ended by its newline (byte 10,
# the stop token): "U: repeat kqzvd\nA: kqzvd\n" is 25 bytes, where "role: content" lines took
# 36, and on a byte-level model every byte is a position to compute.
BYTE_TEMPLATE = ("{% for message in messages %}"
                 "{{ message['role'][0] | upper + ': ' + message['content'] + '\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")
# The task is learnt suddenly, at a step that moves with the seed; a short warm-up makes that
# step late and erratic. Fully fine-tuned, 16 conversations a step, the demo's model had on
# each of seeds 0-5 >= 99 % exact match at step 300 and 100 % at 400 after 100 warm-up steps;
# after 10 (as pre-training warms up), seed 0 had 27 % at step 400 and seed 1 100 % at 200.
# Rank-16 adapters learn it later: after 200 warm-up steps of a 1,000-step schedule, 100 % at
# step 400 on five of seeds 0-5 and at 800 on the sixth (30 % at 600); after 100 of 800, two
# of the six had 96 % and 75 % at the end. A larger step does not hurry them: at 6e-3 (100
# warm-up steps) or 1e-2 they stall on a constant answer.
WARMUP_STEPS, LORA_WARMUP_STEPS, LORA_LEARNING_RATE, LORA_STEPS = 100, 200, 3e-3, 1000

_VARIANTS = ("cpu", "tiny", "1b")
_KEYS = ("base", "task", "packing", "lora")


def _chat(config, seq_len: int, batch: int) -> None:
  config.data.update(source="chat", path="synthetic:repeat", tokenizer="bytes",
                     chat_template=BYTE_TEMPLATE, seq_len=seq_len, global_batch_size=batch,
                     eval_batches=8)
  config.mesh.ici = "data:1,fsdp:-1,tensor:1"
  config.sharding.preset = "fsdp"
  config.train.update(sample_tokens=0, log_every=25, eval_every=100, checkpoint_every=100)


def get_config(arg: str | None = None):
  variant, keyed = lm.parse_arg(arg, "experiments/sft.py", _VARIANTS, _KEYS)
  config = defaults()
  if variant == "1b":
    lm.set_model(config, "1b")
    _chat(config, seq_len=4096, batch=64)
    config.data.packing = True
    config.optimizer.update(learning_rate=2e-5, warmup_steps=50, weight_decay=0.0)
    config.train.update(steps=1000, log_every=10, eval_every=200, checkpoint_every=200)
  else:
    lm.set_model(config, "tiny" if variant == "tiny" else "cpu")
    _chat(config, seq_len=28, batch=16)
    config.mesh.ici = "data:1,fsdp:1,tensor:1"  # on a CPU simulated devices share its cores
    config.optimizer.update(learning_rate=3e-3, warmup_steps=WARMUP_STEPS, weight_decay=0.0)
    config.train.update(steps=400, eval_every=200, checkpoint_every=400)
    if variant == "tiny":
      config.data.update(path="synthetic:repeat:256", eval_batches=2)
      config.train.update(steps=4, log_every=2, eval_every=4, checkpoint_every=2)
  if "task" in keyed:
    set_task(config, keyed["task"])
  if "packing" in keyed:
    if keyed["packing"] not in ("on", "off"):
      raise ValueError(f"experiments/sft.py: packing={keyed['packing']!r}; use on or off")
    config.data.packing = keyed["packing"] == "on"
  if "lora" in keyed:
    if not keyed["lora"].isdigit() or int(keyed["lora"]) < 1:
      raise ValueError(f"experiments/sft.py: lora={keyed['lora']!r}; give the rank, e.g. lora=16")
    rank = int(keyed["lora"])
    config.model.update(lora_rank=rank, lora_alpha=2.0 * rank)
    config.optimizer.learning_rate = LORA_LEARNING_RATE
    if variant == "cpu":
      config.optimizer.warmup_steps = LORA_WARMUP_STEPS
      config.train.update(steps=LORA_STEPS, checkpoint_every=LORA_STEPS)
  if "base" in keyed:
    set_base(config, keyed["base"])
    if variant == "1b":
      config.data.chat_template = ""  # the folder's own
  return config


def set_task(config, name: str) -> None:
  """task=NAME: synthetic:NAME instead of synthetic:repeat (keeping a :COUNT)."""
  config.data.path = "synthetic:" + name + config.data.path.partition("synthetic:repeat")[2]


def set_base(config, folder: str) -> None:
  """base=DIR: the Hugging Face folder's model and weights, and its tokenizer when it has one."""
  init_from.with_hf_model(config, folder, field="base=")
  config.data.tokenizer = ""


_SWEEPS = ("lora", "tiny")


def get_sweep(arg: str | None = None):
  """LoRA trials on the task in ONE program on one frozen base (population mode, docs/
  post_training.md): rank-16 adapters, learning rate x alpha x dropout, 8 trials of the LoRA
  recipe's LORA_STEPS (1,000) with its LORA_WARMUP_STEPS (200): adapters learn the task
  between steps 400 and 800, so a shorter sweep would rank noise.
  `arg`: lora (default) or tiny (the unit-test size: 4 trials of 4 steps), then optionally
  ,base=DIR, the Hugging Face folder every trial starts from."""
  from toolkit.tuning import search  # pylint: disable=g-import-not-at-top
  items = [item for item in (arg or "lora").split(",") if item]
  keyed = dict(item.partition("=")[::2] for item in items if "=" in item)
  variant = next((item for item in items if "=" not in item), "lora")
  if variant not in _SWEEPS or set(keyed) - {"base"}:
    raise ValueError(f"experiments/sft.py: unknown sweep {arg!r}; choose from "
                     f"{', '.join(_SWEEPS)}, optionally with ,base=DIR")
  base = ("cpu" if variant == "lora" else "tiny") + ",lora=16" + (
      f",base={keyed['base']}" if "base" in keyed else "")
  # One trial per device: a population of 8 splits its trial axis 8 ways.
  fixed = {"train.sample_tokens": 0, "mesh.ici": "data:1,fsdp:-1,tensor:1"}
  if variant == "tiny":
    return search.Sweep(base=base, method="grid", fixed=fixed, parameters={
        "optimizer.learning_rate": [3e-3, 1e-2], "model.lora_dropout": [0.0, 0.1]})
  fixed.update({"train.steps": LORA_STEPS, "train.eval_every": 200,
                "train.checkpoint_every": 200, "optimizer.warmup_steps": LORA_WARMUP_STEPS})
  # Around the recipe's rate: from 6e-3 up the adapters stall on a constant answer.
  return search.Sweep(base=base, method="grid", fixed=fixed, parameters={
      "optimizer.learning_rate": [1e-3, LORA_LEARNING_RATE], "model.lora_alpha": [16.0, 32.0],
      "model.lora_dropout": [0.0, 0.1]})
