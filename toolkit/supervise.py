"""`python -m toolkit.supervise`: run a training job and restart it after a crash or a hang.

  python -m toolkit.supervise --processes=2 --devices_per_process=4 -- \\
      --config=experiments/lm.py:tiny --workdir=runs/supervised

Everything after `--` is the training command's flags (`python -m toolkit.train ...`), run as
a local pod of --processes x --devices_per_process simulated CPU devices, as
scripts/launch/local_pod.py does. When the job fails (a process killed, or ended by the hang
watchdog, or failing after it trained a step) it is started again and resumes from its newest
checkpoint, up to --max_restarts times; each restart is one `[supervise]` line (cause, step,
then the time to recover and the steps lost), and the last line sums the job's lifetime. A
mistake (exit 2, or a failure before the first step) is not retried. Ctrl-C stops the job
after a step with a checkpoint, without a restart. toolkit/pod/supervisor.py has the rules.

With --hosts_file=PATH (one line per host; a local pod runs one process per line, up to
--processes) the job is elastic: after a failure, while the file lists fewer hosts than
--processes, the supervisor waits up to --replace_timeout_s for a replacement, then restarts on
the hosts listed (the largest job the config's mesh fits, the same global batch in more
micro-batches, from the newest checkpoint), and grows back onto every host when the file lists
them again (toolkit/pod/elastic.py). --elastic_batch=per_device keeps each device's rows
instead: a smaller global batch while the job is smaller, stated in the restart line.
"""
from __future__ import annotations

import sys

from toolkit import command_line


def cli() -> None:
  """`python -m toolkit.supervise [flags] -- TRAIN_FLAGS`: the exit status of the job's last
  attempt (0 when it finished or stopped on request); 2 for a command-line mistake."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from toolkit.pod import supervisor  # pylint: disable=g-import-not-at-top
  processes_flag = flags.DEFINE_integer("processes", 1, "Training processes of the job.",
                                        lower_bound=1)
  devices_flag = flags.DEFINE_integer("devices_per_process", 8, "Simulated CPU devices each.",
                                      lower_bound=1)
  restarts_flag = flags.DEFINE_integer("max_restarts", 3, "Restarts after a crash or hang "
                                       "before the supervisor gives up.", lower_bound=0)
  delay_flag = flags.DEFINE_float("restart_delay_s", 1.0, "Seconds between a failure and the "
                                  "restart.", lower_bound=0.0)
  hosts_flag = flags.DEFINE_string("hosts_file", None, "A file listing the job's hosts, one "
                                   "per line, read at each restart: run on those listed "
                                   "(elastic); unset: always on --processes.")
  replace_flag = flags.DEFINE_float("replace_timeout_s", 300.0, "With --hosts_file: seconds to "
                                    "wait for a lost host to be listed again before restarting "
                                    "on fewer.", lower_bound=0.0)
  batch_flag = flags.DEFINE_enum("elastic_batch", "global", ["global", "per_device"], "With "
                                 "--hosts_file, what a job on fewer hosts keeps: the global "
                                 "batch (in more micro-batches; every step's data as the "
                                 "uninterrupted run's) or each device's rows (a smaller "
                                 "global batch: fewer examples a step, other data).")
  split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
  ours, train_args = sys.argv[:split], sys.argv[split + 1:]

  def main(argv) -> None:
    del argv
    if not train_args:
      command_line.fail("give the training command's flags after --, e.g. -- "
                        "--config=experiments/lm.py:tiny --workdir=runs/supervised",
                        command_line.USAGE_EXIT)
    if hosts_flag.value is not None:
      # Sizing a smaller job validates the config against that many simulated CPU devices.
      import jax  # pylint: disable=g-import-not-at-top
      from toolkit import runtime  # pylint: disable=g-import-not-at-top
      jax.config.update("jax_platforms", "cpu")
      runtime.simulate_cpu_devices(processes_flag.value * devices_flag.value, "sizing",
                                   log=lambda line: None)
    sys.exit(supervisor.supervise(processes_flag.value, devices_flag.value, train_args,
                                  restarts_flag.value, delay_flag.value, hosts_flag.value,
                                  replace_flag.value, batch_flag.value))

  app.run(main, argv=ours, flags_parser=lambda argv: command_line.parse_flags(argv))


if __name__ == "__main__":
  cli()
