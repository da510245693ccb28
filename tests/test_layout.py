"""The house layout holds: imports run one way (sharding <- models <- toolkit's shared helpers
<- data <- training <- the concern subpackages <- commands <- experiments, scripts), in no
circle, and modules and functions stay small (scripts/dev/check_layout.py)."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

from scripts.dev import check_layout

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_repository_keeps_its_layout():
  problems = check_layout.check(REPO)
  assert not problems, "\n".join(map(str, problems))


def test_the_script_reports_and_exits_zero():
  done = subprocess.run([sys.executable, "scripts/dev/check_layout.py"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "0 problem(s)" in done.stdout and "longest functions:" in done.stdout


def _tree(root: pathlib.Path, files: dict[str, str], docstrings: bool = True) -> pathlib.Path:
  """A repository of `files`; with `docstrings`, each empty package `__init__` lists its
  modules as the layout wants, so that only the rule a test is about finds anything."""
  for name in ("sharding", "models", "toolkit", "experiments", "scripts"):
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "__init__.py").touch()
  for path, text in files.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(textwrap.dedent(text))
  for init in root.rglob("__init__.py") if docstrings else ():
    if not init.read_text():
      names = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"]
      names += [f"{p.name}/" for p in init.parent.iterdir() if (p / "__init__.py").exists()]
      init.write_text('"""A package.\n\n' + "".join(f"- `{n}`: a part.\n" for n in names)
                      + '"""\n')
  return root


def _rules(problems) -> set[tuple[str, str]]:
  return {(p.rule, p.where.split(":")[0]) for p in problems}


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
  root = _tree(tmp_path, {
      "toolkit/training/__init__.py": "",
      "toolkit/training/a.py": "from toolkit.training import b\n",
      "toolkit/training/b.py": "def f():\n  from toolkit.training import a\n",
  })
  problems = check_layout.check(root)
  assert [p.rule for p in problems] == ["cycle"]
  assert "toolkit/training/a.py" in problems[0].where
  assert "toolkit/training/b.py" in problems[0].where


def test_imports_against_the_direction_and_sideways_are_found(tmp_path):
  root = _tree(tmp_path, {
      "toolkit/errors.py": "",
      "toolkit/data/__init__.py": "",
      "toolkit/data/text.py": "from toolkit.training import loop\n",      # data -> training
      "toolkit/training/__init__.py": "",
      "toolkit/training/loop.py": "from toolkit.errors import ConfigError\n",  # fine
      "toolkit/planning/__init__.py": "",
      "toolkit/planning/aot.py": "import toolkit.inference.engine\n",          # sideways
      "toolkit/inference/__init__.py": "",
      "toolkit/inference/engine.py": "from toolkit import train\n",       # up to a command
      "toolkit/hf/__init__.py": "",
      "toolkit/hf/reader.py": "from toolkit.data import text\n",         # sideways at rank 3
      "toolkit/training/setup.py": "from toolkit.hf import reader\n",    # fine: hf is below
      "toolkit/train.py": "from toolkit.training import loop\n",          # fine
      "models/llama.py": "from toolkit.errors import ConfigError\n",      # models -> toolkit
  })
  assert _rules(check_layout.check(root)) == {
      ("direction", "toolkit/data/text.py"), ("sideways", "toolkit/planning/aot.py"),
      ("direction", "toolkit/inference/engine.py"), ("direction", "models/llama.py"),
      ("sideways", "toolkit/hf/reader.py")}


def test_a_package_docstring_must_list_its_modules_and_nothing_else(tmp_path):
  root = _tree(tmp_path, {
      "toolkit/__init__.py": '"""Commands.\n\n- `train`: the command;\n- `data/`: inputs."""\n',
      "toolkit/train.py": "",
      "toolkit/errors.py": "",                                 # not listed
      "toolkit/data/__init__.py": '"""Data.\n\n- `text`,\n  `gone`: batches."""\n',
      "toolkit/data/text.py": "",                              # listed on a wrapped bullet
      "toolkit/data/images/__init__.py": '"""Images.\n\n- `reader`: files."""\n',
      "toolkit/data/images/reader.py": "",
  }, docstrings=False)
  found = sorted((p.where, p.detail.split()[0]) for p in check_layout.check(root)
                 if p.rule == "docstring")
  assert found == [("toolkit/__init__.py", "`errors`"), ("toolkit/data/__init__.py", "`gone`"),
                   ("toolkit/data/__init__.py", "`images/`")]


def test_a_script_that_edits_sys_path_is_found(tmp_path):
  root = _tree(tmp_path, {
      "scripts/bench/run.py": "import sys\nsys.path.insert(0, '..')\nprint(sys.argv)\n",
      "scripts/launch/go.py": "import sys\nprint(sys.argv)\n",             # fine
  })
  assert _rules(check_layout.check(root)) == {("sys.path", "scripts/bench/run.py")}


def test_long_modules_and_functions_are_found(tmp_path):
  body = "\n".join(f"  x{i} = {i}" for i in range(85))
  root = _tree(tmp_path, {
      "toolkit/long_function.py": f"def f():\n{body}\n",
      "toolkit/long_module.py": "\n".join(f"y{i} = {i}" for i in range(501)) + "\n",
  })
  found = {(p.rule, p.where.split(":")[0]) for p in check_layout.check(root)}
  assert found == {("function size", "toolkit/long_function.py"),
                   ("module size", "toolkit/long_module.py")}
