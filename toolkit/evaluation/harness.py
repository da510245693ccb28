"""EleutherAI's lm-evaluation-harness (`lm-eval` on PyPI) as meshkit uses it: tasks by the
names users know (hellaswag, arc_easy, ...; their data comes from the Hugging Face Hub) or as
local task files (a YAML file in the harness's format over local data), run on a `MeshkitLM`
(toolkit/evaluation/model.py) by the harness's own `simple_evaluate`, reported as its JSON and
its table.

lm-eval is an optional dependency (`pip install -e '.[eval]'`): nothing here imports it until
tasks are loaded (`require`), so training and serving never need it.

Local task files: a relative path in the YAML's `dataset_kwargs.data_files` is read from the
YAML's folder (plain `lm-eval` reads it from the working directory), so a task folder can be
used from anywhere. Names are looked up in the `include_path` folders first; only names not
found there build the harness's index of its ~15,000 task files (seconds).
"""
from __future__ import annotations

import difflib
import importlib
import logging
import os
import socket
import urllib.parse
from collections.abc import Sequence

from toolkit.errors import ConfigError

INSTALL = "pip install -e '.[eval]'"
YAML_SUFFIXES = (".yaml", ".yml")


def require() -> None:
  """Raises ConfigError (one line: how to install it) when lm-eval is missing; quiets the
  harness's per-request INFO logging."""
  try:
    importlib.import_module("lm_eval")
  except ImportError:
    raise ConfigError(f"evaluation tasks run through EleutherAI's lm-evaluation-harness, which "
                      f"is not installed: {INSTALL}") from None
  for name in ("lm_eval", "lm-eval"):
    logging.getLogger(name).setLevel(logging.WARNING)


def parse_specs(value: str | Sequence[str], field: str) -> list[str]:
  """Task names or YAML paths from a comma-separated string (or a list); at least one."""
  items = value.split(",") if isinstance(value, str) else list(value)
  specs = [item.strip() for item in items if item.strip()]
  if not specs:
    raise ConfigError(f"{field} names no task; give harness task names or local task YAML "
                      f"files, comma separated, e.g. {field}=hellaswag,arc_easy")
  return specs


def load_tasks(specs: Sequence[str], field: str = "--tasks",
               include_path: str | Sequence[str] | None = None) -> list:
  """The harness's Task (or Group) objects for `specs`, each loaded once with its data: a
  ConfigError names the first spec that is unknown, malformed, or whose data cannot be read
  here (the Hub unreachable, a local file missing)."""
  require()
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
  for path in paths:
    if not os.path.isdir(path):
      raise ConfigError(f"--include_path={path!r} is not a folder; give a folder of task YAML "
                        f"files")
  local = TaskManager(include_defaults=False, include_path=paths or None)
  everything = None
  loaded = []
  for spec in specs:
    if spec.endswith(YAML_SUFFIXES) or os.path.sep in spec:
      loaded.append(_load_file(local, spec, field))
      continue
    manager = local
    if spec not in local.all_tasks:
      everything = everything or TaskManager(include_path=paths or None)
      manager = everything
      if spec not in manager.all_tasks:
        close = difflib.get_close_matches(spec, manager.all_tasks, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else (
            "; `lm-eval ls tasks` lists them, or give a local task YAML file")
        raise ConfigError(f"{field}: {spec!r} is not a task, group or tag the harness knows "
                          f"(lm-eval {_version()}){hint}")
    entry = manager.task_index[spec]
    if entry.yaml_path is not None and not _is_builtin(entry.yaml_path) and "task" in (
        entry.cfg or {}) and not isinstance(entry.cfg["task"], list):
      loaded.append(_load_file(manager, str(entry.yaml_path), field))
    else:
      loaded.append(_build(manager, spec, spec))
  return loaded


def _load_file(manager, path: str, field: str):
  """A task from its YAML file, relative data files read from the file's folder."""
  from lm_eval.tasks._yaml_loader import load_yaml  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    raise ConfigError(f"{field}: {path!r} is not a file; give a task YAML file or a task name")
  try:
    config = load_yaml(path, resolve_func=True)
  except Exception as e:  # pylint: disable=broad-except  # YAML, includes, !function imports
    raise ConfigError(f"{field}: {path} is not a task file the harness reads "
                      f"({type(e).__name__}: {e})") from None
  if "task" not in config or isinstance(config["task"], list):
    return _build(manager, path, path)  # a group: its members load by name
  kwargs = dict(config.get("dataset_kwargs") or {})
  if "data_files" in kwargs:
    folder = os.path.dirname(os.path.abspath(path))
    kwargs["data_files"] = _relative_to(kwargs["data_files"], folder)
    config["dataset_kwargs"] = kwargs
  return _build(manager, config, config["task"])


def _relative_to(files, folder: str):
  """`files` (a path, a list of them, or split -> either) with relative local paths made
  absolute from `folder`."""
  if isinstance(files, dict):
    return {split: _relative_to(value, folder) for split, value in files.items()}
  if isinstance(files, (list, tuple)):
    return [_relative_to(value, folder) for value in files]
  if isinstance(files, str) and "://" not in files and not os.path.isabs(files):
    return os.path.join(folder, files)
  return files


def _build(manager, spec, name: str):
  """One spec through the harness's TaskManager (reading its data); one line for the
  failures a user can fix."""
  if not (isinstance(spec, dict) and spec.get("dataset_path") in LOCAL_BUILDERS):
    _offline_unless_the_hub_answers()
  try:
    built = manager.load([spec])
  except Exception as e:  # pylint: disable=broad-except
    if _unreachable(e):
      why = _probe_failure or _first_line(e)
      raise ConfigError(
          f"task {name!r} needs its data from the Hugging Face Hub, which cannot be reached "
          f"from here ({why}); run where the Hub is reachable, or evaluate a local "
          f"task (a YAML file over local data, docs/evaluation.md)") from None
    if isinstance(e, FileNotFoundError):
      raise ConfigError(f"task {name!r}: {_first_line(e)}; check the data_files of its YAML "
                        f"file") from None
    raise
  # A group comes back with its members flattened: hand on the group itself (its results
  # aggregate), a tag's tasks as a list.
  groups = built.get("groups") or {}
  members = {child for children in (built.get("group_map") or {}).values() for child in children}
  top = [group for group_name, group in groups.items() if group_name not in members]
  if top:
    return top[0] if len(top) == 1 else top
  tasks = list(built["tasks"].values())
  return tasks[0] if len(tasks) == 1 else tasks


HUB_PROBE_TIMEOUT_S = 5.0
# The datasets builders that read local files only (a task over data_files of its own).
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
_probe_failure: str | None = None  # why the Hub was taken for unreachable, once it was


def _offline_unless_the_hub_answers() -> None:
  """Before a harness task that may read the Hub: when the Hub's endpoint takes no connection
  within HUB_PROBE_TIMEOUT_S, Hugging Face's libraries go offline for this process (cached data
  still loads) instead of retrying each request five times over ~30 s with a warning each."""
  global _probe_failure  # pylint: disable=global-statement
  import datasets  # pylint: disable=g-import-not-at-top
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
    return
  endpoint = urllib.parse.urlparse(constants.ENDPOINT)
  try:
    with socket.create_connection((endpoint.hostname, endpoint.port or (
        443 if endpoint.scheme == "https" else 80)), timeout=HUB_PROBE_TIMEOUT_S):
      return
  except OSError as e:
    _probe_failure = (f"{constants.ENDPOINT} took no connection within "
                      f"{HUB_PROBE_TIMEOUT_S:g} s: {e.strerror or type(e).__name__}")
  os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # and for child processes
  constants.HF_HUB_OFFLINE = True
  datasets.config.HF_HUB_OFFLINE = True


def _unreachable(error: BaseException) -> bool:
  """Whether `error` (or one it came from) is the Hub out of reach: no network, or
  HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set with nothing cached."""
  while error is not None:
    if isinstance(error, (ConnectionError, TimeoutError)):
      return True
    name = type(error).__name__
    if name in ("OfflineModeIsEnabled", "LocalEntryNotFoundError") or (
        "Connection" in name and isinstance(error, OSError)):
      return True
    error = error.__cause__ or error.__context__
  return False


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def _is_builtin(path) -> bool:
  import lm_eval  # pylint: disable=g-import-not-at-top
  return os.path.abspath(str(path)).startswith(os.path.dirname(os.path.abspath(lm_eval.__file__)))


def _version() -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version("lm_eval")
  except metadata.PackageNotFoundError:
    return "?"


# simple_evaluate's and `lm_eval --seed`'s defaults: Python's random, NumPy, torch, the few-shot
# choice. A seed of our own sets all four, as `lm_eval --seed N` does.
HARNESS_SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234,
                 "fewshot_random_seed": 1234}
SAMPLING_SEED = HARNESS_SEEDS["torch_random_seed"]  # HFLM samples with torch's generator


def seeds(seed: int | None) -> dict[str, int]:
  """simple_evaluate's seed arguments: the harness's defaults, or `seed` for all four."""
  return dict(HARNESS_SEEDS) if seed is None else dict.fromkeys(HARNESS_SEEDS, seed)


def run(lm, tasks: list, *, limit: float | None = None, num_fewshot: int | None = None,
        bootstrap_iters: int = 100_000, log_samples: bool = False,
        seed: int | None = None) -> dict:
  """The harness's `simple_evaluate` of `lm` on loaded `tasks`: its results dict ("results",
  "groups", "configs", "versions", "n-shot", ..., "samples" when `log_samples`). `limit`:
  examples per task (a fraction when below 1; None: all); `seed`: None for the harness's own
  seeds (HARNESS_SEEDS), else one for all of them."""
  from lm_eval import simple_evaluate  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  flat = [t for item in tasks for t in (item if isinstance(item, list) else [item])]
  # The tasks are loaded already: an empty manager, not the index of every harness task.
  return simple_evaluate(model=lm, tasks=flat, task_manager=TaskManager(include_defaults=False),
                         limit=limit, num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters,
                         log_samples=log_samples, **seeds(seed))


def table(results: dict) -> str:
  """The harness's Markdown table of the results (and of the groups, when there are some)."""
  from lm_eval.utils import make_table  # pylint: disable=g-import-not-at-top
  text = make_table(results)
  if results.get("groups"):
    text += "\n" + make_table(results, "groups")
  return text


def to_json(results: dict) -> str:
  """The results as the harness writes them (its own encoder for what JSON lacks)."""
  import json  # pylint: disable=g-import-not-at-top
  from lm_eval.utils import handle_non_serializable  # pylint: disable=g-import-not-at-top
  return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def scalars(results: dict) -> dict[str, float]:
  """Every task's (and group's) metric as one flat dict for metrics.jsonl and TensorBoard:
  "TASK/METRIC" (the filter appended, "TASK/METRIC/FILTER", unless it is "none"); standard
  errors and non-numbers left out."""
  values = {}
  for section in ("results", "groups"):
    for task, metrics in (results.get(section) or {}).items():
      for key, value in metrics.items():
        metric, _, kept = key.partition(",")
        if (metric.endswith("_stderr") or isinstance(value, bool)
            or not isinstance(value, (int, float)) or metric in ("sample_len", "sample_count")):
          continue
        values[f"{task}/{metric}" + ("" if kept in ("", "none") else f"/{kept}")] = float(value)
  return values
