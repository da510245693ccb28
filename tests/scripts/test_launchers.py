"""The TPU table (toolkit/accelerators.py) and the launchers in scripts/ (tpu_pod, gke_jobset,
slurm_job): what they print in --dry-run, that a real run issues exactly those commands (to
recording stand-ins for gcloud, kubectl, sbatch and srun on an otherwise empty PATH), that
arguments survive shell quoting, and that every mistake is one error line.

Nothing here reaches a cloud: dry runs call nothing, and the other runs find only the
stand-ins on PATH.
"""
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import time

import pytest

from tests import extras
from toolkit import accelerators
from toolkit.planning import target

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "launch"
# Quotes of both kinds, spaces, $, backquotes, a backslash, a newline: any shell would mangle it.
TRICKY = "--config.train.sample_prompt=it's a \"quoted\" $HOME `date` \\ two\nlines"
ENV_VALUE = "--xla_flag=1 'single' \"double\" $PATH"


def launch(script: str, *args: str, path: str | None = None, stdin: str | None = None,
           env: dict | None = None) -> subprocess.CompletedProcess:
  """Runs scripts/<script> with `args`; PATH is `path` (default: a directory that does not
  exist, so no real gcloud, kubectl or sbatch can be found)."""
  environment = {**os.environ, "PATH": path or str(REPO / "scripts" / "__no_such_dir__"),
                 **(env or {})}
  # No inherited stdin: a recording stand-in reads its stdin to the end.
  stdin_args = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
  return subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=REPO,
                        env=environment, capture_output=True, text=True, timeout=60,
                        **stdin_args)


def ok(proc: subprocess.CompletedProcess) -> str:
  assert proc.returncode == 0, proc.stderr
  assert "Traceback" not in proc.stderr
  return proc.stdout


def one_error_line(proc: subprocess.CompletedProcess, exit_code: int = 2) -> str:
  assert proc.returncode == exit_code, (proc.returncode, proc.stdout, proc.stderr)
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  assert proc.stdout == ""
  return lines[0]


@pytest.fixture
def recorder(tmp_path):
  """make(name, dir) puts an executable `name` in `dir` that records argv, cwd, stdin and a
  few environment variables as one JSON file per call in tmp_path/calls; calls() reads them.
  It exits 3 when an argument equals $RECORDER_FAIL_ON, else sleeps $RECORDER_SLEEP seconds."""
  calls = tmp_path / "calls"
  calls.mkdir()

  def make(name: str, directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / name
    program.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys, time, uuid\n"
        "stdin = '' if sys.stdin.isatty() else sys.stdin.read()\n"
        "record = dict(name=os.path.basename(sys.argv[0]), argv=sys.argv[1:], cwd=os.getcwd(),\n"
        "              stdin=stdin, env={k: os.environ.get(k) for k in\n"
        "                               ('MESHKIT_TEST', 'JAX_LOCAL_DEVICE_IDS', 'XLA_FLAGS',\n"
        "                                'XLA_CLIENT_MEM_FRACTION', 'NCCL_DEBUG', 'JAX_PLATFORMS',\n"
        "                                'XLA_PYTHON_CLIENT_MEM_FRACTION')})\n"
        f"open(os.path.join({str(calls)!r}, f'{{time.time_ns()}}-{{uuid.uuid4().hex}}.json'), 'w')"
        ".write(json.dumps(record))\n"
        "if os.environ.get('RECORDER_FAIL_ON') in sys.argv[1:]:\n"
        "  sys.exit(3)\n"
        "time.sleep(float(os.environ.get('RECORDER_SLEEP', '0')))\n")
    program.chmod(0o755)
    return program

  def read() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(calls.iterdir())]

  make.calls = read
  return make


def shell_lines(text: str) -> list[str]:
  """The logical lines of a shell script: a quoted argument may hold a newline."""
  lines, buffer = [], None
  for line in text.splitlines():
    if buffer is None and line.startswith("#"):
      lines.append(line)
      continue
    buffer = line if buffer is None else f"{buffer}\n{line}"
    try:
      shlex.split(buffer, comments=False)
    except ValueError:  # "No closing quotation": the argument goes on
      continue
    lines.append(buffer)
    buffer = None
  assert buffer is None, f"unterminated quote in {text!r}"
  return lines


def commands(stdout: str) -> list[list[str]]:
  """The argv of each printed command (comments and `wait` skipped, `&` stripped)."""
  return [shlex.split(line.removesuffix(" &")) for line in shell_lines(stdout)
          if line and not line.startswith("#") and line != "wait"]


def flag(argv: list[str], name: str) -> str:
  values = [a.split("=", 1)[1] for a in argv if a.startswith(f"{name}=")]
  assert len(values) == 1, (name, argv)
  return values[0]


def load_script(name: str):
  spec = importlib.util.spec_from_file_location(f"_launcher_{name}", SCRIPTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# --- toolkit/accelerators.py ----------------------------------------------------------------------

@pytest.mark.parametrize("name,chips,hosts,chips_per_host,grid", [
    ("v4-8", 4, 1, 4, "2x2x1"),
    ("v4-16", 8, 2, 4, "2x2x2"),
    ("v4-32", 16, 4, 4, "2x2x4"),
    ("v4-128", 64, 16, 4, "4x4x4"),
    ("v4-4096", 2048, 512, 4, "8x16x16"),
    ("v5litepod-1", 1, 1, 1, "1x1"),
    ("v5litepod-4", 4, 1, 4, "2x2"),
    ("v5litepod-8", 8, 1, 8, "2x4"),
    ("v5litepod-16", 16, 2, 8, "4x4"),
    ("v5e-256", 256, 32, 8, "16x16"),
    ("v5p-8", 4, 1, 4, "2x2x1"),
    ("v5p-128", 64, 16, 4, "4x4x4"),
    ("v5p-1024", 512, 128, 4, "8x8x8"),
    ("v6e-1", 1, 1, 1, "1x1"),
    ("v6e-8", 8, 1, 8, "2x4"),
    ("v6e-16", 16, 2, 8, "4x4"),
    ("v6e-256", 256, 32, 8, "16x16"),
])
def test_chips_hosts_topology(name, chips, hosts, chips_per_host, grid):
  t = accelerators.accelerator(name)
  assert (t.chips, t.hosts, t.chips_per_host, t.topology) == (chips, hosts, chips_per_host, grid)


def test_table_is_consistent():
  assert len(accelerators.TPU_TYPES) >= 35
  for name, t in accelerators.TPU_TYPES.items():
    gen = accelerators.GENERATIONS[t.generation]
    assert name == t.name and accelerators.accelerator(name) is t
    dims = t.topology_dims
    assert len(dims) == gen.torus_dims
    assert dims == tuple(sorted(dims)) or dims == (2, 2, 1)  # larger sides last
    product = 1
    for d in dims:
      product *= d
    assert product == t.chips == t.hosts * t.chips_per_host == t.gke_nodes * t.gke_chips_per_node
    assert int(name.rsplit("-", 1)[1]) == t.tensorcores == t.chips * gen.tensorcores_per_chip
    assert t.libtpu_topology_name == f"{gen.libtpu_name}:{t.topology}"
    assert t.hbm_bytes == t.chips * t.hbm_bytes_per_chip


def test_memory_flops_bandwidth_and_software():
  gib = 2**30
  expected = {  # generation: HBM/chip, bf16 FLOP/s/chip, runtime version, GKE label
      "v4-8": (32 * gib, 275e12, "tpu-ubuntu2204-base", "tpu-v4-podslice"),
      "v5litepod-16": (16 * gib, 197e12, "tpu-ubuntu2204-base", "tpu-v5-lite-podslice"),
      "v5p-128": (95 * gib, 459e12, "tpu-ubuntu2204-base", "tpu-v5p-slice"),
      "v6e-256": (32 * gib, 918e12, "v2-alpha-tpuv6e", "tpu-v6e-slice"),
  }
  for name, (hbm, flops, version, label) in expected.items():
    t = accelerators.accelerator(name)
    assert (t.hbm_bytes_per_chip, t.peak_bf16_flops_per_chip, t.runtime_version,
            t.gke_accelerator) == (hbm, flops, version, label)
    assert 1e9 < t.dcn_bytes_per_second_per_chip < t.ici_bytes_per_second_per_chip < 2e12
  assert accelerators.accelerator("v5litepod-16").hbm_bytes == 256 * gib
  assert accelerators.accelerator("v6e-256").peak_bf16_flops == pytest.approx(235e15, rel=0.01)


def test_peak_flops_by_device_kind():
  for gen in accelerators.GENERATIONS.values():
    assert accelerators.peak_flops_per_chip(gen.device_kind) == gen.peak_bf16_flops_per_chip
  assert accelerators.peak_flops_per_chip("NVIDIA H100 80GB HBM3") == 989e12
  assert accelerators.peak_flops_per_chip("cpu") == 0.0  # unknown: MFU needs a configured peak


def test_aliases_and_spelling():
  assert accelerators.accelerator("v5e-16") is accelerators.accelerator("v5litepod-16")
  assert accelerators.accelerator(" V4-32 ") is accelerators.TPU_TYPES["v4-32"]


def test_ahead_of_time_compile_arguments():
  assert accelerators.accelerator("v5e-16").topology_desc_kwargs() == dict(
      platform="tpu", topology_name="v5e:4x4", chip_config_name="default",
      chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
  v5p = accelerators.accelerator("v5p-128").topology_desc_kwargs(num_slices=2)
  assert (v5p["topology_name"], v5p["chip_config_name"], v5p["wrap"], v5p["num_slices"]) == (
      "v5:4x4x4", "megacore", (True, True, True), 2)
  assert accelerators.accelerator("v4-64").wrap == (False, False, False)  # 2x4x4: no full torus
  assert accelerators.accelerator("v5litepod-256").wrap == (True, True, False)
  assert accelerators.accelerator("v6e-1").chips_per_host_bounds == (1, 1, 1)


@pytest.mark.tpu_aot
@pytest.mark.parametrize("name", ["v5litepod-16", "v4-16", "v5p-16", "v6e-16"])
def test_libtpu_accepts_the_compile_arguments(name):
  extras.require("libtpu")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # As toolkit.compile does: without it libtpu takes /tmp/libtpu_lockfile, and fails while
  # any other process on the machine (another test run) holds it.
  target.prepare_libtpu_environment()
  t = accelerators.accelerator(name)
  assert len(topologies.get_topology_desc(**t.topology_desc_kwargs()).devices) == t.chips


@pytest.mark.parametrize("name,mentions", [
    ("v5litepod-12", ["'v5litepod-12'", "1, 4, 8, 16, 32, 64, 128, 256"]),
    ("v4-4", ["'v4-4'", "counts TensorCores", "v4-8"]),
    ("v7-8", ["'v7-8'", "did you mean", "v4-8", "v5p-N", "v6e-N", "v5e-N"]),
    ("", ["''", "known:"]),
    ("v5p", ["'v5p'", "known:"]),
])
def test_unknown_accelerator_type(name, mentions):
  with pytest.raises(ValueError) as error:
    accelerators.accelerator(name)
  message = str(error.value)
  assert "\n" not in message
  for text in mentions:
    assert text in message


# --- scripts/launch/tpu_pod.py -----------------------------------------------------------------------

POD = ["--name=lm", "--zone=us-west4-a"]


@pytest.mark.parametrize("accelerator,hosts", [
    ("v5litepod-16", 2), ("v4-32", 4), ("v5p-128", 16), ("v6e-256", 32), ("v5e-8", 1)])
def test_tpu_pod_hosts_and_accelerator_flag(accelerator, hosts):
  t = accelerators.accelerator(accelerator)
  out = ok(launch("tpu_pod.py", "create", *POD, f"--accelerator-type={accelerator}",
                  "--dry-run"))
  assert out.splitlines()[0].endswith(f"creates {hosts} host{'s' * (hosts > 1)}")
  [create] = commands(out)
  assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "lm"]
  assert flag(create, "--accelerator-type") == t.name  # v5e-8 is v5litepod-8 to gcloud
  assert flag(create, "--version") == t.runtime_version
  out = ok(launch("tpu_pod.py", "run", *POD, f"--accelerator-type={accelerator}",
                  "--config=experiments/lm.py:tiny", "--workdir=/mnt/gcs/runs/lm", "--dry-run"))
  assert f"reaches {hosts} host" in out.splitlines()[0]


def test_tpu_pod_run_quotes_arguments_and_environment(tmp_path, recorder):
  out = ok(launch("tpu_pod.py", "run", *POD, "--accelerator-type=v5litepod-16",
                  "--config=experiments/lm.py:size=1b", "--workdir=/mnt/gcs/runs/lm",
                  f"--env=XLA_FLAGS={ENV_VALUE}", "--env=MESHKIT_TEST=a b", "--dry-run",
                  "--", TRICKY, "--config.train.steps=3"))
  [ssh] = commands(out)
  assert ssh[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "lm", "--worker=all"]
  assert flag(ssh, "--zone") == "us-west4-a"
  remote = flag(ssh, "--command")
  expected = [".venv/bin/python", "-m", "toolkit.train", "--config=experiments/lm.py:size=1b",
              "--workdir=/mnt/gcs/runs/lm", TRICKY, "--config.train.steps=3"]
  words = shlex.split(remote)
  assert words[:3] == ["cd", "meshkit", "&&"]
  assert words[3:5] == [f"XLA_FLAGS={ENV_VALUE}", "MESHKIT_TEST=a b"] and words[5:] == expected
  # What a host's bash makes of it: a stand-in .venv/bin/python records argv and environment.
  recorder("python", tmp_path / "home" / "meshkit" / ".venv" / "bin")
  subprocess.run(["bash", "-c", remote], cwd=tmp_path / "home", check=True, timeout=30,
                 stdin=subprocess.DEVNULL)
  [call] = recorder.calls()
  assert call["argv"] == expected[1:]
  assert call["env"]["XLA_FLAGS"] == ENV_VALUE and call["env"]["MESHKIT_TEST"] == "a b"


def test_tpu_pod_multislice_queued_resource(tmp_path, recorder):
  flags = [*POD, "--accelerator-type=v4-32", "--slices=3"]
  out = ok(launch("tpu_pod.py", "create", *flags, "--spot", "--dry-run"))
  assert out.splitlines()[0].endswith("creates 12 hosts")
  [create] = commands(out)
  assert create[3:6] == ["queued-resources", "create", "lm"]
  assert (flag(create, "--node-count"), flag(create, "--node-prefix")) == ("3", "lm")
  assert flag(create, "--runtime-version") == "tpu-ubuntu2204-base" and "--spot" in create
  assert flag(create, "--accelerator-type") == "v4-32"

  run_flags = [*flags, "--config=experiments/lm.py:tiny", "--workdir=/mnt/gcs/lm", "--", TRICKY]
  out = ok(launch("tpu_pod.py", "run", *run_flags[:-2], "--dry-run", *run_flags[-2:]))
  lines = shell_lines(out)
  assert lines[0].endswith("reaches 12 hosts") and lines[-1] == "wait"
  assert all(line.endswith(" &") for line in lines[1:-1])
  ssh = commands(out)
  assert [c[5] for c in ssh] == ["lm-0", "lm-1", "lm-2"]
  assert all("--worker=all" in c and TRICKY in shlex.split(flag(c, "--command")) for c in ssh)

  out = ok(launch("tpu_pod.py", "delete", *POD, "--slices=3", "--dry-run"))
  [delete] = commands(out)
  assert delete[3:6] == ["queued-resources", "delete", "lm"] and "--force" in delete

  # A real run issues exactly the printed commands, the three slices at once.
  bin_dir = tmp_path / "bin"
  recorder("gcloud", bin_dir)
  ok(launch("tpu_pod.py", "run", *run_flags[:-2], *run_flags[-2:], path=str(bin_dir)))
  assert sorted(c["argv"] for c in recorder.calls()) == sorted(c[1:] for c in ssh)


def test_tpu_pod_stops_the_other_slices_when_one_fails(tmp_path, recorder):
  recorder("gcloud", tmp_path / "bin")
  started = time.monotonic()
  proc = launch("tpu_pod.py", "run", *POD, "--accelerator-type=v4-16", "--slices=3",
                "--config=c", "--workdir=/mnt/gcs/w", path=str(tmp_path / "bin"),
                env={"RECORDER_FAIL_ON": "lm-1", "RECORDER_SLEEP": "60"})
  assert time.monotonic() - started < 30  # the sleeping slices were terminated
  assert proc.returncode == 1 and len(recorder.calls()) == 3
  [line] = [line for line in proc.stderr.splitlines() if not line.startswith("note:")]
  assert line.startswith("error: exit code 3 from: gcloud compute tpus tpu-vm ssh lm-1 ")


def test_tpu_pod_queued_single_slice_and_project():
  out = ok(launch("tpu_pod.py", "create", *POD, "--accelerator-type=v6e-16", "--queued",
                  "--project=my-proj", "--dry-run"))
  [create] = commands(out)
  assert create[3:5] == ["queued-resources", "create"]
  assert flag(create, "--node-id") == "lm" and not any(a.startswith("--node-count") for a in create)
  assert flag(create, "--runtime-version") == "v2-alpha-tpuv6e"
  assert flag(create, "--project") == "my-proj"


def test_tpu_pod_setup_copies_the_working_tree(tmp_path):
  out = ok(launch("tpu_pod.py", "setup", "--name=pytest-setup", "--zone=z",
                  "--accelerator-type=v5p-16", "--dry-run"))
  lines = [line for line in shell_lines(out) if not line.startswith("#")]
  pack, scp, ssh = lines[0], shlex.split(lines[1]), shlex.split(lines[2])
  assert scp[3:5] == ["tpu-vm", "scp"] and "--worker=all" in scp
  assert scp[5] == "/tmp/meshkit-pytest-setup.tgz" and scp[6] == "pytest-setup:/tmp/meshkit-src.tgz"
  assert ssh[3:5] == ["tpu-vm", "ssh"] and "--worker=all" in ssh
  remote = flag(ssh, "--command")
  assert "tar -xzf /tmp/meshkit-src.tgz -C meshkit" in remote
  assert "venv --python=3.11 .venv" in remote and ".[tpu]" in shlex.split(remote)
  # The packing pipeline, run for real: the git-visible tree, without ignored files.
  archive = pathlib.Path("/tmp/meshkit-pytest-setup.tgz")
  try:
    subprocess.run(["bash", "-o", "pipefail", "-c", pack], check=True, timeout=60,
                   capture_output=True)
    with tarfile.open(archive) as tar:
      names = set(tar.getnames())
  finally:
    archive.unlink(missing_ok=True)
  assert {"pyproject.toml", "toolkit/accelerators.py", "scripts/launch/tpu_pod.py"} <= names
  assert not any(n.startswith((".venv/", ".git/")) or "__pycache__" in n for n in names)


def test_tpu_pod_setup_clone_mode():
  out = ok(launch("tpu_pod.py", "setup", *POD, "--accelerator-type=v4-8",
                  "--repo-url=https://example.com/meshkit.git", "--ref=v1 beta", "--dry-run"))
  [ssh] = commands(out)
  remote = shlex.split(flag(ssh, "--command"))
  assert "https://example.com/meshkit.git" in remote and "v1 beta" in remote


def test_tpu_pod_real_run_issues_the_printed_commands(tmp_path, recorder):
  bin_dir = tmp_path / "bin"
  recorder("gcloud", bin_dir)
  for command in (["create", "--accelerator-type=v5litepod-16", "--spot"],
                  ["delete"]):
    printed = commands(ok(launch("tpu_pod.py", command[0], *POD, *command[1:], "--dry-run")))
    before = len(recorder.calls())
    out = ok(launch("tpu_pod.py", command[0], *POD, *command[1:], path=str(bin_dir)))
    assert out.startswith("# ")
    assert [c["argv"] for c in recorder.calls()[before:]] == [c[1:] for c in printed]


@pytest.mark.parametrize("args,mentions", [
    (["create", *POD, "--accelerator-type=v5litepod-12"], ["'v5litepod-12'", "1, 4, 8"]),
    (["run", *POD, "--accelerator-type=tpu-v9", "--config=c", "--workdir=w"], ["'tpu-v9'"]),
    (["create", *POD], ["--accelerator-type"]),
    (["create", "--name=Bad_Name", "--zone=z", "--accelerator-type=v4-8"], ["Bad_Name"]),
    (["run", *POD, "--accelerator-type=v4-8", "--workdir=w"], ["--config"]),
    (["run", *POD, "--accelerator-type=v4-8", "--config=c", "--workdir=w", "--env=1A=b"],
     ["1A=b"]),
    (["create", *POD, "--accelerator-type=v4-8", "--slices=0"], ["'0'"]),
    (["create", *POD, "--accelerator-type=v4-8", "--", "--config.x=1"], ["for `run` only"]),
    (["launch", *POD], ["launch"]),
    ([], ["COMMAND"]),
])
def test_tpu_pod_mistakes_are_one_line(args, mentions):
  line = one_error_line(launch("tpu_pod.py", *args, "--dry-run"))
  for text in mentions:
    assert text in line


def test_tpu_pod_without_gcloud_fails_in_one_line():
  line = one_error_line(launch("tpu_pod.py", "delete", *POD), exit_code=1)
  assert "gcloud is not on PATH" in line


def test_tpu_pod_reminds_that_several_hosts_share_the_workdir():
  proc = launch("tpu_pod.py", "run", *POD, "--accelerator-type=v4-16", "--config=c",
                "--workdir=runs/lm", "--dry-run")
  ok(proc)
  assert "note:" in proc.stderr and "all 2 hosts" in proc.stderr and "gs://" in proc.stderr
  proc = launch("tpu_pod.py", "run", *POD, "--accelerator-type=v4-16", "--config=c",
                "--workdir=gs://bucket/lm", "--dry-run")
  assert "note:" not in ok(proc) + proc.stderr  # a bucket is shared by every host


# --- scripts/launch/gke_jobset.py --------------------------------------------------------------------

GKE = ["--name=lm", "--image=us-docker.pkg.dev/p/r/meshkit:1", "--config=experiments/lm.py:size=1b",
       "--workdir=/mnt/gcs/runs/lm"]


def manifest(out: str) -> dict:
  yaml = pytest.importorskip("yaml")  # PyYAML: a dependency of flax, orbax and ml_collections
  return yaml.safe_load(out)


@pytest.mark.parametrize("accelerator,slices,pods_per_slice,chips_per_pod,grid,label", [
    ("v5litepod-16", 1, 4, 4, "4x4", "tpu-v5-lite-podslice"),
    ("v5e-1", 1, 1, 1, "1x1", "tpu-v5-lite-podslice"),
    ("v4-32", 2, 4, 4, "2x2x4", "tpu-v4-podslice"),
    ("v5p-128", 1, 16, 4, "4x4x4", "tpu-v5p-slice"),
    ("v6e-256", 4, 64, 4, "16x16", "tpu-v6e-slice"),
])
def test_jobset_shape(accelerator, slices, pods_per_slice, chips_per_pod, grid, label):
  out = ok(launch("gke_jobset.py", *GKE, f"--accelerator-type={accelerator}",
                  f"--slices={slices}", "--env=MESHKIT_TEST=a b", "--dry-run", "--", TRICKY))
  js = manifest(out)
  assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  assert js["metadata"]["annotations"] == {
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "lm"}
  [replicated] = js["spec"]["replicatedJobs"]
  assert replicated["replicas"] == slices
  job = replicated["template"]["spec"]
  assert job["parallelism"] == job["completions"] == pods_per_slice
  assert (job["backoffLimit"], job["completionMode"]) == (0, "Indexed")
  # A failed pod restarts the whole JobSet up to 3 times, but a command-line mistake (exit 2
  # of the train container) fails the Job by its podFailurePolicy, and that reason the JobSet.
  assert js["spec"]["failurePolicy"] == {"maxRestarts": 3, "rules": [{
      "name": "mistakeIsNotRestarted", "action": "FailJobSet",
      "onJobFailureReasons": ["PodFailurePolicy"]}]}
  assert job["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onExitCodes": {
      "containerName": "train", "operator": "In", "values": [2]}}]}
  pod = job["template"]["spec"]
  assert [c["name"] for c in pod["containers"]] == ["train"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": label,
                                 "cloud.google.com/gke-tpu-topology": grid}
  assert pod["hostNetwork"] is True and pod["restartPolicy"] == "Never"
  [container] = pod["containers"]
  assert container["resources"]["limits"] == {"google.com/tpu": chips_per_pod}
  assert container["command"] == ["python", "-m", "toolkit.train",
                                  "--config=experiments/lm.py:size=1b",
                                  "--workdir=/mnt/gcs/runs/lm", TRICKY]
  env = {e["name"]: e for e in container["env"]}
  assert env["MESHKIT_TEST"]["value"] == "a b"
  if slices > 1:
    assert env["MEGASCALE_NUM_SLICES"]["value"] == str(slices)
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "lm-slice-0-0.lm"
    assert "job-index" in env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
  else:
    assert not any(name.startswith("MEGASCALE") for name in env)
  assert f"{slices * pods_per_slice} pod" in out.splitlines()[0]


def test_jobset_single_host_eight_chips():
  js = manifest(ok(launch("gke_jobset.py", *GKE, "--accelerator-type=v6e-8", "--single-host")))
  job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == 1
  assert job["template"]["spec"]["containers"][0]["resources"]["limits"] == {"google.com/tpu": 8}


def test_jobset_output_file_and_apply(tmp_path, recorder):
  printed = ok(launch("gke_jobset.py", *GKE, "--accelerator-type=v5p-16", "--dry-run"))
  target = tmp_path / "lm.yaml"
  assert ok(launch("gke_jobset.py", *GKE, "--accelerator-type=v5p-16",
                   f"--output={target}")) == ""
  assert target.read_text() == printed
  bin_dir = tmp_path / "bin"
  recorder("kubectl", bin_dir)
  ok(launch("gke_jobset.py", *GKE, "--accelerator-type=v5p-16", "--apply", path=str(bin_dir)))
  [call] = recorder.calls()
  assert call["argv"] == ["apply", "-f", "-"] and call["stdin"] == printed


def test_yaml_writer_round_trips_awkward_strings():
  yaml = pytest.importorskip("yaml")
  gke_jobset = load_script("gke_jobset")
  value = {"a": ["true", "null", "2x2", "", "a: b", "# no", "- x", "multi\nline", TRICKY, 0,
                 False, "007", "1e3", "~", "'", "\\"],
           "nested": [{"k": {}, "l": []}, [1, [2]]], "weird key: x": "v", "plain/key.x-y": 1,
           "on": "yes", "No": True}
  assert yaml.safe_load(gke_jobset.to_yaml(value)) == value


@pytest.mark.parametrize("args,mentions", [
    (["--accelerator-type=v5litepod-12"], ["'v5litepod-12'"]),
    (["--accelerator-type=v5litepod-4", "--slices=2"], ["multi-host", "v5litepod-4"]),
    (["--accelerator-type=v5p-16", "--single-host"], ["--single-host", "v5p-16"]),
    (["--accelerator-type=v4-8", "--name=LM"], ["'LM'"]),
    (["--accelerator-type=v4-8", "--apply", "--dry-run"], ["--apply"]),
])
def test_jobset_mistakes_are_one_line(args, mentions):
  line = one_error_line(launch("gke_jobset.py", *GKE, *args))
  for text in mentions:
    assert text in line


# --- scripts/launch/slurm_job.py ---------------------------------------------------------------------

SLURM = ["--config=experiments/lm.py:size=1b", "--workdir=/shared/runs/lm"]


def sbatch_lines(script: str) -> list[str]:
  lines = script.splitlines()
  first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
  directives = [line for line in lines if line.startswith("#SBATCH ")]
  # sbatch reads directives only above the first command.
  assert all(lines.index(d) < first_command for d in directives)
  return directives


def test_slurm_script_one_task_per_gpu(tmp_path, recorder):
  script = ok(launch("slurm_job.py", "--nodes=2", "--time=1-00:00:00", "--job-name=lm",
                     "--partition=gpu", *SLURM, f"--env=XLA_FLAGS={ENV_VALUE}", "--dry-run",
                     "--", TRICKY))
  assert script.startswith("#!/bin/bash\n")
  assert sbatch_lines(script) == [
      "#SBATCH --job-name=lm", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8",
      "#SBATCH --gpus-per-node=8", "#SBATCH --time=1-00:00:00", "#SBATCH --output=%x-%j.out",
      "#SBATCH --open-mode=append", "#SBATCH --requeue", "#SBATCH --partition=gpu"]
  assert "JAX_LOCAL_DEVICE_IDS" not in script and "gpus-per-task" not in script.replace(
      "no --gpus-per-task", "")
  [srun] = [shlex.split(line) for line in shell_lines(script) if line.strip().startswith("srun ")]
  assert srun == ["srun", "--kill-on-bad-exit=1", ".venv/bin/python", "-m", "toolkit.train",
                  "--config=experiments/lm.py:size=1b", "--workdir=/shared/runs/lm", TRICKY]
  # The script under bash, with a stand-in srun: the directory, environment and arguments.
  subprocess.run(["bash", "-n", "-c", script], check=True, timeout=30)
  recorder("srun", tmp_path / "bin")
  script = script.replace(f"cd {shlex.quote(str(REPO))}", f"cd {shlex.quote(str(tmp_path))}")
  subprocess.run(["bash", "-c", script], check=True, timeout=30, stdin=subprocess.DEVNULL,
                 env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
  [call] = recorder.calls()
  assert call["argv"] == srun[1:] and call["cwd"] == str(tmp_path)
  assert call["env"]["XLA_FLAGS"] == ENV_VALUE


def test_slurm_script_one_task_per_node(tmp_path, recorder):
  script = ok(launch("slurm_job.py", "--nodes=4", "--gpus-per-node=4", "--per-node",
                     "--sbatch=--exclusive", *SLURM, "--dry-run"))
  directives = sbatch_lines(script)
  assert "#SBATCH --ntasks-per-node=1" in directives and "#SBATCH --exclusive" in directives
  assert "#SBATCH --nodes=4" in directives and "#SBATCH --gpus-per-node=4" in directives
  recorder("srun", tmp_path / "bin")
  script = script.replace(f"cd {shlex.quote(str(REPO))}", f"cd {shlex.quote(str(tmp_path))}")
  subprocess.run(["bash", "-c", script], check=True, timeout=30, stdin=subprocess.DEVNULL,
                 env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
  [call] = recorder.calls()
  assert call["env"]["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3"


@pytest.mark.parametrize("statuses,flags,exit_code,restarts", [
    ((1, 75, 0), [], 0, [1, 75]),     # a crash, then a hang (the watchdog's 75): finished
    ((137, 137), ["--max-restarts=1"], 137, [137]),  # killed twice: gives up after 1 restart
    ((2,), [], 2, []),                # a command-line mistake: never restarted
    ((130,), [], 130, []),            # Ctrl-C twice: stopped
])
def test_slurm_restarts_a_failed_run(tmp_path, statuses, flags, exit_code, restarts):
  """The batch script runs srun again after a failure (up to --max-restarts), not after a
  mistake or a stop; a stand-in srun exits with `statuses` in turn."""
  script = ok(launch("slurm_job.py", "--nodes=1", *SLURM, "--restart-delay-s=0", *flags,
                     "--dry-run"))
  (tmp_path / "bin").mkdir()
  srun = tmp_path / "bin" / "srun"
  srun.write_text("#!/bin/bash\necho call >> calls\n"
                  f"statuses=({' '.join(map(str, statuses))})\n"
                  "exit ${statuses[$(( $(wc -l < calls) - 1 ))]}\n")
  srun.chmod(0o755)
  script = script.replace(f"cd {shlex.quote(str(REPO))}", f"cd {shlex.quote(str(tmp_path))}")
  proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                        stdin=subprocess.DEVNULL,
                        env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
  assert proc.returncode == exit_code, proc.stderr
  assert len((tmp_path / "calls").read_text().splitlines()) == len(restarts) + 1
  lines = proc.stderr.splitlines()
  limit = 1 if flags else 3
  assert [l for l in lines if "restart" in l and "giving up" not in l] == [
      f"[slurm_job] restart {i} of {limit} after exit status {status}: resuming from the "
      f"newest checkpoint in 0 s" for i, status in enumerate(restarts, 1)]
  gave_up = [l for l in lines if "giving up" in l]
  assert gave_up == ([f"[slurm_job] exit status {exit_code} after {limit} restart(s): giving "
                      f"up; submit the same script again to resume"]
                     if exit_code not in (0, 2, 130) else [])


def test_slurm_submits_the_printed_script(tmp_path, recorder):
  printed = ok(launch("slurm_job.py", "--nodes=1", *SLURM, "--dry-run"))
  recorder("sbatch", tmp_path / "bin")
  ok(launch("slurm_job.py", "--nodes=1", *SLURM, path=str(tmp_path / "bin")))
  [call] = recorder.calls()
  assert call["argv"] == [] and call["stdin"] == printed


def run_slurm_script(script: str, tmp_path, recorder, env: dict | None = None) -> dict:
  """Runs the batch script under bash with a recording srun, in tmp_path, with `env` as the
  environment sbatch passed on from the submitting shell; the one srun call."""
  recorder("srun", tmp_path / "bin")
  earlier = len(recorder.calls())
  script = script.replace(f"cd {shlex.quote(str(REPO))}", f"cd {shlex.quote(str(tmp_path))}")
  subprocess.run(["bash", "-c", script], check=True, timeout=30, stdin=subprocess.DEVNULL,
                 env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", **(env or {})})
  [call] = recorder.calls()[earlier:]
  return call


def test_slurm_gives_every_task_the_gpu_environment(tmp_path, recorder):
  """The GPUs or JAX's error (never a run on the CPU); JAX's share of GPU memory under its
  current name, the old name (passed on from the submitting shell) unset so that JAX's CUDA
  plugin loads; NCCL quiet unless asked."""
  script = ok(launch("slurm_job.py", "--nodes=2", *SLURM, "--dry-run"))
  assert "export XLA_CLIENT_MEM_FRACTION=0.9" in script.splitlines()
  assert "NCCL_DEBUG" not in script and "XLA_FLAGS" not in script
  call = run_slurm_script(script, tmp_path, recorder,
                          env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "JAX_PLATFORMS": "cpu"})
  assert call["env"]["JAX_PLATFORMS"] == "cuda,cpu"
  assert call["env"]["XLA_CLIENT_MEM_FRACTION"] == "0.9"
  assert call["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] is None
  assert call["env"]["NCCL_DEBUG"] is None


def test_slurm_gpu_environment_flags_and_the_users_env_win(tmp_path, recorder):
  script = ok(launch("slurm_job.py", "--nodes=2", *SLURM, "--mem-fraction=0.8",
                     "--nccl-debug=info", "--dry-run"))
  call = run_slurm_script(script, tmp_path / "flags", recorder)
  assert call["env"]["XLA_CLIENT_MEM_FRACTION"] == "0.8" and call["env"]["NCCL_DEBUG"] == "INFO"
  # An --env of the old name replaces both memory lines (with both names set JAX's CUDA
  # plugin would not load); an --env NCCL_DEBUG replaces the flag's.
  script = ok(launch("slurm_job.py", "--nodes=2", *SLURM, "--nccl-debug=WARN",
                     "--env=XLA_PYTHON_CLIENT_MEM_FRACTION=0.7", "--env=NCCL_DEBUG=TRACE",
                     "--env=JAX_PLATFORMS=cuda", "--dry-run"))
  assert "XLA_CLIENT_MEM_FRACTION" not in script and "unset" not in script
  assert script.count("NCCL_DEBUG") == script.count("JAX_PLATFORMS") == 1
  call = run_slurm_script(script, tmp_path / "env", recorder)
  assert call["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.7"
  assert call["env"]["XLA_CLIENT_MEM_FRACTION"] is None and call["env"]["NCCL_DEBUG"] == "TRACE"
  assert call["env"]["JAX_PLATFORMS"] == "cuda"


def test_slurm_exports_the_gpu_xla_flags_when_there_are_any():
  """GPU_XLA_FLAGS is the place for XLA flags every GPU task gets (empty until chosen)."""
  slurm_job = load_script("slurm_job")
  assert slurm_job.GPU_XLA_FLAGS == ()
  slurm_job.GPU_XLA_FLAGS = ("--xla_a=true", "--xla_b=1")
  args, train_args = slurm_job.parse(["--nodes=1", *SLURM])
  assert "export XLA_FLAGS='--xla_a=true --xla_b=1'" in slurm_job.batch_script(args, train_args)
  args, train_args = slurm_job.parse(["--nodes=1", *SLURM, "--env=XLA_FLAGS=--mine"])
  lines = slurm_job.batch_script(args, train_args).splitlines()
  assert [line for line in lines if "XLA_FLAGS" in line] == ["export XLA_FLAGS=--mine"]


@pytest.mark.parametrize("args,exit_code,mentions", [
    (["--nodes=0", *SLURM, "--dry-run"], 2, ["--nodes", "'0'"]),
    (["--nodes=1", "--time=soon", *SLURM, "--dry-run"], 2, ["'soon'"]),
    (["--nodes=1", "--workdir=w", "--dry-run"], 2, ["--config"]),
    (["--nodes=1", *SLURM, "--env=A", "--dry-run"], 2, ["'A'"]),
    (["--nodes=1", *SLURM, "--mem-fraction=1.5", "--dry-run"], 2, ["--mem-fraction", "'1.5'"]),
    (["--nodes=1", *SLURM, "--mem-fraction=most", "--dry-run"], 2, ["'most'"]),
    (["--nodes=1", *SLURM, "--nccl-debug=LOUD", "--dry-run"], 2, ["--nccl-debug", "'LOUD'"]),
    (["--nodes=1", *SLURM], 1, ["sbatch is not on PATH"]),
])
def test_slurm_mistakes_are_one_line(args, exit_code, mentions):
  line = one_error_line(launch("slurm_job.py", *args), exit_code)
  for text in mentions:
    assert text in line


# --- workdirs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("script,flags", [
    ("tpu_pod.py", ["run", *POD, "--accelerator-type=v4-16", "--config=c"]),
    ("gke_jobset.py", [f for f in GKE if not f.startswith("--workdir")] +
     ["--accelerator-type=v5litepod-16"]),
    ("slurm_job.py", ["--nodes=2", "--config=c"]),
])
def test_launchers_take_gs_workdirs_and_refuse_other_schemes(script, flags):
  out = ok(launch(script, *flags, "--workdir=gs://bucket/lm", "--dry-run"))
  assert "--workdir=gs://bucket/lm" in out
  proc = launch(script, *flags, "--workdir=s3://bucket/lm", "--dry-run")
  assert proc.returncode == 2, proc.stdout + proc.stderr
  [line] = proc.stderr.splitlines()
  assert line.startswith("error: argument --workdir: s3:// is not supported")
  assert "gs://bucket/path" in line


def test_jobset_mounts_a_bucket_for_the_workdir():
  out = ok(launch("gke_jobset.py", *GKE, "--accelerator-type=v5litepod-16",
                  "--gcs-bucket=gs://my-bucket", "--dry-run"))
  template = manifest(out)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
  assert template["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
  [volume] = template["spec"]["volumes"]
  assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
  assert volume["csi"]["volumeAttributes"]["bucketName"] == "my-bucket"
  [container] = template["spec"]["containers"]
  assert container["volumeMounts"] == [{"name": "gcs", "mountPath": "/mnt/gcs"}]
  proc = launch("gke_jobset.py", *[f for f in GKE if not f.startswith("--workdir")],
                "--accelerator-type=v5litepod-16", "--gcs-bucket=my-bucket",
                "--workdir=/data/lm", "--dry-run")
  assert proc.returncode == 2 and "--workdir=/mnt/gcs/runs/lm" in proc.stderr
