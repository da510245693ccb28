"""A GKE JobSet manifest that runs `python -m toolkit.train` on TPU slices (the shape XPK makes).

  python scripts/launch/gke_jobset.py --name=lm --accelerator-type=v5litepod-16 \\
      --image=us-docker.pkg.dev/PROJECT/REPO/meshkit:latest \\
      --config=experiments/lm.py:size=1b --gcs-bucket=my-bucket --workdir=/mnt/gcs/runs/lm -- --config.train.steps=1000
  python scripts/launch/gke_jobset.py --name=lm --accelerator-type=v5litepod-16 --slices=2 \\
      --image=us-docker.pkg.dev/PROJECT/REPO/meshkit:latest --config=experiments/lm.py:size=1b \\
      --gcs-bucket=my-bucket --workdir=/mnt/gcs/runs/lm --output=lm.yaml    # write a file instead

Add --apply to pipe the manifest to `kubectl apply -f -`.

Printing the manifest is the default (--dry-run says so explicitly); nothing is applied
without --apply. The YAML is written by hand here, with every string double-quoted, so the
launcher needs nothing beyond the standard library.

Shape: one replicated job per slice (`replicas` = slices), each an Indexed Job with one pod
per GKE node of the slice (`parallelism` = `completions` = nodes) and `backoffLimit: 0`, so a
failed pod fails its slice and the JobSet's `failurePolicy.maxRestarts` (--max-restarts,
default 3) restarts everything (toolkit.train resumes from the workdir's latest checkpoint), as
toolkit.supervise does on one machine. A command-line mistake (exit 2) is not restarted: the
Job's podFailurePolicy fails it with reason PodFailurePolicy, and the JobSet's rule fails the
whole JobSet on that reason (docs/pods.md). The exclusive-topology
annotation puts each slice on its own node pool. Pods select nodes by
cloud.google.com/gke-tpu-accelerator and gke-tpu-topology and take all of a node's chips
(google.com/tpu). GKE's multi-host v5e/v6e node pools have 4 chips per node
(ct5lp-hightpu-4t, ct6e-standard-4t), unlike Cloud TPU VMs with 8 per host: v5litepod-16 is 4
pods here and 2 hosts under scripts/launch/tpu_pod.py. --single-host selects the one-node
8-chip pools (ct5lp-hightpu-8t, ct6e-standard-8t) of v5litepod-8 / v6e-8.

Processes find each other through `jax.distributed.initialize()`'s GKE detection
(TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, set by GKE). For several slices this file sets
MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID (the pod's job index) and
MEGASCALE_COORDINATOR_ADDRESS (pod 0 of slice 0, through the JobSet's headless service).

A bad accelerator type or flag prints one `error:` line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

from toolkit import accelerators, workdir

USAGE_EXIT = 2
MISTAKE_EXIT = 2  # toolkit.train's exit status for a command-line mistake: not restarted
REPLICATED_JOB = "slice"
GCS_MOUNT = "/mnt/gcs"
TPU_PORTS = (8471, 8080, 8476)  # TPU runtime, megascale (DCN), jax.distributed coordinator


def fail(message: str, exit_code: int = USAGE_EXIT) -> None:
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  sys.exit(exit_code)


class _Parser(argparse.ArgumentParser):
  """argparse with every mistake as one `error:` line (no usage block), exit code 2."""

  def error(self, message):
    fail(f"{message} (see {self.prog} --help)")


# A command-line mistake of the train container fails its Job (reason PodFailurePolicy) at once.
POD_FAILURE_POLICY = {"rules": [{"action": "FailJob", "onExitCodes": {
    "containerName": "train", "operator": "In", "values": [MISTAKE_EXIT]}}]}


def failure_policy(max_restarts: int) -> dict:
  """The JobSet's: a failed Job restarts every Job, up to `max_restarts` times, except one
  that POD_FAILURE_POLICY failed (a mistake: restarting would fail the same way)."""
  return {"maxRestarts": max_restarts,
          "rules": [{"name": "mistakeIsNotRestarted", "action": "FailJobSet",
                     "onJobFailureReasons": ["PodFailurePolicy"]}]}


def jobset(*, name: str, tpu: accelerators.TpuType, slices: int, image: str, train_argv: list[str],
           env: list[tuple[str, str]], nodes: int, chips_per_node: int, namespace: str | None,
           max_restarts: int, queue: str | None, working_dir: str | None,
           termination_grace_seconds: int, gcs_bucket: str | None = None) -> dict:
  """The JobSet as plain data (dicts, lists, str, int, bool)."""
  env_list = [{"name": key, "value": value} for key, value in env]
  if slices > 1:
    env_list += [
        {"name": "MEGASCALE_NUM_SLICES", "value": str(slices)},
        {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}},
        # Pod hostnames are NAME-JOB-JOBINDEX-PODINDEX under the JobSet's subdomain NAME.
        {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{name}-{REPLICATED_JOB}-0-0.{name}"},
    ]
  container = {
      "name": "train",
      "image": image,
      "command": train_argv,
      "ports": [{"containerPort": port} for port in TPU_PORTS],
      "resources": {"limits": {"google.com/tpu": chips_per_node}},
  }
  if working_dir:
    container["workingDir"] = working_dir
  if env_list:
    container["env"] = env_list
  pod_spec = {
      "restartPolicy": "Never",
      # TPU hosts talk over the node's network (DCN for multi-slice), as XPK sets it up.
      "hostNetwork": True,
      "dnsPolicy": "ClusterFirstWithHostNet",
      "terminationGracePeriodSeconds": termination_grace_seconds,
      "nodeSelector": {
          "cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
          "cloud.google.com/gke-tpu-topology": tpu.topology,
      },
      "containers": [container],
  }
  if gcs_bucket:
    # GKE's Cloud Storage FUSE CSI driver mounts the bucket in every pod at GCS_MOUNT: the
    # shared workdir. The pods' Kubernetes service account needs access to the bucket.
    container["volumeMounts"] = [{"name": "gcs", "mountPath": GCS_MOUNT}]
    pod_spec["volumes"] = [{"name": "gcs", "csi": {
        "driver": "gcsfuse.csi.storage.gke.io",
        "volumeAttributes": {"bucketName": gcs_bucket, "mountOptions": "implicit-dirs"}}}]
  metadata = {
      "name": name,
      "annotations": {
          # One slice per node pool: the pods of a slice share one ICI domain.
          "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
  }
  if namespace:
    metadata["namespace"] = namespace
  if queue:
    metadata["labels"] = {"kueue.x-k8s.io/queue-name": queue}
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2",
      "kind": "JobSet",
      "metadata": metadata,
      "spec": {
          "failurePolicy": failure_policy(max_restarts),
          # Stable pod hostnames NAME-slice-J-I.NAME: the multi-slice coordinator address.
          "network": {"enableDNSHostnames": True, "subdomain": name},
          "replicatedJobs": [{
              "name": REPLICATED_JOB,
              "replicas": slices,
              "template": {"spec": {
                  "parallelism": nodes,
                  "completions": nodes,
                  "backoffLimit": 0,
                  "podFailurePolicy": POD_FAILURE_POLICY,
                  "completionMode": "Indexed",
                  "template": ({"metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}},
                                "spec": pod_spec} if gcs_bucket else {"spec": pod_spec}),
              }},
          }],
      },
  }


_PLAIN_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_.\-/]*")


def _scalar(value) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, int):
    return str(value)
  if isinstance(value, str):
    return json.dumps(value)  # a JSON string is a YAML double-quoted scalar
  if value == {} or value == []:
    return json.dumps(value)
  raise TypeError(f"no YAML scalar for {type(value).__name__}")


# Plain words that YAML 1.1 readers (PyYAML) take for booleans or null.
_YAML11_WORDS = {"y", "yes", "n", "no", "on", "off", "true", "false", "null"}


def _key(key: str) -> str:
  plain = _PLAIN_KEY.fullmatch(key) and key.lower() not in _YAML11_WORDS
  return key if plain else json.dumps(key)


def to_yaml(value, indent: int = 0) -> str:
  """Block-style YAML of dicts, lists and scalars; strings always double-quoted."""
  pad = " " * indent
  lines = []
  if isinstance(value, dict):
    for key, item in value.items():
      if isinstance(item, (dict, list)) and item:
        lines += [f"{pad}{_key(key)}:", to_yaml(item, indent + 2)]
      else:
        lines.append(f"{pad}{_key(key)}: {_scalar(item)}")
  else:
    for item in value:  # "- " in place of the item's own indentation on its first line
      if isinstance(item, (dict, list)) and item:
        lines.append(f"{pad}- {to_yaml(item, indent + 2)[indent + 2:]}")
      else:
        lines.append(f"{pad}- {_scalar(item)}")
  return "\n".join(lines)


def _env_pair(text: str) -> tuple[str, str]:
  key, sep, value = text.partition("=")
  if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
    raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with KEY a variable name")
  return key, value


def _accelerator_type(text: str) -> accelerators.TpuType:
  try:
    return accelerators.accelerator(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _bucket(text: str) -> str:
  name = text.removeprefix("gs://").rstrip("/")
  if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]", name):
    raise argparse.ArgumentTypeError(f"{text!r} is not a bucket name (lowercase letters, digits, "
                                     f"-, _ and .), e.g. my-bucket")
  return name


def _count(minimum: int):
  def parse(text: str) -> int:
    if not text.isdigit() or int(text) < minimum:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
    return int(text)
  return parse


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """(flags, train arguments after `--`)."""
  train_args: list[str] = []
  if "--" in argv:
    split = argv.index("--")
    argv, train_args = argv[:split], argv[split + 1:]
  parser = _Parser(prog="gke_jobset.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--name", required=True,
                      help="JobSet name (lowercase letters, digits, hyphens)")
  parser.add_argument("--accelerator-type", required=True, type=_accelerator_type,
                      metavar="TYPE", help="per slice: v4-32, v5litepod-16 (or v5e-16), v5p-128, "
                      "v6e-256, ...")
  parser.add_argument("--slices", type=_count(1), default=1, help="TPU slices (default 1)")
  parser.add_argument("--single-host", action="store_true",
                      help="v5e/v6e 8-chip slices on one 8-chip node (ct5lp-hightpu-8t, "
                      "ct6e-standard-8t) instead of two 4-chip nodes")
  parser.add_argument("--image", required=True, help="container image with meshkit installed")
  parser.add_argument("--working-dir", help="container directory holding experiments/ "
                      "(default: the image's WORKDIR)")
  parser.add_argument("--python", default="python", help="Python in the image (default python)")
  parser.add_argument("--config", required=True,
                      help="experiment file and variant, e.g. experiments/lm.py:size=1b")
  parser.add_argument("--workdir", required=True, type=workdir.argument,
                      help="gs://BUCKET/path (every pod writes there directly), or one folder "
                      "all pods share at the same path")
  parser.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                      help="environment variable for the training processes (repeatable)")
  parser.add_argument("--gcs-bucket", type=_bucket, help=f"mount this Cloud Storage bucket "
                      f"at {GCS_MOUNT} in every pod (GKE's gcsfuse CSI driver), e.g. for data "
                      f"files; the workdir is better a gs:// URL")
  parser.add_argument("--namespace", help="Kubernetes namespace (default: kubectl's)")
  parser.add_argument("--queue", help="Kueue LocalQueue name (label kueue.x-k8s.io/queue-name)")
  parser.add_argument("--max-restarts", type=_count(0), default=3,
                      help="JobSet restarts after a failure (default 3; a command-line "
                      "mistake, exit 2, is not restarted); runs resume from the workdir's "
                      "latest checkpoint")
  parser.add_argument("--termination-grace-seconds", type=_count(1), default=120,
                      help="time to finish the step and save after SIGTERM (default 120)")
  parser.add_argument("--output", help="write the manifest to this file instead of stdout")
  parser.add_argument("--dry-run", action="store_true",
                      help="only print the manifest (the default without --apply)")
  parser.add_argument("--apply", action="store_true", help="pipe the manifest to kubectl apply")
  args = parser.parse_args(argv)
  if args.gcs_bucket and not args.workdir.startswith(GCS_MOUNT + "/"):
    fail(f"--gcs-bucket mounts the bucket at {GCS_MOUNT}; put --workdir under it, e.g. "
         f"--workdir={GCS_MOUNT}/runs/lm (not {args.workdir})")
  if args.apply and args.dry_run:
    fail("--apply and --dry-run contradict each other; give one")
  return args, train_args


def main(argv: list[str]) -> None:
  args, train_args = parse(argv)
  tpu = args.accelerator_type
  if args.single_host:
    if tpu.generation not in ("v5e", "v6e") or tpu.chips != 8:
      fail(f"--single-host is for the 8-chip v5e/v6e types (v5litepod-8, v6e-8), not {tpu.name}; "
           f"smaller types are single-host anyway")
    nodes, chips_per_node = 1, 8
  else:
    nodes, chips_per_node = tpu.gke_nodes, tpu.gke_chips_per_node
  if args.slices > 1 and nodes == 1:
    fail(f"--slices={args.slices}: GKE runs multi-slice only on multi-host node pools, and "
         f"{tpu.name} is one node ({tpu.topology}); use a type of 8 or more chips"
         + (" without --single-host" if args.single_host else ""))
  # The longest pod hostname, NAME-slice-J-I, must be a DNS label (<= 63 characters).
  longest = f"{args.name}-{REPLICATED_JOB}-{args.slices - 1}-{nodes - 1}"
  if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", args.name) or len(longest) > 63:
    fail(f"--name={args.name!r}: use lowercase letters, digits and hyphens, starting with a "
         f"letter, short enough that pod hostnames like {longest} fit 63 characters")
  train_argv = [args.python, "-m", "toolkit.train", f"--config={args.config}",
                f"--workdir={args.workdir}", *train_args]
  manifest = jobset(name=args.name, tpu=tpu, slices=args.slices, image=args.image,
                    train_argv=train_argv, env=args.env, nodes=nodes,
                    chips_per_node=chips_per_node, namespace=args.namespace,
                    max_restarts=args.max_restarts, queue=args.queue,
                    working_dir=args.working_dir,
                    termination_grace_seconds=args.termination_grace_seconds,
                    gcs_bucket=args.gcs_bucket)
  pods = nodes * args.slices
  header = (f"# {tpu.name} x {args.slices} slice{'s' * (args.slices > 1)}: {pods} pod"
            f"{'s' * (pods > 1)} ({nodes} per slice, {chips_per_node} chips each, topology "
            f"{tpu.topology}, {tpu.gke_accelerator})")
  text = f"{header}\n{to_yaml(manifest)}\n"
  if args.output:
    pathlib.Path(args.output).write_text(text)
    print(f"{header[2:]}; wrote {args.output}", file=sys.stderr)
  if args.apply:
    if shutil.which("kubectl") is None:
      fail("kubectl is not on PATH; install it, or write the manifest with --output", 1)
    code = subprocess.run(["kubectl", "apply", "-f", "-"], input=text, text=True).returncode
    if code:
      fail(f"kubectl apply exited with {code}", 1)
  elif not args.output:
    sys.stdout.write(text)


if __name__ == "__main__":
  main(sys.argv[1:])
