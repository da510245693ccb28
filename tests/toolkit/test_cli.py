"""`python -m toolkit.train` end to end, as a user runs it: a normal run, a --config override,
SIGTERM then resume, and the user mistakes that must each end in one `error:` line.

Every run is a process of its own on 8 simulated CPU devices, bounded by a timeout, forked
from one that has already imported the toolkit (tests/preloaded.py); `--help`, the console
scripts and the mistakes in FRESH run in new interpreters, as a shell starts them. A mistake
must exit non-zero, print no traceback, print exactly one `error:` line that names the field or
flag and the fix, and leave a workdir that already holds checkpoints exactly as it was.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import preloaded

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = "--config=experiments/lm.py:tiny"
MOE = "--config=experiments/moe.py:tiny"
PLAN = pathlib.Path(__file__).parent / "fixtures" / "plan.json"  # as toolkit.compile --plan writes
RETURNS_NONE = pathlib.Path(__file__).parent / "fixtures" / "returns_none.py"
RUN_TIMEOUT_S = 300  # a tiny run takes ~15 s on 2 shared cores; generous for loaded machines
MISTAKE_TIMEOUT_S = 120  # mistakes are caught before compiling: ~0.5 s each, 2-4 s in a new
                         # interpreter
PROGRESS = re.compile(r"^step (\d+)/(\d+) \| loss [\d.]+ nats per token \| lr [\d.e+-]+ \| "
                      r".*\| [\d,]+ tok/s \|.* ETA \d+(h\d\d)?m\d\ds$", re.M)


def _env() -> dict[str, str]:
  """The suite's environment (tests/conftest.py): 8 CPU devices, the session's cache folder."""
  return dict(os.environ)


def train(*args: str, timeout: float = RUN_TIMEOUT_S,
          fresh: bool = False) -> subprocess.CompletedProcess:
  """`python -m toolkit.train *args`, finished (in a new interpreter when `fresh`)."""
  return preloaded.run("toolkit.train", args, env=_env(), timeout=timeout, fresh=fresh)


def checkpoint_steps(workdir: pathlib.Path) -> set[int]:
  directory = workdir / "checkpoints"
  if not directory.is_dir():
    return set()
  return {int(p.name) for p in directory.iterdir() if p.name.isdigit()}


def snapshot(root: pathlib.Path) -> dict[str, tuple]:
  """Every path under `root`: (size, mtime_ns, sha256) for files, mtime_ns for folders."""
  tree = {".": ("dir", root.stat().st_mtime_ns)}
  for path in sorted(root.rglob("*")):
    stat = path.stat()
    if path.is_file():
      tree[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns,
                                           hashlib.sha256(path.read_bytes()).hexdigest())
    else:
      tree[str(path.relative_to(root))] = ("dir", stat.st_mtime_ns)
  return tree


def refused(result: subprocess.CompletedProcess, fragments: list[str], folder: pathlib.Path,
            before: dict) -> str:
  """Asserts a refused run: one error line holding every fragment, `folder` exactly as its
  snapshot `before`. Returns the line."""
  line = the_error_line(result)
  for fragment in fragments:
    assert fragment in line, line
  assert snapshot(folder) == before
  return line


def the_error_line(result: subprocess.CompletedProcess) -> str:
  """Asserts the shape of a refused run and returns its one error line."""
  output = result.stdout + result.stderr
  assert result.returncode != 0, output
  assert "Traceback" not in output, output
  assert "FATAL" not in output, output
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, output
  # Nothing else on stderr: no absl/Orbax log flood, no usage dump.
  assert result.stderr.strip() == errors[0], result.stderr
  return errors[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
  """One plain tiny run (10 steps, checkpoints at 5 and 10), shared by the tests below."""
  workdir = tmp_path_factory.mktemp("trained") / "w"
  result = train(TINY, f"--workdir={workdir}")
  assert result.returncode == 0, result.stdout + result.stderr
  return workdir, result


@pytest.fixture
def workdir_copy(trained, tmp_path) -> pathlib.Path:
  """A private copy of the trained workdir, so a test that breaks it breaks only itself."""
  copy = tmp_path / "w"
  shutil.copytree(trained[0], copy, copy_function=shutil.copy2)
  return copy


# --- a run that works ----------------------------------------------------------------------------

def test_tiny_run_writes_progress_eval_checkpoints_metrics_tensorboard_and_plot(trained):
  workdir, result = trained
  assert "Traceback" not in result.stdout + result.stderr
  assert not re.search(r"^[IW]\d{4} ", result.stderr, re.M), "absl INFO/WARNING log flood"
  progress = PROGRESS.findall(result.stdout)
  # The first step's line at once, then every log_every (5) steps.
  assert [int(step) for step, total, _ in progress] == [1, 5, 10], result.stdout
  assert "compiling the step ..." in result.stdout
  assert "eval at step 0: loss" in result.stdout
  assert "eval at step 10: loss" in result.stdout
  assert checkpoint_steps(workdir) == {5, 10}
  assert f"checkpoint: {workdir / 'checkpoints' / '10'}" in result.stdout
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert sorted(r["step"] for r in records if r["kind"] == "train") == list(range(1, 11))
  assert sorted(r["step"] for r in records if r["kind"] == "eval") == [0, 10]
  assert all(r["loss"] > 0 for r in records if r["kind"] in ("train", "eval"))
  # The progress lines' speed figures are in the records they close too.
  logged = [r for r in records if r["kind"] == "train" and "tokens_per_second" in r]
  assert [r["step"] for r in logged] == [1, 5, 10]
  for r in logged:
    assert r["tokens_per_second"] == pytest.approx(16 * 32 / r["step_seconds"])  # tiny batch
    assert 0 < r["mfu"] < 1
  # Goodput: one record and one line; the phases are disjoint parts of the wall time.
  [goodput] = [r for r in records if r["kind"] == "goodput"]
  phases = [goodput[f"{name}_seconds"] for name in
            ("startup", "compile", "steps", "data_wait", "eval", "checkpoint", "other")]
  assert all(seconds >= 0 for seconds in phases) and goodput["compile_seconds"] > 0
  assert sum(phases) == pytest.approx(goodput["wall_seconds"], rel=1e-6)
  assert goodput["productive_fraction"] == pytest.approx(
      goodput["steps_seconds"] / goodput["wall_seconds"])
  assert re.search(r"^goodput \d+\.\d% of [\d.]+ s wall: start-up [\d.]+ s, compile ",
                   result.stdout, re.M), result.stdout
  # One record per save: how long it blocked the loop, and how long until it was written.
  saves = [r for r in records if r["kind"] == "checkpoint"]
  assert [r["step"] for r in saves] == [5, 10], saves
  assert all(0 < r["blocking_seconds"] < r["seconds"] for r in saves), saves
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  assert (workdir / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_config_override_and_plan_take_effect(tmp_path):
  workdir = tmp_path / "w"
  result = train(TINY, f"--workdir={workdir}", "--config.train.steps=4", f"--plan={PLAN}")
  assert result.returncode == 0, result.stdout + result.stderr
  saved = json.loads((workdir / "config.json").read_text())
  for field, value in json.loads(PLAN.read_text())["overrides"].items():
    section, name = field.split(".")
    assert saved[section][name] == value, field
  assert [int(step) for step, _, _ in PROGRESS.findall(result.stdout)][-1:] == [4]
  assert "step 4/4 |" in result.stdout
  assert checkpoint_steps(workdir) == {4}
  assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 4


def wait_for_progress(process, stdout_path: pathlib.Path, stderr_path: pathlib.Path) -> None:
  """Until the run trains: its first progress line (step 1) is printed inside the loop."""
  deadline = time.monotonic() + RUN_TIMEOUT_S
  while not PROGRESS.search(stdout_path.read_text()):
    assert process.poll() is None, stdout_path.read_text() + stderr_path.read_text()
    assert time.monotonic() < deadline, "no progress line before the deadline"
    time.sleep(0.1)  # polling interval, not a wait for readiness


def test_sigterm_saves_and_exits_zero_then_the_same_command_resumes(tmp_path):
  workdir = tmp_path / "w"
  args = [TINY, f"--workdir={workdir}", "--config.train.checkpoint_every=1000"]
  stdout_path, stderr_path = tmp_path / "stdout", tmp_path / "stderr"
  with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
    process = preloaded.start("toolkit.train", [*args, "--config.train.steps=2000"],
                              env=_env(), stdout=stdout, stderr=stderr)
    try:
      wait_for_progress(process, stdout_path, stderr_path)
      process.send_signal(signal.SIGTERM)
      returncode = process.wait(timeout=RUN_TIMEOUT_S)
    finally:
      if process.poll() is None:
        process.kill()
        process.wait()
  output = stdout_path.read_text()
  assert returncode == 0, output + stderr_path.read_text()
  assert "Traceback" not in output + stderr_path.read_text()
  assert "received SIGTERM" in output
  stopped = re.search(r"^stopped at step (\d+) on request; checkpoint saved$", output, re.M)
  assert stopped, output
  stop_step = int(stopped.group(1))
  assert 1 <= stop_step < 2000
  assert checkpoint_steps(workdir) == {stop_step}

  final = stop_step + 5
  resumed = train(*args, f"--config.train.steps={final}")
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f"restored step {stop_step} from" in resumed.stdout
  assert f"step {final}/{final} |" in resumed.stdout
  assert max(checkpoint_steps(workdir)) == final


def test_help_describes_the_flags():
  result = train("--help", timeout=MISTAKE_TIMEOUT_S, fresh=True)
  assert "Traceback" not in result.stdout + result.stderr
  assert "--config: Required. Experiment file and variant" in result.stdout
  assert "--workdir: Required. Directory for checkpoints" in result.stdout


# --- mistakes: one line, non-zero exit, nothing touched ------------------------------------------

# (id, arguments with {W} for the workdir, fragments the error line must contain: the field or
# flag, what is wrong, and the fix)
MISTAKES = [
    ("experiment_file_missing", ["--config=experiments/nosuch.py", "--workdir={W}"],
     ["--config=experiments/nosuch.py", "does not exist", "give e.g. --config=experiments/lm.py"]),
    # A file that is not Python once ended in "AttributeError: 'NoneType' object has no
    # attribute 'loader'", and /dev/null in "does not exist".
    ("experiment_file_not_python", ["--config=README.md:tiny", "--workdir={W}"],
     ["--config=README.md:tiny", "README.md is not a Python file", "give an experiment file"]),
    ("experiment_file_a_device", ["--config=/dev/null", "--workdir={W}"],
     ["--config=/dev/null", "/dev/null is not a Python file", "e.g. --config=experiments/lm.py"]),
    ("variant_unknown", ["--config=experiments/lm.py:nosuch", "--workdir={W}"],
     ["--config=experiments/lm.py:nosuch", "unknown variant 'nosuch'", "choose from cpu, tiny"]),
    ("size_preset_unknown", ["--config=experiments/lm.py:size=huge", "--workdir={W}"],
     ["--config=experiments/lm.py:size=huge", "size='huge' is unknown", "choose from tiny"]),
    # config_flags logged a warning of its own (and absl its "before flag parsing" line) first.
    ("experiment_returns_none", [f"--config={RETURNS_NONE}", "--workdir={W}"],
     [f"--config={RETURNS_NONE}: get_config() in {RETURNS_NONE} returned None, not an "
      "ml_collections.ConfigDict", "end get_config with `return config`"]),
    ("override_wrong_type", [TINY, "--workdir={W}", "--config.train.steps=abc"],
     ["--config.train.steps=abc", "of type int", "give e.g. --config.train.steps=10"]),
    ("override_wrong_bool", [TINY, "--workdir={W}", "--config.train.transfer_guard=maybe"],
     ["--config.train.transfer_guard=maybe", "is a bool", "give true or false"]),
    ("override_unknown_field", [TINY, "--workdir={W}", "--config.train.nosuch=1"],
     ["--config.train.nosuch", "config.train has no field 'nosuch'", "known: checkpoint_every"]),
    ("override_misspelled_field", [TINY, "--workdir={W}", "--config.train.step=4"],
     ["--config.train.step", "no field 'step'", "did you mean --config.train.steps?"]),
    ("override_before_config", ["--config.train.steps=4", TINY, "--workdir={W}"],
     ["--config.train.steps=4 comes before --config",
      "give --config=experiments/lm.py:tiny first"]),
    ("flag_unknown", [TINY, "--workdr={W}"],
     ["unknown flag --workdr", "did you mean --workdir?"]),
    ("argument_unexpected", [TINY, "--workdir={W}", "extra"],
     ["unexpected arguments 'extra'", "--name=value"]),
    ("workdir_missing", [TINY],
     ["--workdir is required", "e.g. --workdir="]),
    ("workdir_under_a_file", [TINY, "--workdir={W}/metrics.jsonl/sub"],
     ["--workdir=", "metrics.jsonl/sub", "cannot be created", "choose a writable directory"]),
    ("workdir_other_object_store", [TINY, "--workdir=s3://bucket/lm"],
     ["--workdir=s3://bucket/lm", "s3:// is not supported", "gs://bucket/path"]),
    ("plan_missing", [TINY, "--workdir={W}", "--plan={W}/nosuch.json"],
     ["--plan=", "nosuch.json: no such file", "python -m toolkit.compile"]),
    ("plan_and_flag_set_one_field",
     [TINY, "--workdir={W}", "--config.mesh.ici=fsdp:8", f"--plan={PLAN}"],
     ["--config.mesh.ici and --plan=", "both set mesh.ici", "drop the flag"]),
    ("plan_for_another_experiment",
     [TINY, "--workdir={W}", f"--plan={PLAN.parent / 'plan_for_moe.json'}"],
     ["plan_for_moe.json was made for --config=experiments/moe.py:size=8x7b, not "
      "experiments/lm.py:tiny", "python -m toolkit.compile --config=experiments/lm.py:tiny"]),
    ("mesh_does_not_divide_devices", [TINY, "--workdir={W}", "--config.mesh.ici=fsdp:3"],
     ["mesh.ici", "fsdp:3", "sizes must multiply to 8"]),
    ("mesh_two_wildcards", [TINY, "--workdir={W}", "--config.mesh.ici=fsdp:-1,tensor:-1"],
     ["mesh.ici", "both -1", "at most one size per tier may be -1"]),
    ("mesh_axis_unknown", [TINY, "--workdir={W}", "--config.mesh.ici=fsdp:4,bogus:2"],
     ["mesh.ici", "unknown mesh axis 'bogus'", "use one of population, data,"]),
    # The tiny mesh (fsdp 4 x tensor 2) splits the batch 4 ways, so 12 would divide; fsdp:8 not.
    ("batch_not_divisible_by_mesh",
     [TINY, "--workdir={W}", "--config.mesh.ici=fsdp:8", "--config.data.global_batch_size=12"],
     ["data.global_batch_size=12", "fsdp=8", "use a multiple of 8"]),
    ("logical_axis_unknown",
     [TINY, "--workdir={W}", "--config.sharding.param_overrides=nosuch=fsdp"],
     ["sharding.param_overrides", "unknown logical axis 'nosuch'", "known: batch"]),
    ("rules_preset_unknown", [TINY, "--workdir={W}", "--config.sharding.preset=nosuch"],
     ["sharding.preset='nosuch'", "choose one of dp, fsdp"]),
    ("kv_heads_do_not_divide_heads", [TINY, "--workdir={W}", "--config.model.n_kv_heads=3"],
     ["model.n_heads=4", "model.n_kv_heads=3", "heads = k * kv_heads"]),
    # Kernels that once failed in the first step, after the workdir was written: {W}/new must
    # not appear.
    ("attention_splash_lengths", [TINY, "--workdir={W}/new", "--config.model.attention=splash"],
     ["model.attention='splash' needs sequence lengths that are multiples of 128",
      "not data.seq_len=32", "use model.attention=auto, or data.seq_len=128"]),
    ("attention_cudnn_without_a_gpu",
     [TINY, "--workdir={W}/new", "--config.model.attention=cudnn"],
     ["model.attention='cudnn'", "needs an NVIDIA GPU", "devices are CPUs",
      "use model.attention=auto"]),
    ("microbatches_do_not_divide_batch", [TINY, "--workdir={W}", "--config.train.microbatches=3"],
     ["train.microbatches=3", "data.global_batch_size=16", "pick a micro-batch count"]),
    ("learning_rate_negative", [TINY, "--workdir={W}", "--config.optimizer.learning_rate=-0.1"],
     ["optimizer.learning_rate=-0.1", "must be a finite number >= 0",
      "give e.g. --config.optimizer.learning_rate="]),
    # Values that once trained silently (clip_norm -1 reversed the update) or crashed (seed).
    ("clip_norm_negative", [TINY, "--workdir={W}", "--config.optimizer.clip_norm=-1"],
     ["optimizer.clip_norm=-1.0 must be a finite number >= 0", "0 turns it off",
      "give e.g. --config.optimizer.clip_norm=1.0"]),
    ("beta_above_one", [TINY, "--workdir={W}", "--config.optimizer.b1=1.5"],
     ["optimizer.b1=1.5 must be a finite number in [0, 1)", "first-moment decay"]),
    ("seed_beyond_64_bits", [TINY, "--workdir={W}", f"--config.seed={2**70}"],
     [f"seed={2**70} must be an integer in [0, 2**31 - 1]", "give e.g. --config.seed=0"]),
    ("data_source_unknown", [TINY, "--workdir={W}", "--config.data.source=nosuch"],
     ["data.source='nosuch'", "choose one of stdlib_docs, synthetic"]),
    ("resume_from_missing", [TINY, "--workdir={W}", "--config.train.resume_from={W}/nosuch"],
     ["train.resume_from=", "is not a directory", "give a workdir"]),
    ("moe_top_k_above_experts",
     [MOE, "--workdir={W}", "--config.model.experts_per_token=9"],
     ["model.experts_per_token=9", "model.n_experts=8", "between 1 and"]),
    ("moe_experts_not_divisible_by_expert_axis",
     [MOE, "--workdir={W}", "--config.model.n_experts=6"],
     ["model.n_experts=6", "expert=4", "use a multiple of 4 experts"]),
    ("moe_dispatch_unknown", [MOE, "--workdir={W}", "--config.model.moe_dispatch=nosuch"],
     ["model.moe_dispatch='nosuch'", "'dropless' or 'capacity'"]),
    ("checkpoint_of_another_model", [TINY, "--workdir={W}", "--config.model.d_model=64"],
     ["holds a different model", "model.d_model=32 there, 64 here",
      "use a fresh --workdir or --config.model.d_model=32"]),
]


_MISTAKE_TEST = "test_mistake_is_one_line_and_leaves_the_workdir_untouched"
# Mistakes checked in a new interpreter, as a shell sees them: one caught while reading the
# flags, one in the experiment file, one needing the devices, one needing the checkpoint.
FRESH = ("flag_unknown", "experiment_file_missing", "mesh_does_not_divide_devices",
         "checkpoint_of_another_model")


@pytest.fixture(scope="module")
def mistake_runs(request, trained, tmp_path_factory) -> dict[str, tuple]:
  """Runs the selected MISTAKES, a few at a time: each is a short process that spends its
  time importing JAX, so running them side by side keeps this file's runtime small. Each gets
  its own copy of the trained workdir. name -> (workdir, snapshot before, result)."""
  selected = {item.callspec.id for item in request.session.items
              if getattr(item, "originalname", None) == _MISTAKE_TEST
              and hasattr(item, "callspec")}
  cases = {}
  for name, args, _ in MISTAKES:
    if name in selected:
      workdir = tmp_path_factory.mktemp(name) / "w"
      shutil.copytree(trained[0], workdir, copy_function=shutil.copy2)
      cases[name] = (workdir, [a.replace("{W}", str(workdir)) for a in args])

  def run_one(name: str) -> tuple[str, tuple]:
    workdir, args = cases[name]
    before = snapshot(workdir)
    return name, (workdir, before, train(*args, timeout=MISTAKE_TIMEOUT_S,
                                          fresh=name in FRESH))

  return side_by_side(run_one, cases)


def side_by_side(run_one, cases) -> dict:
  """`run_one(case) -> (name, outcome)` for every case, four at a time (each case a short
  process that mostly imports JAX); name -> outcome."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
    return dict(pool.map(run_one, cases))


@pytest.mark.parametrize("name, fragments", [(m[0], m[2]) for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_mistake_is_one_line_and_leaves_the_workdir_untouched(mistake_runs, name, fragments):
  workdir, before, result = mistake_runs[name]
  print(refused(result, fragments, workdir, before))  # shown with -rA: the lines users see


def test_non_finite_loss_stops_naming_the_step_and_saves_nothing_from_then_on(workdir_copy):
  workdir = workdir_copy
  # Resumes the copy at step 10 with an absurd learning rate: the loss blows up a step or two
  # later. Checkpoints 5 and 10 must stay as they were, and none may appear at or after the
  # failing step (checkpoint_every=5 would otherwise save step 15).
  before = snapshot(workdir / "checkpoints")
  result = train(TINY, f"--workdir={workdir}", "--config.train.steps=20",
                 "--config.optimizer.learning_rate=1e30")
  assert "restored step 10" in result.stdout
  line = the_error_line(result)
  failing = re.search(r"(?:loss|grad_norm) is (nan|inf|-inf) at step (\d+)", line)
  assert failing, line
  assert "optimizer.learning_rate" in line and "Lower" in line
  assert 10 < int(failing.group(2)) <= 20
  assert checkpoint_steps(workdir) == {5, 10}
  assert snapshot(workdir / "checkpoints") == before
  print(line)


@pytest.mark.parametrize("script,flag", [("meshkit-train", "--workdir"),
                                         ("meshkit-generate", "--prompts_file")])
def test_console_scripts_help_lists_the_commands_flags(script, flag):
  launcher = pathlib.Path(sys.executable).parent / script
  if not launcher.exists():
    pytest.skip(f"{launcher} is not installed (pip install -e .)")
  done = subprocess.run([str(launcher), "--help"], cwd=REPO, env=_env(), capture_output=True,
                        text=True, timeout=MISTAKE_TIMEOUT_S)
  assert f"USAGE: {script} [flags]" in done.stdout and flag in done.stdout, done.stdout


def test_the_slurm_scripts_gpu_setting_without_a_gpu_is_one_error_line(tmp_path):
  """docs/gpu.md: scripts/launch/slurm_job.py exports JAX_PLATFORMS=cuda,cpu, under which JAX skips a
  missing CUDA plugin and runs on the CPU; a GPU job without the plugin is one error line before
  anything runs, its workdir never made."""
  setting = re.search(r'"export JAX_PLATFORMS=(\S+)"',
                      (REPO / "scripts" / "launch" / "slurm_job.py").read_text()).group(1)
  assert "cuda" in setting.split(",")
  before = snapshot(tmp_path)
  result = preloaded.run("toolkit.train", [TINY, f"--workdir={tmp_path / 'run'}"],
                         env=_env() | {"JAX_PLATFORMS": setting}, timeout=MISTAKE_TIMEOUT_S,
                         fresh=True)
  refused(result, [f"JAX_PLATFORMS={setting!r} asks for GPU devices", "CUDA plugin",
                   "pip install 'jax[cuda12]'"], tmp_path, before)
  assert result.stdout == "", result.stdout  # nothing before it: not even the overlap flags
