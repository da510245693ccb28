"""Elastic restarts (toolkit/pod/elastic.py, the supervisor's --hosts_file): a restart on the
hosts that remain keeps the global batch and each device's rows; a lost host not replaced in
time shrinks the job, its return grows it back, and the losses are an uninterrupted run's."""
from __future__ import annotations

import io
import os
import pathlib
import re
import signal
import threading
import time

import jax
import numpy as np
import pytest

from experiments import lm
from tests.tiny_runs import TOLERANCE, assert_trees_close
from tests.toolkit.pod import supervised
from toolkit import training
from toolkit.pod import elastic, supervisor as supervisor_lib
from toolkit.training.checkpoints import checkpoint

TINY = ["--config=experiments/lm.py:tiny"]  # mesh data:1,fsdp:-1,tensor:2; batch 16 rows
STEPS = 60  # room to shrink after step 8 and grow back a few steps later
TRAIN = [*TINY, f"--config.train.steps={STEPS}", "--config.train.checkpoint_every=5",
         "--config.train.log_every=1", "--config.train.eval_every=1000",
         "--config.train.sample_tokens=0"]
TIMEOUT_S = 300  # three attempts of 2-4 processes on 2 shared cores: ~60-120 s


@pytest.mark.parametrize("hosts,args,expected", [
    # 4 x 2 devices: fsdp 4 (x tensor 2) splits the 16 rows 4 ways, 4 rows a device.
    (4, [], elastic.Size(4)),
    # 3 hosts: fsdp 3 cannot split 16 rows; 2 hosts: fsdp 2, 8 rows a device in one
    # micro-batch, so two micro-batches of 4.
    (3, [], elastic.Size(2, 2)),
    (2, [], elastic.Size(2, 2)),
    (1, [], elastic.Size(1, 4)),  # 2 devices, one row-way (fsdp 1): 16 / 4 micro-batches
    # Two micro-batches asked for: 2 rows a device on 8 devices; on 4, four micro-batches.
    (3, ["--config.train.microbatches=2"], elastic.Size(2, 4)),
    # A mesh that fills its data axis keeps the rows of a device on fewer hosts only with
    # more micro-batches, and 3 hosts (6 devices) never split 16 rows.
    (3, ["--config.mesh.ici=data:-1,fsdp:1,tensor:2"], elastic.Size(2, 2)),
    # 24 rows split 3 ways, but fsdp 3 cannot split the 32-wide embedding: 2 hosts.
    (3, ["--config.data.global_batch_size=24"], elastic.Size(2, 2)),
])
def test_a_smaller_job_keeps_the_global_batch_and_each_devices_rows(hosts, args, expected):
  assert elastic.fit([*TINY, *args], hosts, 4, 2) == expected


DATA_PARALLEL = "--config.mesh.ici=data:-1,fsdp:1,tensor:2"


@pytest.mark.parametrize("hosts,args,expected", [
    (4, [], elastic.Size(4)),
    # Each device keeps its 4 rows in one micro-batch: 2 hosts train 8 rows a step, 1 host 4;
    # fsdp 3 cannot split the 32-wide embedding, so 3 hosts run as 2.
    (3, [], elastic.Size(2, global_batch=8)),
    (1, [], elastic.Size(1, global_batch=4)),
    # Data parallel, the parameters whole on each device: 3 hosts train 12 rows, in 2
    # micro-batches of 2 rows a device when 2 were asked for.
    (3, [DATA_PARALLEL], elastic.Size(3, global_batch=12)),
    (3, [DATA_PARALLEL, "--config.train.microbatches=2"], elastic.Size(3, global_batch=12)),
    # 24 rows, 6 a device: 18 on 3 hosts.
    (3, [DATA_PARALLEL, "--config.data.global_batch_size=24"], elastic.Size(3, global_batch=18)),
    # A mesh of fixed sizes cannot shrink.
    (3, ["--config.mesh.ici=data:1,fsdp:4,tensor:2"], None),
])
def test_a_smaller_job_can_keep_each_devices_rows_instead(hosts, args, expected):
  if expected is None:
    with pytest.raises(elastic.HostsError, match=r"no job of at most 3 of the 4 processes fits "
                       r"each device's rows \(3 process\(es\): .* uses 8 devices per slice"):
      elastic.fit([*TINY, *args], hosts, 4, 2, keep="per_device")
    return
  assert elastic.fit([*TINY, *args], hosts, 4, 2, keep="per_device") == expected
  with pytest.raises(elastic.HostsError, match=r"--elastic_batch=local: give one of global, "):
    elastic.fit(TINY, hosts, 4, 2, keep="local")


def test_a_mesh_that_cannot_shrink_is_one_error_naming_the_fix():
  with pytest.raises(elastic.HostsError) as e:
    elastic.fit([*TINY, "--config.mesh.ici=data:1,fsdp:4,tensor:2"], 3, 4, 2)
  message = str(e.value)
  assert "no job of at most 3 of the 4 processes fits" in message
  assert "uses 8 devices per slice but there are 6" in message  # the largest try's refusal
  assert "--config.mesh.ici=fsdp:-1" in message and "\n" not in message


def test_the_hosts_file_and_the_micro_batch_flag(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("# the job's hosts\nnode-0\n\n  node-1  # rack 2\nnode-2\n")
  assert elastic.read_hosts(str(hosts)) == ["node-0", "node-1", "node-2"]
  with pytest.raises(elastic.HostsError, match=r"--hosts_file=.*missing: no such file"):
    elastic.read_hosts(str(tmp_path / "missing"))
  args = [*TINY, "--config.train.microbatches=2", "--workdir=w"]
  assert elastic.with_size(args, elastic.Size(4)) == args
  assert elastic.with_size(args, elastic.Size(2, 4)) == [*TINY, "--workdir=w",
                                                         "--config.train.microbatches=4"]
  assert elastic.with_size(args, elastic.Size(3, global_batch=12)) == [
      *args, "--config.data.global_batch_size=12"]


def test_a_lost_host_is_waited_for_then_the_job_restarts_on_those_listed(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("a\nb\nc\n")
  err = io.StringIO()
  supervisor = supervisor_lib.Supervisor(4, 2, TINY, hosts_file=str(hosts),
                                         replace_timeout_s=0.5, poll_s=0.05, err=err)
  crash = supervisor_lib.Attempt(1, 0.0, cause="crash")
  started = time.monotonic()
  assert supervisor._size(crash) == elastic.Size(2, 2)
  assert time.monotonic() - started >= 0.5
  lines = err.getvalue().splitlines()
  assert lines == [
      f"[supervise] 3 of 4 hosts listed in {hosts}: waiting up to 0.5 s for the lost host(s) to "
      f"be replaced",
      "[supervise] running on 2 of 4 hosts (3 listed): 4 devices, the same global batch in "
      "train.microbatches=2; it grows back when the hosts file lists more"]
  # A replacement listed within the wait: every host, no wait left over.
  threading.Timer(0.2, lambda: hosts.write_text("a\nb\nc\nd\n")).start()
  supervisor.replace_timeout_s = 30
  started = time.monotonic()
  assert supervisor._size(crash) == elastic.Size(4)
  assert time.monotonic() - started < 5
  # Keeping each device's rows instead: 2 hosts, 8 rows a step, the change stated.
  hosts.write_text("a\nb\nc\n")
  err.truncate(0), err.seek(0)
  supervisor.replace_timeout_s, supervisor.elastic_batch = 0, "per_device"
  assert supervisor._size(crash) == elastic.Size(2, global_batch=8)
  assert err.getvalue().splitlines()[-1] == (
      "[supervise] running on 2 of 4 hosts (3 listed): 4 devices, 8 rows a step instead of 16 "
      "(the same rows a device): each step trains on fewer examples, and other ones than the "
      "uninterrupted run's; it grows back when the hosts file lists more")


def test_a_missing_hosts_file_is_one_line_and_starts_nothing(tmp_path):
  err = io.StringIO()
  supervisor = supervisor_lib.Supervisor(2, 4, [*TINY, f"--workdir={tmp_path / 'w'}"],
                                         hosts_file=str(tmp_path / "hosts"), err=err)
  assert supervisor.run() == 1
  assert supervisor.attempts == [] and not (tmp_path / "w").exists()
  assert err.getvalue() == (f"[supervise] error: --hosts_file={tmp_path / 'hosts'}: no such "
                            f"file; list the job's hosts in it, one per line\n")


def _final_params(workdir: pathlib.Path, config):
  manager = checkpoint.Checkpoints(str(workdir / "checkpoints"), read_only=True)
  state, _ = manager.restore(STEPS, training.build(config).layout.abstract)
  manager.close()
  return jax.device_get(state["params"])


@pytest.mark.slow  # three attempts of a 4-process job: ~60-120 s
@pytest.mark.multiprocess
def test_a_lost_host_shrinks_the_job_and_its_return_grows_it_back(tmp_path):
  config = lm.get_config("tiny")
  config.train.update(steps=STEPS, checkpoint_every=5, log_every=1, eval_every=1000)
  reference = tmp_path / "reference"  # 1 process x 8 devices, uninterrupted, in this process
  expected = training.run(config, str(reference)).train_losses

  hosts, workdir = tmp_path / "hosts", tmp_path / "w"
  hosts.write_text("h0\nh1\nh2\nh3\n")
  out, err = io.StringIO(), io.StringIO()
  supervisor = supervisor_lib.Supervisor(4, 2, [*TRAIN, f"--workdir={workdir}"],
                                         hosts_file=str(hosts), replace_timeout_s=1,
                                         restart_delay_s=0, poll_s=0.2, out=out, err=err)
  with supervised.Running(supervisor, TIMEOUT_S) as job:
    # Host 3 is lost past the first checkpoint: its line goes, then its process.
    job.wait_for(lambda: "[p0] step 8/" in job.text(), "step 8")
    hosts.write_text("h0\nh1\nh2\n")
    os.kill(supervisor.job.procs[3].pid, signal.SIGKILL)
    job.wait_for(lambda: "running on 2 of 4 hosts" in job.text(), "the smaller job")

    def steps_on_2_hosts() -> int:
      pod = supervisor.job
      if len(supervisor.attempts) != 1 or pod is None or len(pod.procs) != 2:
        return 0
      return len(re.findall(r"^step \d+/", pod.output(0), re.M))
    # It comes back once the smaller job has trained a few steps.
    job.wait_for(lambda: steps_on_2_hosts() >= 3, "three steps on 2 hosts")
    hosts.write_text("h0\nh1\nh2\nh3\n")
    code = job.join()
  output = job.text()
  print(err.getvalue())  # the supervisor's and the pod's lines (pytest -rP)
  assert code == 0, output[-5000:]
  assert [a.cause for a in supervisor.attempts] == ["crash", "resized", "finished"], \
      output[-5000:]
  assert [a.size for a in supervisor.attempts] == [
      elastic.Size(4), elastic.Size(2, 2), elastic.Size(4)]
  assert re.search(r"^\[supervise\] restart 1 of 3 after a crash \(p3 killed by SIGKILL\)",
                   output, re.M), output[-5000:]
  assert ("[supervise] running on 2 of 4 hosts (3 listed): 4 devices, the same global batch "
          "in train.microbatches=2" in output)
  assert "[supervise] 4 of 4 hosts listed again: stopping the job after its step" in output
  assert re.search(r"^\[supervise\] job finished after 3 attempt\(s\) \(failures: crash; "
                   r"grown back 1 time\(s\)\)", output, re.M), output[-3000:]
  recovered = re.findall(r"^\[supervise\] recovered in [\d.]+ s: restored step (\d+), (\d+) "
                         r"step\(s\) lost", output, re.M)
  assert len(recovered) == 2 and int(recovered[0][1]) <= 5, recovered  # checkpoint_every=5
  assert int(recovered[1][1]) == 0, recovered  # grown back from the step it stopped at
  # Every step once, on the same global batches: the uninterrupted run's losses and weights
  # (the reduction order changes with the mesh and the micro-batches: the project tolerance).
  losses = supervised.losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [expected[s] for s in sorted(losses)], **TOLERANCE)
  assert_trees_close(_final_params(workdir, config), _final_params(reference, config),
                     **TOLERANCE)


def test_a_stop_while_waiting_for_a_host_starts_nothing(tmp_path):
  """Ctrl-C to the supervisor while it waits for a replacement ends the wait: no restart."""
  hosts = tmp_path / "hosts"
  hosts.write_text("a\nb\nc\n")
  supervisor = supervisor_lib.Supervisor(4, 2, TINY, hosts_file=str(hosts),
                                         replace_timeout_s=60, poll_s=0.05, err=io.StringIO())
  threading.Timer(0.3, supervisor.request_stop).start()
  started = time.monotonic()
  assert supervisor._size(supervisor_lib.Attempt(1, 0.0, cause="crash")) is None
  assert time.monotonic() - started < 5
  assert supervisor._size(None) is None  # nor a first attempt once a stop was requested
