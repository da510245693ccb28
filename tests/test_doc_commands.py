"""Every command in README.md, docs/*.md and the module docstrings runs as pasted.

scripts/dev/doc_commands.py extracts them; each runs here in bash (a `python -m ...` or `python
SCRIPT.py ...` command of the slow half: in a process forked from one that has imported the
toolkit in the same environment, tests/preloaded.py, ~4 s less each; the default suite's in new
interpreters), in a fresh folder that holds
the repository's experiments/ and scripts/ and the input files the docs assume (text files,
prompts, images), with the environment of a new CPU-only shell: no JAX_PLATFORMS and no
device count in XLA_FLAGS (the commands choose the CPU and simulate their devices
themselves); XLA_FLAGS holds only the suite's code generation flags (LLVM's optimizations and
XLA:CPU's fusion emitters off: the programs compile faster, tests/codegen.py). Changes
to a command, all listed below: short step counts where a flag allows them (SHORTER,
TRAIN_SHORT; no sample after training but in the default suite's commands, SAMPLE; the
largest TPU compiles without the overlap flags, APPEND),
--dry-run for launchers that would reach a cloud or a cluster (DRY_RUN), a free port for
the server, and /tmp paths moved into the folder. A server runs in the background while
the clients of its block (curl, the load test) run against it. Commands that cannot run
here are in SKIP with a reason each. Commands that appear twice (comments and line breaks
aside) run once.

The default suite (`make test`) runs a fast subset: every command that needs no JAX
(launchers, prepare_text, the layout check, the TPU table) and the commands in FAST, the ones
that once failed as pasted (the README's library snippet, `toolkit.generate --prompt`,
`toolkit.serve` with its clients, training on `data=tokens`) with the bare train command and
the inputs they read, about a minute and a half here. Every other command is marked slow
(`make test-slow`, which CI runs after `make test`), and a slow command whose code path a
presubmit test runs is full-tier (FULL: `make test-full` only; tests/tiers.py). A command
that reads what another documented command makes (a checkpoint, shards, a Hugging Face folder: PRODUCERS) runs that
command first when its output is missing, so each test stands alone whichever subset runs.
docs/faults.md shows only the lines commands print (its blocks hold no command). The
folder's compiled programs go to the user's compilation cache, as they would for a user, so
a second run of the suite is faster.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from scripts.dev import doc_commands
from tests import codegen, preloaded, tiers

REPO = pathlib.Path(__file__).resolve().parents[1]

COMMAND_TIMEOUT_S = 420
SERVER_START_TIMEOUT_S = 300

# pattern (re.search in the command) -> why it does not run here. Reviewed: keep it short.
SKIP = {
    r"torch_score_server\.py": "a server with no client in its block; the documented "
                                "bench_score.py command starts it and sends it requests",
    r"^make demo": "the whole demo (2-8 min); its command (experiments/lm.py's launch, the "
                   "README tour's train command) runs here with 3 steps",
    r"^make test": "the test suite itself",
    r"^pip install": "installs packages; make test has installed the tpu extra",
    r"--plan(\s|$)": "a layout search of up to --plan_budget_s=600 s; "
                     "tests/toolkit/planning/test_compile.py's planner tests search small spaces",
    r"--plan=plan\.json": "trains the 1b model from --plan's output on a pod; "
                          "tests/toolkit/test_cli.py applies a plan file",
    r"data=image_folder": "needs ImageNet in /data/imagenet",
    r"^python scripts/bench/bench_\w+\.py\s*(#|$)": "a full benchmark (minutes); its --quick run "
                                               "is here",
    r"calibrate_cpu\.py\s+#": "the full calibration (~10 min); --quick is here",
    r"drill_faults\.py\s+#": "the full drill (two 200-step pod jobs, ~3 min); --steps=60 runs "
                               "in tests/toolkit/pod/test_supervisor.py",
    r"drill_faults\.py --steps=60 --keep": "tests/toolkit/pod/test_supervisor.py runs it and "
                                            "checks the two jobs it keeps",
    r"bench_moe\.py --quick": "tests/scripts/test_bench_moe.py runs it (with --json) and "
                              "checks its table",
    r"bench_step\.py --quick": "tests/scripts/test_bench_step.py runs it (with --json) and "
                               "checks its numbers",
    r"bench_step\.py --devices=1": "a full benchmark (minutes) on one device; its --quick run: "
                                   "tests/scripts/test_bench_step.py",
    r"bench_moe\.py --size=cpu": "the full benchmark at the CPU sizes (~3 min); its --quick "
                                 "run: tests/scripts/test_bench_moe.py",
    r"python scripts/bench/bench_checkpoint\.py\s+#": "the full benchmark (the demo, then the 7b "
                                                 "fingerprints, ~1.5 min); --quick is here",
    r"bench_train\.py --baseline=/tmp/base": "trains in two checkouts (minutes), the second a "
                                             "worktree the user makes first; tests/scripts runs "
                                             "it against this checkout",
    r"bench_batch_fit\.py --before=/tmp/wt_before": "serves in two checkouts (minutes), the "
                                                    "second a worktree the user makes first; "
                                                    "its --quick run is here",
    r"def get_sweep": "an excerpt of experiments/lm.py's get_sweep, shown for its fields",
    r"toolkit\.\w+ .*gs://my-bucket": "needs a Cloud Storage bucket; tests/toolkit/training/"
                                     "test_gcs_workdir.py runs these against a local emulator",
    r"sft\.py:1b,base=/models/": "fine-tunes Llama 3.2 1B from its Hugging Face folder (a "
                                   "download, and a pod's memory); the CPU variant's commands "
                                   "run here",
    r"size=8b --topology=v5e-8": "compiles the 8b step for v5e-8 (0.5-5 min; the full "
                                 "fine-tune exits 1: it does not fit); tests/toolkit/planning/"
                                 "test_compile_lora.py compiles both and checks their verdicts",
    r"--hosts_file=hosts": "an elastic job needs a host lost and returned mid-run; "
                           "tests/toolkit/pod/test_elastic.py runs the same supervisor and "
                           "flags with host 3 deleted from the file and listed again",
    r"--tasks=hellaswag": "the task's data is on the Hugging Face Hub, out of reach here; "
                          "tests/toolkit/evaluation/test_evaluate_command.py checks its one "
                          "error line, test_hf_parity.py the harness on local tasks",
}
# Launchers that would call gcloud / sbatch: their documented --dry-run instead.
DRY_RUN = (r"scripts/launch/tpu_pod\.py", r"scripts/launch/slurm_job\.py")
TRAIN_SHORT = ("--config.train.steps=3 --config.train.log_every=1 --config.train.eval_every=3 "
               "--config.train.checkpoint_every=3 --config.data.eval_batches=1")
# The sample after training (the engine's programs: ~8 s of a 3-step run here) only where the
# default suite runs the command (FAST: the README tour's train command samples, as a user's
# first run does); tests/toolkit/inference/test_sample.py checks the sample itself.
SAMPLE = {True: "--config.train.sample_tokens=16", False: "--config.train.sample_tokens=0"}
# pattern -> (replacement): shorter runs of the same command.
SHORTER = {
    r"--batches=200": "--batches=5",
    r"--requests=200": "--requests=16",
    r"(scripts/bench/bench_score\.py [^\n]*)": r"\1 --rounds=1 --seconds=1 --clients=1,4",
    r"(toolkit\.sweep --config=experiments/lm\.py):cpu": r"\1:tiny",
    r"(toolkit\.sweep --config=experiments/sft\.py):lora": r"\1:tiny",
    # The 7b decode step with its layers scanned: unrolled (the script's default, for a cost
    # analysis that covers every layer) its compile took ~1 min here, scanned ~10 s.
    r"(scripts/bench/decode_cost\.py --model=7b\b[^\n]*)": r"\1 --nounroll",
}
# pattern -> what goes at the end of the command. The 7b and 8x7b steps for 64 TPU chips
# compile without the overlap flags: with them libtpu took 1.5x as long (108 s against 71 s for
# the 7b here), and what they change is tests/toolkit/planning/test_overlap.py's to check.
APPEND = {r"--topology=v5p-128": "--config.runtime.xla_flags=none"}
# pattern -> why it runs in make test-slow only (over a minute here, even shortened).
SLOW = {
    r"--topology=v5p-128": "compiles the 7b step for 64 TPU chips (~2 min)",
    r"toolkit\.sweep": "trains 4-8 trials",
    r"scripts/launch/local_pod\.py": "two JAX processes; tests/toolkit/pod runs the pod simulator",
    r"scripts/bench/bench_": "benchmarks, even --quick",
    r"scripts/launch/seeds\.py": "three ViT runs",
}
# The full tier (tests/tiers.py): pattern -> (clause, the presubmit test that runs the command's
# code path); the first pattern that matches wins. A TPU compile of a documented command is
# full-tier where another presubmit compile covers its program (COMPILE: the step, decode, LoRA,
# the mixture of experts and the pipeline each keep one); a command is full-tier where a
# presubmit test runs the same module or script with its flags (COMMAND), on the documented
# config or a smaller one. Commands no presubmit test runs (most benchmarks' --quick runs) stay
# in the presubmit tier.
_POD, _PLANNING, _TUNING = "tests/toolkit/pod", "tests/toolkit/planning", "tests/toolkit/tuning"
_INFERENCE, _SERVING = "tests/toolkit/inference", "tests/toolkit/serving"
FULL = {
    r"toolkit\.compile .*--decode|decode_cost\.py --model=7b": (
        tiers.COMPILE, f"{_PLANNING}/test_compile_decode.py::"
                       "test_int8_weights_halve_the_7b_decode_step_on_v5e_8"),
    r"toolkit\.compile .*moe\.py": (
        tiers.COMPILE, f"{_PLANNING}/test_compile.py::"
                       "test_moe_ragged_all_to_all_exchange_compiles_for_tpu"),
    r"toolkit\.compile .*--slices=2": (
        tiers.COMPILE, f"{_PLANNING}/test_compile.py::test_two_slices_flag_dcn_collectives"),
    r"toolkit\.compile .*--topology=cpu": (
        tiers.COMPILE, f"{_PLANNING}/test_compile.py::test_cli_compiles_for_simulated_host_devices"),
    r"toolkit\.compile": (
        tiers.COMPILE, f"{_PLANNING}/test_compile.py::test_cpu_lm_compiles_and_fits_on_small_slices"),
    r"decode_cost\.py": (
        tiers.COMMAND, "tests/scripts/test_decode_cost.py::"
                       "test_decode_cost_reports_the_cache_it_compiled_for"),
    r"toolkit\.cost": (
        tiers.COMMAND, "tests/toolkit/planning/cost/test_cost_cli.py::"
                       "test_the_ranking_table_json_and_plot"),
    r"toolkit\.sweep": (
        tiers.COMMAND, f"{_TUNING}/test_sweep.py::test_killed_sweep_resumes_to_the_same_table"),
    r"scripts/launch/seeds\.py": (
        tiers.COMMAND, f"{_TUNING}/test_seeds.py::test_each_seed_is_a_run_with_that_seed"),
    r"toolkit\.serve --config=experiments/dlrm": (
        tiers.COMMAND, f"{_SERVING}/test_score_server.py::"
                       "test_the_command_line_serves_a_click_checkpoint"),
    r"toolkit\.serve": (
        tiers.COMMAND, f"{_SERVING}/test_openai_api.py::"
                       "test_completions_equal_generate_and_stream_joins_to_the_answer"),
    r"toolkit\.generate": (tiers.COMMAND, f"{_INFERENCE}/test_generate.py::test_command_line"),
    r"toolkit\.predict": (
        tiers.COMMAND, f"{_INFERENCE}/test_predict.py::"
                       "test_predictions_match_the_model_and_keep_input_order"),
    r"toolkit\.sample": (
        tiers.COMMAND, f"{_INFERENCE}/test_sample.py::test_sample_from_checkpoint_is_reproducible"),
    r"toolkit\.evaluate": (
        tiers.COMMAND, "tests/toolkit/evaluation/test_periodic.py::"
                       "test_eval_tasks_every_n_steps_from_memory_equal_the_checkpoints"),
    r"^import peft": (
        tiers.COMMAND, "tests/toolkit/conversion/test_lora_export.py::"
                       "test_peft_export_loads_in_peft_with_meshkits_logits"),
    r"toolkit\.convert|from_pretrained\('runs/hf_export'\)": (
        tiers.COMMAND, "tests/toolkit/test_convert.py::test_import_generate_export"),
    r"chat_exact_match\.py": (
        tiers.COMMAND, "tests/test_documented_results.py::"
                       "test_sft_learns_to_repeat_words_on_three_seeds[seed_0]"),
    r"scripts/bench/bench_serve\.py": (
        tiers.COMMAND, f"{_SERVING}/test_openai_api.py::"
                       "test_bench_serve_quick_reports_every_column"),
    r"bench_train\.py --baseline=\. ": (
        tiers.COMMAND, "tests/scripts/test_bench_attention_and_train.py::"
                       "test_train_benchmark_against_this_checkout"),
    r"scripts/bench/bench_attention\.py": (
        tiers.COMMAND, "tests/scripts/test_bench_attention_and_train.py::"
                       "test_attention_benchmark_times_both_implementations"),
    r"scripts/launch/local_pod\.py": (
        tiers.COMMAND, f"{_POD}/test_multiprocess.py::test_two_processes_train_like_one"),
    r"toolkit\.supervise": (
        tiers.COMMAND, f"{_POD}/test_supervisor.py::test_a_crash_and_a_hang_are_restarted_"
                       "and_the_losses_equal_an_uninterrupted_run"),
    r"toolkit\.train": (
        tiers.COMMAND, "tests/toolkit/test_cli.py::test_tiny_run_writes_progress_eval_"
                       "checkpoints_metrics_tensorboard_and_plot"),
}
# Docstring commands that need no JAX: cheap, so the default suite runs them too.
JAX_FREE = (r"scripts/(launch/(tpu_pod|gke_jobset|slurm_job)|data/prepare_text|dev/(check_layout|doc_commands))\.py",
            r"toolkit\.topology")
# pattern -> why the default suite runs it (the rest of the JAX commands are slow). Each must
# match a documented command (test_the_docs_show_commands), so these cannot drift away.
FAST = {
    r"^from experiments import lm": "the README's library snippet (it once needed XLA_FLAGS)",
    r"^python -m toolkit\.train --config=experiments/lm\.py:cpu --workdir=runs/lm_cpu$":
        "the README tour's train command, without XLA_FLAGS: the checkpoint generate and serve "
        "read",
    r"toolkit\.generate --config=experiments/lm\.py:cpu --checkpoint=runs/lm_cpu \\\n"
    r"\s*--prompt=\"The \" --temperature":
        "docs/inference.md's generate --prompt (it once needed XLA_FLAGS)",
}
# docs/inference.md's server and its clients (38 s) and the training on prepared shards (14 s)
# once needed XLA_FLAGS too; they run in the slow half, where make test's 10-minute budget
# left them (tests/toolkit/serving/test_serve.py and test_openai_api.py serve in make test).
# What a command reads -> (pattern of the documented command that makes it).
PRODUCERS = {
    "data/mytext": r"prepare_text\.py --out=data/mytext ",
    "runs/lm_cpu": (r"^python -m toolkit\.train --config=experiments/lm\.py:cpu "
                    r"--workdir=runs/lm_cpu$"),
    "runs/lm_cpu_lr1e-3": (r"toolkit\.train --config=experiments/lm\.py:cpu "
                           r"--workdir=runs/lm_cpu_lr1e-3"),
    "runs/dlrm_cpu": r"toolkit\.train --config=experiments/dlrm\.py:cpu --workdir=runs/dlrm_cpu",
    "runs/dlrm_movielens": (r"toolkit\.train --config=experiments/dlrm\.py:movielens "
                            r"--workdir=runs/dlrm_movielens"),
    "runs/vit_digits": r"toolkit\.train --config=experiments/vit\.py:cpu --workdir=runs/vit_digits",
    "runs/hf_tiny": r"scripts/data/tiny_hf_model\.py --out=runs/hf_tiny",
    "runs/hf_import": r"toolkit\.convert import --hf=runs/hf_tiny --workdir=runs/hf_import",
    "runs/hf_export": r"toolkit\.convert export --workdir=runs/hf_import --out=runs/hf_export",
    "runs/lm_cpu_hf": r"toolkit\.convert export --workdir=runs/lm_cpu --out=runs/lm_cpu_hf",
    "runs/sft_repeat": (r"toolkit\.train --config=experiments/sft\.py:cpu,base=runs/lm_cpu_hf "
                        r"\\\n\s*--workdir=runs/sft_repeat"),
    "runs/sft_repeat_lora": (r"toolkit\.train --config=experiments/sft\.py:cpu,base=runs/"
                             r"lm_cpu_hf,lora=16 \\\n\s*--workdir=runs/sft_repeat_lora"),
    "runs/sft_lora_peft": (r"toolkit\.convert export --workdir=runs/sft_repeat_lora "
                           r"--out=runs/sft_lora_peft --peft"),
    "runs/sft_repeat_240": (r"toolkit\.train --config=experiments/sft\.py:cpu,"
                            r"base=runs/lm_cpu_hf \\\n\s*--config\.train\.steps=240 "
                            r"[^\n]*--workdir=runs/sft_repeat_240"),
    "runs/sft_repeat_240_hf": (r"toolkit\.convert export --workdir=runs/sft_repeat_240 "
                               r"--out=runs/sft_repeat_240_hf"),
}
# pattern of a command -> (pattern of an output line it may print, why). Reviewed: each one an
# open problem of the code, not of the docs.
KNOWN_NOISE: dict[str, tuple[str, str]] = {
    r"^import peft": (r"FutureWarning: `is_gradient_checkpointing` is deprecated",
                      "peft 0.21.2's PeftModel reads an attribute transformers 5 deprecated "
                      "(peft/peft_model.py); upstream's to fix, the load itself is right"),
}
# pattern of a command -> (pattern its standard output must hold, why): a result the page shows
# beside the command.
EXPECTED_OUTPUT: dict[str, tuple[str, str]] = {
    r"from_pretrained\('runs/hf_export'\)": (
        r"\['LlamaForCausalLM'\] 115136\n",
        "docs/huggingface.md's guide ends with transformers loading the export: its class and the "
        "tiny model's parameter count"),
}
TEXT = ("The quick brown fox jumps over the lazy dog. A list is a sequence of items; "
        "a dictionary maps keys to values. ") * 300


def _skip_reason(text: str) -> str | None:
  for pattern, reason in SKIP.items():
    if re.search(pattern, text, re.M):
      return reason
  return None


def _runnable(text: str, workspace: pathlib.Path, port: int, kind: str = "shell") -> str:
  """The command as it runs here (see the module docstring for every change)."""
  fast = any(re.search(pattern, text, re.M) for pattern in FAST)
  text = re.sub(r"\s*#[^'\"\n]*$", "", text, flags=re.M)  # trailing comments
  for pattern in DRY_RUN:
    if re.search(pattern, text) and "--dry-run" not in text:
      head, sep, tail = text.partition(" -- ")
      text = f"{head} --dry-run{sep}{tail}"
  for pattern, replacement in SHORTER.items():
    text = re.sub(pattern, replacement, text)
  for pattern, extra in APPEND.items():
    if re.search(pattern, text):
      text = f"{text.rstrip()} {extra}"
  if (kind == "shell" and re.search(r"toolkit\.train\b|scripts/launch/(local_pod|seeds)\.py", text)
      and "--dry-run" not in text):
    text = f"{text.rstrip()} {TRAIN_SHORT} {SAMPLE[fast]}"
  text = text.replace("/tmp/", f"{workspace}/tmp/")
  text = re.sub(r"\b8000\b", str(port), text)
  return text.rstrip().removesuffix("&").rstrip()


def _normalized(text: str) -> str:
  text = re.sub(r"\s*#[^'\"\n]*$", "", text, flags=re.M)
  return " ".join(text.replace("\\\n", " ").split())


def _same_run(a: str, b: str) -> bool:
  """Whether two commands are one run: the same once comments, line breaks and the NAME=VALUE
  settings before the command (XLA_FLAGS=...) are set aside."""
  without_settings = lambda text: re.sub(r"^(?:[A-Z_]+=\S+\s+)*", "", _normalized(text))
  return without_settings(a) == without_settings(b)


def _cases() -> list[list[doc_commands.DocCommand]]:
  """Single commands, and each server with the clients in its block; inputs first
  (prepare_text), then training, then what reads checkpoints. Duplicates run once."""
  found = doc_commands.all_commands()
  servers = {c.block for c in found if "toolkit.serve" in c.text}
  commands, seen = [], set()
  for command in found:  # a server's clients stay with it
    if command.block in servers or _normalized(command.text) not in seen:
      seen.add(_normalized(command.text))
      commands.append(command)
  cases, clients = [], {}
  for command in commands:
    if command.block in servers and "toolkit.serve" not in command.text:
      clients.setdefault(command.block, []).append(command)
  for command in commands:
    if command.block in servers and "toolkit.serve" not in command.text:
      continue
    cases.append([command] + (clients.pop(command.block, []) if command.block in servers
                              else []))

  def stage(case):  # what makes inputs, then training, then the rest; else in doc order
    text = case[0].text
    if re.search(r"prepare_text|tiny_hf_model|toolkit\.convert import", text):
      return 0
    # An export that others read (PRODUCERS) before they run: after them, its --out would be
    # there already (made for them) and the export refuses to write over it.
    if "toolkit.convert export" in text and any(re.search(p, text) for p in PRODUCERS.values()):
      return 0
    return 1 if "toolkit.train" in text and "--plan=" not in text else 2
  return sorted(cases, key=stage)


def _unit(case) -> str:
  """The unit of work a case belongs to when the suite runs in two processes (tests/conftest.py):
  the TPU compiles, the commands that make or read what another one makes (PRODUCERS: they
  share a workspace), and the rest. Each unit has a workspace of its own (each test makes what
  it reads when missing), so the units run side by side."""
  text = case[0].text
  if re.search(r"toolkit\.(compile|cost)\b|decode_cost\.py", text):
    return "tpu"
  if any(_reads(text, path) or re.search(pattern, text) for path, pattern in PRODUCERS.items()):
    return "runs"
  return "rest"


def units() -> dict[str, str]:
  """Each case's test id -> its unit (tests/conftest.py's scheduler)."""
  return {case[0].where: _unit(case) for case in _cases()}


def _in_default_suite(command: doc_commands.DocCommand) -> bool:
  if any(re.search(pattern, command.text) for pattern in SLOW):
    return False
  return any(re.search(pattern, command.text, re.M) for pattern in (*JAX_FREE, *FAST))


def _full(command: doc_commands.DocCommand):
  """The full-tier mark of a command the default suite does not run, or None (FULL)."""
  if _in_default_suite(command):
    return None
  for pattern, (clause, by) in FULL.items():
    if re.search(pattern, command.text, re.M):
      return tiers.full(clause, by)
  return None


def _param(case):
  marks = [] if _in_default_suite(case[0]) else [pytest.mark.slow]
  full = _full(case[0])
  return pytest.param(case, id=case[0].where, marks=marks + ([full] if full else []))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> pathlib.Path:
  """A new user's folder: the repository's experiments/ and scripts/, and the inputs the
  docs name (their own text, prompts, images, a tokenizer)."""
  root = tmp_path_factory.mktemp("docs")
  for folder in ("experiments", "scripts"):
    (root / folder).symlink_to(REPO / folder)
  (root / "more").mkdir()
  (root / "path" / "to").mkdir(parents=True)
  (root / "tmp").mkdir()
  for name in ("book.txt", "book1.txt", "book2.txt", "more/a.txt", "more/b.txt"):
    (root / name).write_text(TEXT)
  for name in ("corpus.jsonl", "notes.jsonl"):
    (root / name).write_text("".join(json.dumps({"text": f"{i}. {TEXT}"}) + "\n"
                                     for i in range(4)))
  for name in ("tokenizer.json", "path/to/tokenizer.json"):
    shutil.copy(REPO / "tests" / "fixtures" / "tokenizer.json", root / name)
  for name in ("prompts.jsonl", "in.jsonl"):
    (root / name).write_text("".join(json.dumps({"prompt": p}) + "\n"
                                     for p in ("The ", "A list is", "def ")))
  _write_digits(root / "images.npz")
  return root


def _write_digits(path: pathlib.Path) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  images = (digits.images[:20] * (255 / 16)).round().astype(np.uint8)
  np.savez(path, images=images, labels=digits.target[:20])


def _env() -> dict[str, str]:
  """A new shell's environment: the venv's python first on PATH, nothing set for JAX but
  the suite's code generation (see the module docstring)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH")}
  env["XLA_FLAGS"] = " ".join(codegen.flags())
  env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
  return env


def _python_command(text: str) -> tuple[dict[str, str], dict[str, str], list[str]] | None:
  """(NAME=VALUE settings, {"module": ...} or {"script": ...}, arguments) of a command that is
  one `python -m MODULE ...` or `python SCRIPT.py ...`, or None for anything else a shell must
  interpret (pipes, lists of commands, redirections, variables, globs)."""
  one = text.replace("\\\n", " ")
  if re.search(r"[|&;<>`$()*?\n]", one):
    return None
  words = shlex.split(one, comments=True)
  settings = {}
  while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
    name, _, value = words.pop(0).partition("=")
    settings[name] = value
  if len(words) >= 3 and words[:2] == ["python", "-m"]:
    return settings, {"module": words[2]}, words[3:]
  if len(words) >= 2 and words[0] == "python" and words[1].endswith(".py"):
    return settings, {"script": words[1]}, words[2:]
  return None


def _run(text: str, kind: str, cwd: pathlib.Path,
         where: str = "", fresh: bool = False) -> subprocess.CompletedProcess:
  """Runs a command as pasted. A `python` command (a snippet, `python -m ...`, `python
  SCRIPT.py ...`) runs in a process forked from one that has imported the toolkit in this
  shell's environment (tests/preloaded.py: ~4 s less per command than a new interpreter's
  imports; `fresh` for a new interpreter, as the default suite's commands run), the rest in
  bash. With DOC_COMMANDS_REPORT=FILE in the environment, appends {where, command, exit,
  seconds} to FILE as one JSON line (the table of a fresh clone's run)."""
  start = time.monotonic()
  python = _python_command(text) if kind == "shell" else ({}, {"code": text}, [])
  if python is None or fresh:
    argv = [sys.executable, "-c", text] if kind == "python" else ["bash", "-c", text]
    result = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S, check=False)
  else:
    settings, what, args = python
    result = preloaded.run(**what, args=args, cwd=cwd, env=_env() | settings,
                           timeout=COMMAND_TIMEOUT_S, own_server=True)
  report = os.environ.get("DOC_COMMANDS_REPORT")
  if report:
    with open(report, "a", encoding="utf-8") as f:
      f.write(json.dumps({"where": where, "command": text, "exit": result.returncode,
                          "seconds": round(time.monotonic() - start, 1)}) + "\n")
  return result


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _check(result: subprocess.CompletedProcess, command: doc_commands.DocCommand, text: str):
  output = result.stdout + result.stderr
  assert result.returncode == 0, f"{command.where}: exit {result.returncode}\n{text}\n{output}"
  assert "Traceback" not in output, f"{command.where}\n{output}"
  # Quiet: no absl/C++ log lines (libtpu's start-up, Orbax), no Python warnings, no
  # resource-tracker complaints, no warning of our own in a documented command.
  allowed = [line for pattern, (line, _) in KNOWN_NOISE.items()
             if re.search(pattern, command.text)]
  noise = [line for line in output.splitlines()
           if (re.match(r"[EWF]\d{4} ", line) or re.search(r"\w+Warning:|resource_tracker", line)
               or line.startswith("warning:"))
           and not any(re.search(pattern, line) for pattern in allowed)]
  assert not noise, f"{command.where}: warnings in the output\n" + "\n".join(noise)


def _reads(text: str, path: str) -> bool:
  return re.search(rf"(?<![\w/.-]){re.escape(path)}(?![\w-])", text) is not None


def _ensure_inputs(text: str, workspace: pathlib.Path) -> None:
  """Runs the documented commands that make what `text` reads (PRODUCERS), when missing."""
  for path, pattern in PRODUCERS.items():
    if not _reads(text, path) or re.search(pattern, text) or (workspace / path).exists():
      continue
    producer = next(c for c in doc_commands.all_commands() if re.search(pattern, c.text))
    if _same_run(producer.text, text):  # the command makes it itself
      continue
    _ensure_inputs(producer.text, workspace)
    runnable = _runnable(producer.text, workspace, _free_port(), producer.kind)
    _check(_run(runnable, producer.kind, workspace, producer.where,
                _in_default_suite(producer)), producer, runnable)


def _serve(case, workspace: pathlib.Path) -> None:
  port = _free_port()
  server_text = _runnable(case[0].text, workspace, port)
  server = subprocess.Popen(["bash", "-c", f"exec {server_text}"], cwd=workspace, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline, lines = time.monotonic() + SERVER_START_TIMEOUT_S, []
    while time.monotonic() < deadline:
      line = server.stdout.readline()
      lines.append(line)
      if not line or line.startswith("serving on"):
        break
    assert lines[-1].startswith("serving on"), f"{case[0].where}: no server\n{''.join(lines)}"
    for client in case[1:]:
      text = _runnable(client.text, workspace, port, client.kind)
      result = _run(text, client.kind, workspace, client.where, _in_default_suite(client))
      _check(result, client, text)
      if text.startswith("curl"):
        assert result.stdout.strip(), f"{client.where}: empty reply"
  finally:
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(timeout=60)
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait()


def test_the_docs_show_commands():
  commands = doc_commands.all_commands()
  sources = {c.where.split(":")[0] for c in commands}
  assert {"README.md", "docs/training.md", "docs/inference.md", "docs/huggingface.md",
          "docs/moe.md", "experiments/lm.py", "experiments/moe.py", "toolkit/train.py"
          } <= sources, sources
  assert any(c.kind == "python" for c in commands)
  # Every pattern still matches a command: the lists cannot go stale, and the commands that
  # once failed as pasted stay in the default suite.
  for pattern in (*SKIP, *FAST, *APPEND, *PRODUCERS.values(), *KNOWN_NOISE, *EXPECTED_OUTPUT,
                  *FULL):
    assert any(re.search(pattern, c.text, re.M) for c in commands), pattern
  default = [c for c in commands if _in_default_suite(c)]
  for pattern in FAST:
    assert any(re.search(pattern, c.text, re.M) for c in default), pattern
  # Every test file or folder a reason here names exists.
  for reason in (*SKIP.values(), *SLOW.values(), *FAST.values()):
    for path in re.findall(r"\btests/[\w/.]*\w", reason):
      assert (REPO / path).exists(), f"{path}, named in the reason {reason!r}, does not exist"
  # No two documented training runs share a workdir: the second would restore the first's
  # checkpoint and train nothing. One exception, by design: the same command documented in
  # several places (settings such as XLA_FLAGS aside) is one run, and a second run of it
  # finding its checkpoint is what the docs promise. (A workdir another kind of command makes
  # first, as toolkit.convert import makes runs/hf_import for training to continue, is not a
  # second training run.)
  runs: dict[str, list[doc_commands.DocCommand]] = {}
  for command in commands:
    workdir = re.search(r"--workdir[= ](\S+)", command.text)
    if command.kind == "shell" and "toolkit.train" in command.text and workdir:
      runs.setdefault(workdir.group(1), []).append(command)
  shared = {workdir: [c.where for c in found] for workdir, found in runs.items()
            if any(not _same_run(c.text, found[0].text) for c in found)}
  assert not shared, f"documented training runs that share a workdir: {shared}"


def test_a_python_command_runs_forked_from_a_process_preloaded_in_the_shells_environment():
  assert _python_command("XLA_FLAGS=--a=1 python -m toolkit.train --b=2 \\\n  --c='d e'  # f") \
      == ({"XLA_FLAGS": "--a=1"}, {"module": "toolkit.train"}, ["--b=2", "--c=d e"])
  assert _python_command("python scripts/launch/seeds.py --seeds=0,1") == (
      {}, {"script": "scripts/launch/seeds.py"}, ["--seeds=0,1"])
  for shell in ("python -m toolkit.train | tail -1", "python a.py && python b.py",
                "python -m toolkit.x --out=$HOME", "curl -s http://127.0.0.1:1/", "make demo"):
    assert _python_command(shell) is None, shell
  # The shell's environment has no JAX_PLATFORMS (the suite's has "cpu"): the process the
  # command is forked from imported JAX without it too, as a new interpreter would.
  result = preloaded.run(code="import os, sys; preloaded = 'toolkit.training' in sys.modules; "
                         "import jax; print(preloaded, os.environ.get('JAX_PLATFORMS'), "
                         "jax.config.jax_platforms)", env=_env(), timeout=COMMAND_TIMEOUT_S,
                         own_server=True)
  assert (result.returncode, result.stdout) == (0, "True None None\n"), result.stderr


@pytest.mark.parametrize("case", [_param(case) for case in _cases()])
def test_documented_command_runs(case, workspace):
  reason = _skip_reason(case[0].text)
  if reason:
    pytest.skip(f"{case[0].where}: {reason}")
  _ensure_inputs(case[0].text, workspace)
  if "toolkit.serve" in case[0].text:
    _serve(case, workspace)
    return
  text = _runnable(case[0].text, workspace, _free_port(), case[0].kind)
  result = _run(text, case[0].kind, workspace, case[0].where, _in_default_suite(case[0]))
  _check(result, case[0], text)
  for pattern, (expected, why) in EXPECTED_OUTPUT.items():
    if re.search(pattern, case[0].text):
      assert re.search(expected, result.stdout), f"{case[0].where}: {why}\n{result.stdout}"
