"""Cloud TPU VMs for meshkit: create a slice, install meshkit on every host, train, delete.

  python scripts/launch/tpu_pod.py create --name=lm --zone=us-west4-a --accelerator-type=v5litepod-16
  python scripts/launch/tpu_pod.py setup  --name=lm --zone=us-west4-a --accelerator-type=v5litepod-16
  python scripts/launch/tpu_pod.py run    --name=lm --zone=us-west4-a --accelerator-type=v5litepod-16 \\
      --config=experiments/lm.py:size=1b --workdir=/mnt/gcs/runs/lm -- --config.train.steps=1000
  python scripts/launch/tpu_pod.py delete --name=lm --zone=us-west4-a

`run` starts the same `python -m toolkit.train` on every host (`--worker=all`); each process
finds its peers through `jax.distributed.initialize()`'s Cloud TPU detection, so nothing here
assigns ranks. Give every host one `--workdir`: a gs://bucket/path URL (Orbax writes every host's
checkpoint shards straight into the bucket), or a folder all hosts share (Filestore). Arguments after `--` go to toolkit.train unchanged (shell-quoted).

`--slices=N` (N > 1) or `--queued` makes `create` a queued resource; give the same flags to
`setup`, `run` and `delete`. A multi-slice resource has nodes NAME-0 ... NAME-{N-1}, one per
slice; JAX reads the slice layout (MEGASCALE_*) from each node's metadata. Commands for
several nodes run concurrently, one `gcloud compute tpus tpu-vm ssh NODE --worker=all` each:
`gcloud compute tpus queued-resources ssh` would run at most 64 workers at a time (gcloud
528), and a training run on more hosts would wait forever for the rest.

`setup` copies the working tree (the files `git ls-files --cached --others --exclude-standard`
names, i.e. without .venv, runs/ and other ignored paths) as one archive to every host, or
clones --repo-url there, and installs meshkit with the `tpu` extra into `~/meshkit/.venv`
with Python 3.11 from uv: TPU VM images ship Python 3.10 and meshkit needs >= 3.11.

Every subcommand takes --dry-run: print the commands, one per line, shell-quoted, and run
nothing; lines ending in `&` run concurrently up to the next `wait`. The first line, a
comment, says how many hosts the command reaches. A bad accelerator type or flag prints one
`error:` line and exits 2; a failed gcloud command exits 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

from toolkit import accelerators, workdir

REMOTE_DIR = "meshkit"  # on every host, relative to the login directory of the ssh user
REMOTE_ARCHIVE = "/tmp/meshkit-src.tgz"
PYTHON_VERSION = "3.11"  # pyproject: requires-python >= 3.11; the tested stack is 3.11
USAGE_EXIT = 2

# A command is an argv list, or a string for the one local shell pipeline (packing the tree).
Command = list[str] | str


def fail(message: str, exit_code: int = USAGE_EXIT) -> None:
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  sys.exit(exit_code)


class _Parser(argparse.ArgumentParser):
  """argparse with every mistake as one `error:` line (no usage block), exit code 2."""

  def error(self, message):
    fail(f"{message} (see {self.prog} --help)")


@dataclasses.dataclass(frozen=True)
class Pod:
  """Where the commands go: one TPU slice, or a queued resource of `slices` slices."""
  name: str
  zone: str
  project: str | None
  tpu: accelerators.TpuType | None
  slices: int
  queued: bool

  @property
  def nodes(self) -> list[str]:
    """The TPU VM node of each slice (a queued resource names them PREFIX-i)."""
    return [self.name] if self.slices == 1 else [f"{self.name}-{i}" for i in range(self.slices)]

  @property
  def hosts(self) -> int:
    return self.tpu.hosts * self.slices

  def gcloud(self, *args: str) -> list[str]:
    project = [f"--project={self.project}"] if self.project else []
    return ["gcloud", "compute", "tpus", *args, f"--zone={self.zone}", *project]

  def summary(self, verb: str) -> str:
    if self.tpu is None:
      slices = f" ({self.slices} slices)" if self.slices > 1 else ""
      return f"# {verb} {self.name}{slices}"
    t = self.tpu
    per_slice = (f"{t.name}: {t.chips} chips = {t.hosts} host{'s' * (t.hosts > 1)} x "
                 f"{t.chips_per_host} chips, topology {t.topology}")
    slices = f" per slice, {self.slices} slices" if self.slices > 1 else ""
    return f"# {per_slice}{slices}; {verb} {self.hosts} host{'s' * (self.hosts > 1)}"


def create_commands(pod: Pod, version: str, spot: bool) -> list[list[Command]]:
  spot_flag = ["--spot"] if spot else []
  if not pod.queued:
    return [[pod.gcloud("tpu-vm", "create", pod.name, f"--accelerator-type={pod.tpu.name}",
                        f"--version={version}", *spot_flag)]]
  # gcloud: --node-count must be > 1; a one-slice queued resource names its node with --node-id.
  nodes = ([f"--node-id={pod.name}"] if pod.slices == 1 else
           [f"--node-count={pod.slices}", f"--node-prefix={pod.name}"])
  return [[pod.gcloud("queued-resources", "create", pod.name,
                      f"--accelerator-type={pod.tpu.name}", f"--runtime-version={version}",
                      *nodes, *spot_flag)]]


def _on_every_host(pod: Pod, remote_command: str) -> list[Command]:
  return [pod.gcloud("tpu-vm", "ssh", node, "--worker=all", f"--command={remote_command}")
          for node in pod.nodes]


def setup_commands(pod: Pod, repo_url: str | None, ref: str) -> list[list[Command]]:
  uv = "~/.local/bin/uv"
  install = [
      f"cd {REMOTE_DIR}",
      "python3 -m pip install --user --quiet --upgrade uv",
      f"(test -x .venv/bin/python || {uv} venv --python={PYTHON_VERSION} .venv)",
      f"{uv} pip install --python=.venv/bin/python --quiet -e {shlex.quote('.[tpu]')}",
  ]
  if repo_url:
    fetch = [f"(test -d {REMOTE_DIR}/.git || git clone --quiet {shlex.quote(repo_url)} "
             f"{REMOTE_DIR})",
             f"git -C {REMOTE_DIR} fetch --quiet origin {shlex.quote(ref)}",
             f"git -C {REMOTE_DIR} checkout --quiet --force FETCH_HEAD"]
    return [_on_every_host(pod, " && ".join(fetch + install))]
  archive = f"/tmp/meshkit-{pod.name}.tgz"
  repo = shlex.quote(str(REPO))
  # Tracked and untracked-but-not-ignored files; --ignore-failed-read skips deleted ones.
  pack = (f"git -C {repo} ls-files -z --cached --others --exclude-standard | "
          f"tar -czf {shlex.quote(archive)} -C {repo} --null --ignore-failed-read -T -")
  copy = [pod.gcloud("tpu-vm", "scp", archive, f"{node}:{REMOTE_ARCHIVE}", "--worker=all")
          for node in pod.nodes]
  unpack = [f"mkdir -p {REMOTE_DIR}", f"tar -xzf {REMOTE_ARCHIVE} -C {REMOTE_DIR}"]
  return [[pack], copy, _on_every_host(pod, " && ".join(unpack + install))]


def train_command(config: str, workdir: str, env: list[tuple[str, str]],
                  train_args: list[str]) -> str:
  """The remote shell command: the same toolkit.train invocation on every host."""
  assignments = [f"{key}={shlex.quote(value)}" for key, value in env]
  argv = [".venv/bin/python", "-m", "toolkit.train", f"--config={config}",
          f"--workdir={workdir}", *train_args]
  return f"cd {REMOTE_DIR} && " + " ".join(assignments + [shlex.join(argv)])


def delete_commands(pod: Pod) -> list[list[Command]]:
  if pod.queued:
    # --force deletes the slices' nodes with the queued resource.
    return [[pod.gcloud("queued-resources", "delete", pod.name, "--force", "--quiet")]]
  return [[pod.gcloud("tpu-vm", "delete", pod.name, "--quiet")]]


def format_commands(groups: list[list[Command]]) -> list[str]:
  """Shell lines: one per command; a group of several runs concurrently (`&`, then `wait`)."""
  lines = []
  for group in groups:
    texts = [c if isinstance(c, str) else shlex.join(c) for c in group]
    if len(texts) == 1:
      lines.append(texts[0])
    else:
      lines.extend(f"{text} &" for text in texts)
      lines.append("wait")
  return lines


def execute(groups: list[list[Command]]) -> None:
  """Runs each group's commands concurrently, groups in order; output streams through.

  When one command of a group fails, the others are stopped: training processes on the other
  slices would otherwise wait in their first collective for peers that never come.
  """
  for group in groups:
    running = []
    for command in group:
      argv = ["bash", "-o", "pipefail", "-c", command] if isinstance(command, str) else command
      text = command if isinstance(command, str) else shlex.join(command)
      running.append((text, subprocess.Popen(argv)))
    failure = None
    while running:
      for text, process in list(running):
        code = process.poll()
        if code is None:
          continue
        running.remove((text, process))
        if code != 0 and failure is None:
          failure = (text, code)
          for _, other in running:
            other.terminate()
      if running:
        time.sleep(0.2)  # a launcher polling a few gcloud processes
    if failure:
      fail(f"exit code {failure[1]} from: {failure[0][:300]}", 1)


def _env_pair(text: str) -> tuple[str, str]:
  key, sep, value = text.partition("=")
  if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
    raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with KEY a shell variable name")
  return key, value


def _accelerator_type(text: str) -> accelerators.TpuType:
  try:
    return accelerators.accelerator(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _node_name(text: str) -> str:
  if not re.fullmatch(r"[a-z]([-a-z0-9]{0,48}[a-z0-9])?", text):
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a TPU name: lowercase letters, digits and hyphens, starting with a "
        f"letter, at most 50 characters")
  return text


def _positive(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
  return int(text)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """(flags, train arguments after `--`)."""
  train_args: list[str] = []
  if "--" in argv:
    split = argv.index("--")
    argv, train_args = argv[:split], argv[split + 1:]
  parser = _Parser(prog="tpu_pod.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

  def subcommand(name: str, help_text: str, accelerator_required: bool = True):
    sub = commands.add_parser(name, help=help_text, description=help_text)
    sub.add_argument("--name", required=True, type=_node_name,
                     help="TPU (or queued resource) name; slices are NAME-0, NAME-1, ...")
    sub.add_argument("--zone", required=True, help="e.g. us-west4-a")
    sub.add_argument("--project", help="Google Cloud project (default: gcloud's)")
    sub.add_argument("--accelerator-type", required=accelerator_required,
                     type=_accelerator_type, metavar="TYPE",
                     help="per slice: v4-32, v5litepod-16 (or v5e-16), v5p-128, v6e-256, ...")
    sub.add_argument("--slices", type=_positive, default=1,
                     help="slices of a multi-slice queued resource (default 1)")
    sub.add_argument("--queued", action="store_true",
                     help="a queued resource even for one slice (implied by --slices > 1)")
    sub.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return sub

  create = subcommand("create", "Create the TPU VMs (or request a queued resource).")
  create.add_argument("--version", help="runtime version (default: the generation's, e.g. "
                      "tpu-ubuntu2204-base; v2-alpha-tpuv6e for v6e)")
  create.add_argument("--spot", action="store_true", help="Spot VMs (preemptible)")
  setup = subcommand("setup", "Install meshkit into ~/meshkit/.venv on every host.")
  setup.add_argument("--repo-url", help="git clone this URL on every host instead of copying "
                     "the local working tree")
  setup.add_argument("--ref", default="HEAD", help="with --repo-url: branch, tag or commit")
  run = subcommand("run", "Run python -m toolkit.train on every host; output streams back. "
                   "Arguments after -- go to toolkit.train.")
  run.add_argument("--config", required=True,
                   help="experiment file and variant, e.g. experiments/lm.py:size=1b")
  run.add_argument("--workdir", required=True,
                   type=workdir.argument, help="gs://BUCKET/path, or one folder all hosts share "
                   "at the same path (Filestore)")
  run.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the training processes (repeatable)")
  subcommand("delete", "Delete the TPU VMs (or the queued resource and its slices).",
             accelerator_required=False)
  args = parser.parse_args(argv)
  if train_args and args.command != "run":
    fail(f"arguments after -- are for `run` only; `{args.command}` got "
         f"{shlex.join(train_args)}")
  return args, train_args


def main(argv: list[str]) -> None:
  args, train_args = parse(argv)
  pod = Pod(name=args.name, zone=args.zone, project=args.project, tpu=args.accelerator_type,
            slices=args.slices, queued=args.queued or args.slices > 1)
  if args.command == "create":
    version = args.version or accelerators.GENERATIONS[pod.tpu.generation].runtime_version
    groups, verb = create_commands(pod, version, args.spot), "creates"
  elif args.command == "setup":
    groups, verb = setup_commands(pod, args.repo_url, args.ref), "reaches"
  elif args.command == "run":
    if pod.hosts > 1 and not workdir.is_url(args.workdir):
      print(f"note: --workdir={args.workdir} must be the same shared folder on all "
            f"{pod.hosts} hosts: {workdir.SHARED}", file=sys.stderr)
    command = train_command(args.config, args.workdir, args.env, train_args)
    groups, verb = [_on_every_host(pod, command)], "reaches"
  else:
    groups, verb = delete_commands(pod), "deletes"
  if not args.dry_run and shutil.which("gcloud") is None:
    fail("gcloud is not on PATH; install the Google Cloud CLI, or use --dry-run to see the "
         "commands", 1)
  print(pod.summary(verb), flush=True)
  if args.dry_run:
    print("\n".join(format_commands(groups)))
  else:
    execute(groups)


if __name__ == "__main__":
  main(sys.argv[1:])
