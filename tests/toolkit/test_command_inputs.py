"""Inputs that once ended in a traceback in the commands other than toolkit.train's config
mistakes (tests/toolkit/test_cli.py has those): each is one `error:` line, exit 1."""
from __future__ import annotations

import concurrent.futures
import subprocess

import pytest

from tests import preloaded
from tests.toolkit.test_cli import MISTAKE_TIMEOUT_S, TINY, _env, the_error_line

# (id, command after `python -m`, extra environment, the error line)
CASES = [
    ("generate_prompt_not_utf8",
     ["toolkit.generate", TINY, "--checkpoint={T}/none", b"--prompt=ab\xff"], {},
     "error: --prompt is not valid UTF-8 text (byte 0xff at character 2 is not UTF-8); give the "
     "prompt in UTF-8"),
    ("sample_prompt_not_utf8", ["toolkit.sample", "--workdir={T}", b"--prompt=\xfe"], {},
     "error: --prompt is not valid UTF-8 text (byte 0xfe at character 0 is not UTF-8); give the "
     "prompt in UTF-8"),
    ("train_sample_prompt_not_utf8",
     ["toolkit.train", TINY, "--workdir={T}/w", b"--config.train.sample_prompt=x\xff"], {},
     "error: train.sample_prompt is not valid UTF-8 text (byte 0xff at character 1 is not "
     "UTF-8); give the prompt in UTF-8"),
    # toolkit.train checks the plugin before JAX starts (issue 62: JAX skips a missing `cuda`
    # in JAX_PLATFORMS=cuda,cpu and runs on the CPU).
    ("train_platform_absent", ["toolkit.train", TINY, "--workdir={T}/w"],
     {"JAX_PLATFORMS": "cuda"},
     "error: JAX_PLATFORMS='cuda' asks for GPU devices, but JAX's CUDA plugin is not installed "
     "here, so the run would be on the CPU; unset JAX_PLATFORMS to use the devices this machine "
     "has, or install the plugin on a GPU machine (pip install 'jax[cuda12]')"),
    ("generate_platform_absent",
     ["toolkit.generate", TINY, "--checkpoint={T}/none", "--prompt=a"], {"JAX_PLATFORMS": "cuda"},
     "error: JAX_PLATFORMS='cuda' asks for a platform JAX cannot start here"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
  """All cases, a few at a time (each a short process; those that set JAX_PLATFORMS start a
  new interpreter, tests/preloaded.py)."""
  folder = tmp_path_factory.mktemp("inputs")

  def run(case):
    name, (module, *args), env, _ = case
    args = [a.replace("{T}", str(folder)) if isinstance(a, str)
            else a.replace(b"{T}", str(folder).encode()) for a in args]
    return name, preloaded.run(module, args, env={**_env(), **env}, text=False,
                               timeout=MISTAKE_TIMEOUT_S)

  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    return dict(pool.map(run, CASES))


@pytest.mark.parametrize("name, expected", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line(results, name, expected):
  result = results[name]
  result = subprocess.CompletedProcess(result.args, result.returncode,
                                       result.stdout.decode(errors="replace"),
                                       result.stderr.decode(errors="replace"))
  line = the_error_line(result)
  assert result.returncode == 1
  assert line.startswith(expected), line
