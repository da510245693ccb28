"""The experiment config's defaults and its one validation pass.

`defaults()` is the single shared fragment every experiment starts from; `resolve()` checks
every field once, before anything touches the workdir, and returns typed pieces. Each error
names the field, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import ml_collections
from jax.sharding import Mesh

import sharding
from models import KINDS, LlamaConfig
from models import attention as attention_lib
from models import pipeline as pipeline_lib
from toolkit.data import text
from toolkit import workdir as workdir_lib
from toolkit import xla_flags
from toolkit.errors import ConfigError
from toolkit.training import init_from
from toolkit.training.objectives import checks
from toolkit.training.profiler import parse_profile_steps
from toolkit.training.ranges import RANGES, numeric_fields


def defaults() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # The fields of the model family's config dataclass. An optional `kind` picks the family
  # (models.KINDS) and with it the task: absent or "llama" -> next-token LM, "vit" -> image
  # classification (experiments/vit.py sets it).
  c.model = ml_collections.ConfigDict(dataclasses.asdict(LlamaConfig.preset("cpu")))
  c.mesh = ml_collections.ConfigDict(dict(ici="data:1,fsdp:-1,tensor:1", dcn=""))
  c.sharding = ml_collections.ConfigDict(dict(
      preset="fsdp", param_overrides="", activation_overrides="",
      max_replicated_fraction=0.05, replicated_action="warn"))
  c.data = ml_collections.ConfigDict(dict(
      source="stdlib_docs", seq_len=128, global_batch_size=32, eval_batches=4,
      eval_fraction=0.1,
      # Files for source=tokens (a scripts/data/prepare_text.py folder), npz or image_folder;
      # eval_path: a separate held-out set (else eval_fraction of path is held out).
      path="", eval_path="",
      # Several documents per row, each attending only within itself (toolkit/data/packing.py)
      # for token shards (source=tokens) and chat data; packing_bins: rows packed at once (more
      # fill rows better; 0 is one global batch).
      packing=False, packing_bins=0,
      # Grain worker processes (0: Grain's threads in this process) for token shards and
      # images; batches prepared ahead in a thread for stdlib_docs/synthetic tokens.
      worker_count=0, prefetch=2,
      # Images: training augmentation (pad-and-crop pixels, left-right flips) and the
      # normalization (x - mean) / std of pixels in [0, 1], train and held-out alike.
      crop_padding=0, flip=False, mean=0.0, std=1.0,
      # Chat data (source=chat; path, eval_path: JSONL or Parquet conversations): the
      # tokenizer folder, a template replacing its own, the loss on the assistant's tokens or
      # all, over-long conversations truncated or dropped. toolkit/data/chat.py has the rest.
      tokenizer="", chat_template="", train_on="assistant", overlong="truncate"))
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=3e-3, min_lr_ratio=0.1, warmup_steps=20, b1=0.9, b2=0.95, eps=1e-8,
      weight_decay=0.1, clip_norm=1.0,
      # Length of the warmup + cosine schedule; 0 means train.steps. Set it to stop a run
      # early (train.steps < schedule_steps) and continue it later on the same schedule.
      schedule_steps=0))
  c.train = ml_collections.ConfigDict(dict(
      steps=300, microbatches=1, log_every=25, eval_every=100, checkpoint_every=100,
      keep_checkpoints=3, resume_from="", peak_flops_per_device=0.0, sample_tokens=200,
      sample_prompt="The ", transfer_guard=True,
      # Weights to start from, with a fresh optimizer, when neither the workdir nor
      # resume_from has a checkpoint: "hf:DIR", a Hugging Face model folder (toolkit/hf).
      init_from="",
      # "START:STOP": a jax.profiler trace of steps START..STOP-1 in workdir/profile.
      profile_steps="",
      # Classifiers: train against targets (1 - s) * one_hot + s / classes (0: off).
      label_smoothing=0.0,
      # lm-evaluation-harness tasks (names or local task YAML files, comma separated) run on
      # the parameters in memory every eval_tasks_every steps, eval_tasks_limit examples per
      # task (0: all); toolkit/evaluation/periodic.py. '' is off.
      eval_tasks="", eval_tasks_every=100, eval_tasks_limit=0,
      # Seconds without progress (a step completing, an eval, a save) after the first step
      # before the process dumps its threads' stacks and exits 75 (toolkit/training/
      # watchdog.py); 0 is off.
      hang_timeout_s=600.0,
      # Seconds one write outside Orbax (metrics, TensorBoard, config, plots) or one read of an
      # object store may take before it is a storage error (toolkit/workdir.py `bounded`).
      storage_timeout_s=120.0,
      # With several processes: every this many steps the processes compare their own part of
      # each step (batch, Python) and one 1.15x slower than the median is named
      # (toolkit/training/stragglers.py); 0 is off.
      straggler_every=100,
      # A second, frequent checkpoint tier on this host's own storage (a RAM disk such as
      # /dev/shm/RUN, a local SSD) every local_checkpoint_every steps, the last 2 kept, beside
      # the workdir's checkpoints; a restart resumes from the newer of the two
      # (toolkit/training/checkpoints/tiers.py; on a pod each host keeps its shards and a copy of the
      # previous host's: host_shards.py). '' is off.
      local_checkpoint_dir="", local_checkpoint_every=10))
  # Process set-up before JAX starts (toolkit.runtime.start, toolkit.compile). xla_flags: the
  # compiler flags that overlap collectives with compute on a TPU or GPU (toolkit/xla_flags.py),
  # "auto" (the platform's preset; flags already in LIBTPU_INIT_ARGS / XLA_FLAGS win) or "none".
  c.runtime = ml_collections.ConfigDict(dict(xla_flags="auto"))
  _post_training_defaults(c)
  return c




def _post_training_defaults(c: ml_collections.ConfigDict) -> None:
  """The post-training tasks' sections of `defaults()`: dpo and grpo."""
  # Preference tuning (data.source="preference": toolkit/training/objectives/dpo.py, tasks.py): the
  # reward scale beta, the loss (sigmoid, hinge, ipo, robust) and, for robust, the
  # probability that a pair's labels are flipped. reference: where the reference model's
  # log-probabilities come from: "base" (a LoRA model's base: the adapters off, a forward pass
  # a step), "precomputed" (the starting weights, one pass over the pairs before the first
  # step, toolkit/training/dpo_reference.py: any model, LoRA or not), "frozen" (a copy of the
  # starting weights in the train state, a forward pass a step: as many bytes again as the
  # parameters) or "auto" (base with LoRA adapters, else precomputed).
  c.dpo = ml_collections.ConfigDict(dict(beta=0.1, loss="sigmoid", label_smoothing=0.0,
                                         reference="auto"))
  # Reinforcement learning (data.source="prompts": toolkit/post_training/grpo_task.py, the
  # objective toolkit/training/objectives/grpo.py): completions sampled per prompt and their length and
  # sampling; the KL penalty beta (0 is off) and its reference ("base": a LoRA model's base;
  # "frozen": a copy of the starting weights in the train state, as many bytes again as the
  # parameters; "auto": base with LoRA adapters, else frozen), the clip range, the reduction
  # (grpo, bnpo, dr_grpo, dapo), how advantages are scaled (group, batch, none), and the
  # reward function, "module:function" or "path/file.py:function".
  c.grpo = ml_collections.ConfigDict(dict(
      generations=4, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
      reference="auto", epsilon=0.2, epsilon_high=0.2, loss="dapo", scale_rewards="group",
      reward=""))


def check_ranges(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError for the first numeric field outside its row of RANGES, naming the
  field, the valid range, what the field means and a value that works."""
  for path, value in numeric_fields(config).items():
    allowed = RANGES.get(path)
    if allowed is None or allowed.contains(value):
      continue
    example = _default_value(path, config)
    fix = f"; give e.g. --config.{path}={example}" if allowed.contains(example) else ""
    raise ConfigError(f"{path}={value!r} must be {allowed} ({allowed.meaning}){fix}")


def _default_value(path: str, config: ml_collections.ConfigDict):
  """The value `path` has by default: defaults(), or the model family's dataclass."""
  section, _, name = path.rpartition(".")
  if section == "model":
    cls = KINDS.get(config.model.get("kind", "llama"), KINDS["llama"])[0]
    return getattr(cls(), name, None)
  node = defaults()
  for key in path.split("."):
    node = node.get(key) if isinstance(node, ml_collections.ConfigDict) else None
  return node


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What `resolve` checked: typed pieces the loop uses."""
  model: LlamaConfig
  mesh: Mesh
  rules: sharding.Rules
  batch_ways: int
  task: str = "lm"  # toolkit.tasks.TASKS key, from model.kind


# task -> data.source values it accepts.
_SOURCES = {"lm": ("stdlib_docs", "synthetic", "tokens", "chat", "preference", "prompts"),
            "dpo": ("preference",), "grpo": ("prompts",),
            "classification": ("digits", "npz", "image_folder", "synthetic"),
            "click": ("criteo", "movielens")}
_TASK_OF_KIND = {"llama": "lm", "vit": "classification", "dlrm": "click"}
# An LM's data.source values that make it another task (toolkit/training/objectives/checks.py).
_POST_TRAINING = {"preference": "dpo", "prompts": "grpo"}
# The tasks whose model is the language model: its checkpoints generate, serve and evaluate.
LANGUAGE_MODEL_TASKS = ("lm", *_POST_TRAINING.values())


def rows_per_step(config: ml_collections.ConfigDict, task: str) -> int:
  """The rows one train step trains on: data.global_batch_size, which for GRPO counts prompts,
  each with grpo.generations completions (a row each), and for DPO pairs (two rows each, both
  sides in one forward pass)."""
  rows = config.data.global_batch_size
  return rows * {"grpo": config.grpo.generations, "dpo": 2}.get(task, 1)


def resolve(config: ml_collections.ConfigDict,
            devices: Sequence[jax.Device] | None = None) -> RunSpec:
  """Validates `config` against the devices; raises ConfigError or ShardingError."""
  known = set(defaults().keys())
  for key in config.keys():
    if key not in known:
      raise ConfigError(f"config.{key} is not a known section; known: {', '.join(sorted(known))}; "
                        f"remove it from the experiment's get_config or fix its name")
  check_ranges(config)
  xla_flags.check_setting(xla_flags.setting_of(config))
  model = model_config(config.model)
  mesh = _mesh(config.mesh, devices)
  s = config.sharding
  rules = sharding.Rules.preset(s.preset, s.param_overrides, s.activation_overrides)
  if s.replicated_action not in ("warn", "fail"):
    raise ConfigError(f"sharding.replicated_action={s.replicated_action!r}; use 'warn' or 'fail'")

  d = config.data
  kind = config.model.get("kind", "llama")
  task = _TASK_OF_KIND[kind]
  if task == "lm" and d.source in _POST_TRAINING:
    task = _POST_TRAINING[d.source]
  if d.source not in _SOURCES[task]:
    raise ConfigError(f"data.source={d.source!r} does not fit model.kind={kind!r} "
                      f"({task}); choose one of {', '.join(_SOURCES[task])}")
  _check_path(d)
  if d.source in ("chat", "preference", "prompts"):
    from toolkit.data import chat  # pylint: disable=g-import-not-at-top  # imports Grain
    chat.check_config(d)
  if task == "dpo":
    checks.check_preference(config, model, mesh, defaults().dpo)
  if task == "grpo":
    checks.check_grpo(config, model, mesh, defaults().grpo)
  if d.source == "stdlib_docs" and model.vocab_size < 256:
    raise ConfigError(f"model.vocab_size={model.vocab_size} is below 256, the byte-level "
                      f"vocabulary of data.source='stdlib_docs'; set model.vocab_size>=256")
  _check_packing(d, task)
  batch_axes = _mesh_axes(rules.activation_spec(("batch",), mesh))
  batch_ways = math.prod(mesh.shape[a] for a in batch_axes)
  if getattr(model, "n_experts", 0):
    _check_experts(model, mesh, rules, s.preset)
  _check_context_parallel(model, mesh, rules, d, task)
  _check_attention(model, mesh.devices.flat[0].platform, d)
  _check_pipeline(model, mesh, rules, d, config.train, s.preset)
  t = config.train
  # The step's leading dimension: GRPO's rows are its prompts' completions (DPO's pairs stay
  # whole: their two sides are one row of the batch).
  rows, what = d.global_batch_size, f"data.global_batch_size={d.global_batch_size}"
  if task == "grpo":
    rows *= config.grpo.generations
    what += f" x grpo.generations={config.grpo.generations} = {rows} rows"
  if rows % t.microbatches:
    raise ConfigError(f"{what} is not divisible by train.microbatches={t.microbatches}; pick a "
                      f"micro-batch count that divides the batch")
  micro = rows // t.microbatches
  if micro % batch_ways:
    axes = "x".join(f"{a}={mesh.shape[a]}" for a in batch_axes)
    raise ConfigError(
        f"{what} (micro-batch {micro}) is not divisible by the batch-sharding axes {axes} "
        f"({batch_ways} ways); use a multiple of {batch_ways * t.microbatches}")
  if (problem := text.utf8_problem(t.get("sample_prompt", ""))) is not None:
    raise ConfigError(f"train.sample_prompt is not valid UTF-8 text ({problem}); give the "
                      f"prompt in UTF-8")
  if t.resume_from and (workdir_lib.problem(t.resume_from, "train.resume_from") is not None
                        or not workdir_lib.isdir(t.resume_from)):
    raise ConfigError(f"train.resume_from={t.resume_from!r} is not a directory; give a workdir "
                      f"or its checkpoints/ folder")
  init_from.parse(t.get("init_from", ""))  # absent from configs saved before it existed
  parse_profile_steps(t.get("profile_steps", ""), t.steps)  # a bad window: ConfigError
  _check_label_smoothing(t.get("label_smoothing", 0.0), task, kind)  # absent: saved before it
  return RunSpec(model=model, mesh=mesh, rules=rules, batch_ways=batch_ways, task=task)


# data.source -> what its data.path holds, for the message when it is missing.
_PATHS = {"tokens": "a folder written by scripts/data/prepare_text.py",
          "npz": "the npz", "image_folder": "the image folder",
          "chat": "JSONL or Parquet files of conversations (or synthetic:reverse)",
          "preference": "JSONL or Parquet files of {prompt, chosen, rejected} pairs (or "
                        "synthetic:repeat)",
          "prompts": "JSONL or Parquet files of {prompt, answer} records (or synthetic:add)",
          "criteo": "a Criteo-format file (or synthetic:N)",
          "movielens": "a cache folder for MovieLens-100k (fetched once)"}


def _check_path(data: ml_collections.ConfigDict) -> None:
  """The sources that read files have data.path (configs saved before it existed lack it)."""
  if data.source in _PATHS and not data.get("path", ""):
    raise ConfigError(f"data.source={data.source!r} needs data.path: give "
                      f"--config.data.path={_PATHS[data.source]}")


def _mesh(section: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None) -> Mesh:
  """The config's mesh; on CPU devices a mismatch also names the two ways out."""
  try:
    return sharding.make_mesh(sharding.parse_axis_sizes(section.ici, "mesh.ici"),
                              sharding.parse_axis_sizes(section.dcn, "mesh.dcn"), devices)
  except sharding.ShardingError as e:
    found = list(jax.devices() if devices is None else devices)
    if "devices" not in str(e) or found[0].platform != "cpu":
      raise
    raise sharding.ShardingError(
        f"{e}. On a CPU either simulate devices before JAX starts "
        f"(XLA_FLAGS=--xla_force_host_platform_device_count=8; the toolkit commands do it from "
        f"the mesh, toolkit.runtime.simulate_cpu_devices in Python) or fit the mesh to the "
        f"{len(found)} device(s) there are: --config.mesh.ici=fsdp:-1") from None


# data.source values whose documents data.packing packs.
_PACKABLE = ("tokens", "chat")


def _check_packing(data: ml_collections.ConfigDict, task: str) -> None:
  """data.packing: sources with documents, read in this process."""
  if not data.get("packing", False):  # absent from configs saved before it existed
    return
  if task != "lm" or data.source not in _PACKABLE:
    raise ConfigError(f"data.packing=True packs the documents of data.source="
                      f"{' or '.join(map(repr, _PACKABLE))}; data.source={data.source!r} has "
                      f"none: set data.packing=False")
  if data.worker_count:
    raise ConfigError(f"data.packing=True packs in the training process (Grain's packer is "
                      f"stateful: worker processes would change the rows with their count); "
                      f"set data.worker_count=0 (not {data.worker_count})")


def _check_label_smoothing(smoothing: float, task: str, kind: str) -> None:
  # its range is checked with the others (RANGES)
  if smoothing and task != "classification":
    raise ConfigError(f"train.label_smoothing={smoothing} applies to classifiers "
                      f"(model.kind='vit'); set it to 0 for model.kind={kind!r}")


def model_config(section: ml_collections.ConfigDict):
  """The model config dataclass of a config's `model` section, validated (ConfigError)."""
  values = section.to_dict()
  kind = values.pop("kind", "llama")
  if kind not in KINDS:
    raise ConfigError(f"model.kind={kind!r} is unknown; choose one of {', '.join(KINDS)}")
  cls = KINDS[kind][0]
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"model.{unknown[0]} is not a {cls.__name__} field; known: "
                      f"{', '.join(sorted(fields))}")
  model = cls(**values)
  try:
    model.validate()
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return model


def _mesh_axes(spec) -> list[str]:
  """The mesh axes of a one-dimensional PartitionSpec, in order."""
  return [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]


def _check_context_parallel(model, mesh: Mesh, rules: sharding.Rules,
                            data: ml_collections.ConfigDict, task: str) -> None:
  """Token positions split over devices (context parallelism): a length the load-balanced
  order can cut, and an attention implementation that masks by position."""
  axes = _mesh_axes(rules.activation_spec(("length",), mesh))
  ways = math.prod(mesh.shape[a] for a in axes)
  if ways == 1:
    return
  if task == "lm":
    sharding.sequence.check(data.seq_len, ways)
  attention = getattr(model, "attention", "auto")
  if attention not in attention_lib.SPLIT_LENGTH and attention not in ("auto", "ring"):
    raise ConfigError(
        f"model.attention={attention!r} cannot run with the token positions split over "
        f"{'x'.join(f'{a}={mesh.shape[a]}' for a in axes)}; use model.attention=auto, "
        f"{', '.join(attention_lib.SPLIT_LENGTH)} or ring, or drop the sequence axis from "
        f"mesh.ici")


def _check_attention(model, platform: str, data: ml_collections.ConfigDict) -> None:
  """model.attention kernels that would fail when the step first runs, on `platform` (the
  mesh's devices: what `models.attention.platform()` gives under it, a TPU target's when
  toolkit.compile compiles for one from a CPU). `auto` picks within these limits itself."""
  attention = getattr(model, "attention", "auto")  # ViT blocks always run auto
  # Every device attends over whole rows of data.seq_len: packed rows are that long too
  # (toolkit/data/packing.py), and with a sequence mesh axis _check_context_parallel has
  # already refused splash and cudnn.
  length = data.seq_len
  if attention == "splash" and attention_lib.splash_block(length, length) is None:
    raise ConfigError(
        f"model.attention='splash' needs sequence lengths that are multiples of 128 (the "
        f"kernel's blocks), not data.seq_len={length}; use model.attention=auto, or "
        f"data.seq_len={-(-length // 128) * 128}")
  if attention != "cudnn":
    return
  if platform != "gpu":
    raise ConfigError(
        f"model.attention='cudnn' is cuDNN's fused attention, which needs an NVIDIA GPU; the "
        f"mesh's devices are {platform.upper()}s; use model.attention=auto (it picks what runs "
        f"on {platform.upper()})")
  head_dim = model.resolved_head_dim
  fixes = [fix for fix, fits in (
      ("model.compute_dtype=bfloat16",
       attention_lib.cudnn_supports(None, None, 8, model.compute_dtype)),
      ("a model.head_dim that is a multiple of 8 up to 128",
       attention_lib.cudnn_supports(None, None, head_dim, "bfloat16"))) if not fits]
  if fixes:
    raise ConfigError(
        f"model.attention='cudnn' takes bfloat16 inputs and a head_dim that is a multiple of 8 "
        f"up to 128, not model.compute_dtype={model.compute_dtype!r} with head_dim {head_dim}; "
        f"set {' and '.join(fixes)}, or model.attention=auto")
  # Rows of documents carry segment ids, whose mask JAX hands cuDNN as a bias; with a bias
  # cuDNN's training kernel takes even lengths only (jax 0.10).
  if length % 2 and (data.get("packing", False) or data.source == "chat"):
    raise ConfigError(
        f"model.attention='cudnn' on rows of documents (data.packing, chat data) needs an even "
        f"data.seq_len, not {length}; use data.seq_len={length + 1} or model.attention=auto")


def _check_pipeline(model, mesh: Mesh, rules: sharding.Rules, data: ml_collections.ConfigDict,
                    train: ml_collections.ConfigDict, preset: str) -> None:
  """A stage mesh axis runs the layers as a pipeline (models/pipeline.py), or is refused."""
  placed = {role: _mesh_axes(spec(("layers",), mesh)) for role, spec in
            (("parameters", rules.param_spec), ("activations", rules.activation_spec))}
  stages = math.prod(mesh.shape[a] for a in placed["activations"])
  if mesh.shape.get("stage", 1) > 1 and (stages == 1 or placed["parameters"]
                                         != placed["activations"]):
    raise ConfigError(
        f"mesh has stage={mesh.shape['stage']} but sharding.preset={preset!r} does not run the "
        f"layers as a pipeline over it (layers split over stage, stored and computed), so "
        f"every stage would repeat the same work; use sharding.preset=fsdp_pp")
  if stages == 1:
    return
  microbatches = getattr(model, "pipeline_microbatches", 0)
  rows = data.global_batch_size // train.microbatches
  problem = pipeline_lib.check(getattr(model, "n_layers", 0), rows, stages, microbatches,
                               getattr(model, "n_experts", 0),
                               getattr(model, "pipeline_repeats", 1))
  if problem is None and len(_mesh_axes(rules.activation_spec(("length",), mesh))):
    problem = ("a pipeline with the token positions split (a sequence mesh axis) is not "
               "supported yet; drop one of the two axes")
  if problem is not None:
    raise ConfigError(problem)
  batch_ways = math.prod(mesh.shape[a] for a in _mesh_axes(rules.activation_spec(("batch",),
                                                                                  mesh)))
  if (rows // microbatches) % batch_ways:
    raise ConfigError(
        f"a pipeline micro-batch of {rows // microbatches} rows (data.global_batch_size="
        f"{data.global_batch_size} / train.microbatches / model.pipeline_microbatches="
        f"{microbatches}) is not divisible by the {batch_ways} ways the batch is split; use a "
        f"batch of a multiple of {batch_ways * microbatches * train.microbatches}")


def _check_experts(model, mesh: Mesh, rules: sharding.Rules, preset: str) -> None:
  """Mixture-of-experts layouts that would fail, or quietly give up the expert axis."""
  placed = {role: _mesh_axes(spec(("experts",), mesh)) for role, spec in
            (("parameters", rules.param_spec), ("activations", rules.activation_spec))}
  split = "x".join(f"{a}={mesh.shape[a]}" for a in placed["activations"])
  ways = math.prod(mesh.shape[a] for a in placed["activations"])
  if model.n_experts % ways:
    raise ConfigError(f"model.n_experts={model.n_experts} is not divisible by the mesh axes the "
                      f"experts are split over ({split}, {ways} ways); use a multiple of {ways} "
                      f"experts or a smaller expert axis in mesh.ici")
  if mesh.shape.get("expert", 1) > 1 and not all("expert" in axes for axes in placed.values()):
    unplaced = [role for role, axes in placed.items() if "expert" not in axes]
    raise ConfigError(
        f"mesh has expert={mesh.shape['expert']} but sharding.preset={preset!r} does not split "
        f"the experts' {' and '.join(unplaced)} over it, so every device would hold and run "
        f"every expert; use sharding.preset=fsdp_ep or fsdp_tp_ep, or map experts=expert in "
        f"sharding.param_overrides and sharding.activation_overrides")
  token_axes = _mesh_axes(rules.activation_spec(("batch", "length"), mesh))
  shared = [a for a in placed["activations"] if a in token_axes]
  if shared and len(shared) < len(placed["activations"]):
    raise ConfigError(f"the experts are split over {split} but the batch only over "
                      f"{'+'.join(shared)} of those axes; split the batch over all of them or "
                      f"none (sharding.activation_overrides)")
  if (model.moe_dispatch == "dropless" and model.expert_exchange == "ragged_all_to_all"
      and shared and mesh.devices.flat[0].platform == "cpu"):
    raise ConfigError("model.expert_exchange='ragged_all_to_all' does not run on XLA:CPU (jax "
                      "0.10); use model.expert_exchange=ring on CPU, or compile for a TPU with "
                      "python -m toolkit.compile")

