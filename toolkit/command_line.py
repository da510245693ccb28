"""Command-line mistakes as one line each.

absl and ml_collections report flag mistakes as tracebacks or multi-line "FATAL" blocks. The
helpers here turn each into one `error:` line naming the flag and the fix; every entry point
(`toolkit.train`, `toolkit.sample`, ...) parses its flags through `parse_flags`.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
import traceback
import logging as std_logging

import ml_collections

from toolkit import runtime
from toolkit.errors import ConfigError


USAGE_EXIT = 2  # a mistake on the command line, found before anything ran


def fail(message: str, exit_code: int = 1, now: bool = False) -> None:
  """Prints `message` as one `error:` line and exits. `now` exits without waiting for other
  threads: after a storage failure Orbax leaves threads that wait minutes for files that will
  never appear, and the interpreter would wait for them (everything the run wrote is already
  closed by then)."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  if now:
    sys.stdout.flush()
    os._exit(exit_code)  # pylint: disable=protected-access
  sys.exit(exit_code)


def config_argument(argv: list[str]) -> str | None:
  """The text given to --config (the last one wins, as in absl), or None."""
  value = None
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    match = re.fullmatch(r"--?config(?:=(.*))?", arg, re.S)
    if match:
      value = match.group(1) if match.group(1) is not None else (
          argv[i + 1] if i + 1 < len(argv) else "")
  return value


def _override_paths(argv: list[str]) -> list[tuple[str, str]]:
  """(flag as typed, dotted field path) for each --config.FIELD override, in order."""
  found = []
  for arg in argv:
    if arg == "--":
      break
    match = re.match(r"(--?(?:no)?config\.([^=]*))", arg)
    if match:
      found.append((match.group(1), match.group(2)))
  return found


def override_fields(argv: list[str]) -> list[str]:
  """The dotted fields that --config.FIELD flags in `argv` set."""
  return [path for _, path in _override_paths(argv)]


def _unknown_field(config: ml_collections.ConfigDict, flag: str, path: str) -> str | None:
  """Why `path` names no field of `config` (with the fields it could be), or None."""
  node, parents = config, ["config"]
  for key in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict):
      return (f"{flag}: config.{'.'.join(parents[1:])} is a value, not a section; override it "
              f"as --{'.'.join(parents)}=VALUE")
    if key not in node:
      known = sorted(node.keys())
      close = difflib.get_close_matches(key, known, n=1)
      hint = f"did you mean --{'.'.join(parents)}.{close[0]}? " if close else ""
      return (f"{flag}: {'.'.join(parents)} has no field {key!r}; {hint}known: "
              f"{', '.join(known)}")
    node, parents = node[key], parents + [key]
  return None


def _field_value(config: ml_collections.ConfigDict, path: str):
  for key in path.split("."):
    config = config[key]
  return config


def _load_experiment(config_arg: str):
  """get_config() of `path[:arg]`, as config_flags calls it; only used to explain an error."""
  path, *arg = config_arg.split(":", 1)
  spec = importlib.util.spec_from_file_location("_experiment_for_error", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(f"{path} defines no get_config(arg=None); add one that returns an "
                      f"ml_collections.ConfigDict")
  return module.get_config(*arg)


def explain_flag_error(error: Exception, argv: list[str]) -> str:
  """One line for an exception raised while absl parsed the command line."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  config_arg = config_argument(argv)
  overrides = _override_paths(argv)
  config = None
  if config_arg is None:
    if overrides:
      return (f"{overrides[0][0]} needs --config before it; give e.g. "
              f"--config=experiments/lm.py:tiny {overrides[0][0]}=...")
  else:
    config_index = max(i for i, arg in enumerate(argv) if re.match(r"--?config(=|$)", arg))
    early = [arg for arg in argv[:config_index] if re.match(r"--?(no)?config\.", arg)]
    if early:
      return (f"{early[0]} comes before --config; give --config={config_arg} first, then the "
              f"--config.FIELD overrides")
    config_path = config_arg.split(":", 1)[0]
    if not os.path.isfile(config_path) or not config_path.endswith(".py"):
      return missing_config_file(config_arg)
    # Loading the experiment again (it has no side effects) gives its own exception, where
    # config_flags wraps it with a traceback in the text or lets it escape.
    try:
      config = _load_experiment(config_arg)
    except Exception as load_error:  # pylint: disable=broad-except
      return _experiment_error(config_arg, config_path, load_error)
    if config is None:  # then an override fails on it, far from the cause
      return returned_none(config_arg)
    if isinstance(config, ml_collections.ConfigDict):
      for flag, path in overrides:
        reason = _unknown_field(config, flag, path)
        if reason:
          return reason
  if isinstance(error, flags.UnrecognizedFlagError):
    close = difflib.get_close_matches(error.flagname, list(flags.FLAGS), n=1)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return f"unknown flag --{error.flagname}{hint} (see --help for the flags)"
  match = re.match(r"flag --([^=]+)=(.*?): (.*)", str(error), re.S)
  if isinstance(error, flags.IllegalFlagValueError) and match:
    name, value, reason = match.groups()
    reason = reason.strip().splitlines()[0] if reason.strip() else "invalid value"
    if name.startswith("config.") and isinstance(config, ml_collections.ConfigDict):
      field = name[len("config."):]
      current = _field_value(config, field)  # exists: unknown fields were reported above
      if isinstance(current, ml_collections.ConfigDict):
        return (f"--{name}={value}: config.{field} is a section; override one of its fields, "
                f"e.g. --{name}.{sorted(current.keys())[0]}=...")
      if isinstance(current, bool):
        return (f"--{name}={value}: config.{field} is a bool; give true or false, e.g. "
                f"--{name}={str(not current).lower()}")
      return (f"--{name}={value}: {reason}; config.{field} is of type "
              f"{type(current).__name__} ({current!r} in {config_arg}), give e.g. "
              f"--{name}={current}")
    return f"--{name}={value}: {reason}"
  first = str(error).strip().splitlines()[0] if str(error).strip() else ""
  missing = re.fullmatch(r"Missing value for flag (-\S+)", first)
  if missing:
    return f"{missing.group(1)} needs a value; write {missing.group(1)}=VALUE"
  if not isinstance(error, flags.Error):
    first = f"{type(error).__name__}: {first}"
  return f"{first} (see --help for the flags)"


def missing_config_file(config_arg: str) -> str:
  path = config_arg.split(":", 1)[0]
  if not path:
    return "--config is empty; give an experiment file, e.g. --config=experiments/lm.py:tiny"
  if os.path.exists(path) and not os.path.isdir(path) and not path.endswith(".py"):
    return (f"--config={config_arg}: {path} is not a Python file; give an experiment file (a "
            f".py with get_config), e.g. --config=experiments/lm.py:tiny")
  if os.path.isfile(path):
    return (f"--config={config_arg}: {path} did not load (unreadable, or get_config() returned "
            f"no ConfigDict); fix the experiment file")
  where = "is a directory" if os.path.isdir(path) else "does not exist"
  return (f"--config={config_arg}: the experiment file {path} {where} (relative to "
          f"{os.getcwd()}); give e.g. --config=experiments/lm.py:tiny")


def returned_none(config_arg: str) -> str:
  path = config_arg.split(":", 1)[0]
  return (f"--config={config_arg}: get_config() in {path} returned None, not an "
          f"ml_collections.ConfigDict (a missing return statement?); end get_config with "
          f"`return config`")


def _experiment_error(config_arg: str, config_path: str, error: BaseException) -> str:
  """The experiment's own message for get_config failing; its location if it is not a
  ValueError (then it is more likely a bug in the file than a bad variant)."""
  message = str(error).strip() or type(error).__name__
  for prefix in (f"{config_path}: ", f"{os.path.basename(config_path)}: "):
    message = message.removeprefix(prefix)
  if isinstance(error, SyntaxError):
    message = (f"SyntaxError at {config_path}:{error.lineno}: {error.msg}; fix the experiment "
               f"file")
  elif not isinstance(error, ValueError):
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.exists(f.filename) and os.path.samefile(f.filename, config_path)]
    where = f" at {config_path}:{frames[-1].lineno}" if frames else ""
    message = f"{type(error).__name__}{where}: {message}; fix the experiment file"
  return f"--config={config_arg}: {message}"


def parse_flags(argv: list[str], config_flag=None, required: dict[str, str] | None = None,
                commands: tuple[str, ...] = (), config_required: bool = True) -> list[str]:
  """absl's flag parsing with every mistake as one line and exit code USAGE_EXIT.

  Args:
    argv: the command line.
    config_flag: the holder from `config_flags.DEFINE_config_file`, when the entry point has
      one; it is then required unless `config_required` is False.
    required: flag name -> what to give, for the other required flags.
    commands: the subcommands (`toolkit.convert import|export`): exactly one must be given,
      as the one positional argument; it is returned after argv[0].
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  help_for_console_script(argv)
  # absl's own parser prints "FATAL Flags parsing error" blocks and lets some config_flags
  # exceptions escape as tracebacks; every one of them becomes one line here.
  absl_logger = std_logging.getLogger("absl")
  absl_logger.addFilter(_drop_config_flags_records)
  try:
    rest = flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except  # incl. a broken experiment file
    fail(explain_flag_error(e, argv), USAGE_EXIT)
  finally:
    absl_logger.removeFilter(_drop_config_flags_records)
  if commands and (len(rest) != 2 or rest[1] not in commands):
    given = f"got {' '.join(rest[1:])!r}" if len(rest) > 1 else "none given"
    fail(f"give one command first, {' or '.join(commands)} ({given}); see --help",
         USAGE_EXIT)
  elif not commands and len(rest) > 1:
    fail(f"unexpected arguments {' '.join(rest[1:])!r}; flags take the form --name=value "
         f"(see --help)", USAGE_EXIT)
  if config_flag is not None:
    config_arg = config_argument(argv)
    if config_arg is None:
      if config_required:
        fail("--config is required; give an experiment file and variant, e.g. "
             "--config=experiments/lm.py:tiny", USAGE_EXIT)
    elif config_flag.value is None:
      fail(returned_none(config_arg), USAGE_EXIT)
    elif not isinstance(config_flag.value, ml_collections.ConfigDict):
      # config_flags defers a file that failed to load (missing, unreadable) to first use.
      fail(missing_config_file(config_arg), USAGE_EXIT)
  for name, what in (required or {}).items():
    if flags.FLAGS[name].value is None:
      fail(f"--{name} is required; give {what}", USAGE_EXIT)
  return rest


def help_for_console_script(argv: list[str]) -> None:
  """--help of `meshkit-train` & co.: absl lists the flags of the module named by argv[0],
  which for a console script is the launcher in .venv/bin, defining none; list the command
  module's flags instead (toolkit.train for meshkit-train), and exit as absl's --help does."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  name = os.path.basename(argv[0])
  wants_help = any(arg in ("--help", "-help", "-h", "-?", "--helpshort") for arg in argv[1:])
  if not name.startswith("meshkit-") or not wants_help:
    return
  module = f"toolkit.{name.removeprefix('meshkit-')}"
  doc = (sys.modules[module].__doc__ or "").strip() if module in sys.modules else ""
  print(f"{doc}\n\nUSAGE: {name} [flags]\n\nflags:\n{flags.FLAGS.module_help(module)}\n\n"
        f"Try --helpfull to get a list of all flags.")
  sys.exit(1)


# The accelerator platforms JAX_PLATFORMS may name, by the platform their devices report.
_ACCELERATORS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}


def _requested_accelerators() -> set[str]:
  """The accelerators (gpu, tpu) JAX_PLATFORMS or jax_platforms names."""
  import jax  # pylint: disable=g-import-not-at-top
  requested = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
  return {_ACCELERATORS[p] for p in requested.lower().replace(" ", "").split(",")
          if p in _ACCELERATORS}


def check_platform_plugin() -> None:
  """Before JAX starts: one `error:` line when JAX_PLATFORMS names a GPU platform and JAX's
  CUDA plugin is not installed (`check_platform` checks the devices themselves, later)."""
  if "gpu" in _requested_accelerators() and not runtime.cuda_plugin_installed():
    fail(f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r} asks for GPU devices, but "
         "JAX's CUDA plugin is not installed here, so the run would be on the CPU; unset "
         "JAX_PLATFORMS to use the devices this machine has, or install the plugin on a GPU "
         "machine (pip install 'jax[cuda12]')")


def check_platform() -> None:
  """One `error:` line when JAX cannot start the platform the environment asks for: with
  JAX_PLATFORMS=cuda on a machine without a GPU (or without JAX's CUDA plugin) JAX ends in a
  bare AssertionError, and with JAX_PLATFORMS=cuda,cpu (a SLURM job's setting) it skips the
  missing `cuda` and runs on the CPU. So an accelerator the setting names must be the one the
  devices are on. Call it after joining other processes (`jax.distributed`), which must come
  before JAX starts its devices."""
  import jax  # pylint: disable=g-import-not-at-top
  requested = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
  fix = ("unset JAX_PLATFORMS to use the devices this machine has, or install that platform's "
         "JAX plugin on a machine that has it (e.g. pip install 'jax[cuda12]')")
  try:
    platform = jax.devices()[0].platform
  except (RuntimeError, AssertionError) as e:
    detail = str(e).strip().splitlines()[0] if str(e).strip() else (
        "its devices or its JAX plugin are missing")
    fail(f"JAX_PLATFORMS={requested!r} asks for a platform JAX cannot start here ({detail}); "
         f"{fix}")
  named = _requested_accelerators()
  if named and _ACCELERATORS.get(platform, platform) not in named:
    fail(f"JAX_PLATFORMS={requested!r} asks for {' or '.join(sorted(named))} devices, but JAX "
         f"found none and would run on the {platform.upper()} (its plugin or its devices are "
         f"missing here); {fix}")


def quiet_logging() -> None:
  """Orbax logs every save at INFO: show warnings only, unless -v/--verbosity was given.

  Orbax also logs each failure of a save or restore at ERROR, with its traceback, from every
  thread it passes through (hundreds of lines for one full disk) before raising it; the
  command reports what it raises in one line, so those records are dropped too."""
  from absl import flags, logging  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
    # tensorboardX warns per NaN scalar; the loop's own non-finite check says it in one line.
    std_logging.getLogger("tensorboardX").setLevel(std_logging.ERROR)
    std_logging.getLogger("absl").addFilter(_drop_orbax_errors)
    std_logging.getLogger("asyncio").addFilter(_drop_unretrieved_orbax_tasks)
    sys.unraisablehook = _without_late_io_callbacks(sys.unraisablehook)


def define_runtime_flags():
  """The flag every command that runs JAX shares: where its compiled programs are cached."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return flags.DEFINE_string(
      "compilation_cache", runtime.default_cache_dir(),
      "Folder of JAX's persistent compilation cache: a restart loads the compiled step from it "
      "instead of compiling again. --compilation_cache=off turns it off.")


def _drop_config_flags_records(record: std_logging.LogRecord) -> bool:
  """ml_collections' config_flags logs what it finds wrong with an experiment file (get_config()
  returned None; a failed load) through absl while the flags are parsed, which also prints
  absl's "Logging before flag parsing" line: parse_flags reports the same in its one line."""
  return os.path.basename(record.pathname or "") != "config_flags.py"


def _drop_orbax_errors(record: std_logging.LogRecord) -> bool:
  return not (record.levelno >= std_logging.ERROR
              and f"{os.sep}orbax{os.sep}" in (record.pathname or ""))


def _drop_unretrieved_orbax_tasks(record: std_logging.LogRecord) -> bool:
  """asyncio's "Task exception was never retrieved" for a task of Orbax's that failed on the
  disk (a full disk during a save): Orbax raises the same failure, which the command reports
  in one line; the record would print its traceback (~18 lines) before that line."""
  error = record.exc_info[1] if record.exc_info else None
  if not str(record.msg).startswith("Task exception was never retrieved") or error is None:
    return True
  frames = traceback.extract_tb(error.__traceback__)
  return not any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames)


def _without_late_io_callbacks(hook):
  """sys.unraisablehook `hook`, except for one harmless race: when a save fails, TensorStore
  may complete an outstanding write after Orbax closed the event loop waiting for it; its
  callback's "Event loop is closed" would be printed as a bare traceback."""
  def filtered(unraisable):
    frames = traceback.extract_tb(unraisable.exc_traceback)
    if (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
        and frames and frames[0].name == "call_soon_threadsafe"):
      return
    hook(unraisable)
  return filtered
