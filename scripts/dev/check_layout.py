"""Checks the house layout: imports run one way and in no circle; modules and functions stay
small. Prints what it finds; exit status 1 when anything breaks a rule.

  python scripts/dev/check_layout.py

The direction, lowest first (a module may import its own layer and the layers below):

  sharding  <-  models  <-  toolkit's shared helpers (errors, accelerators, workdir,
  runtime, xla_flags, command_line)  <-  toolkit/data, toolkit/hf  <-  toolkit/training  <-  the other
  toolkit/<concern> subpackages (planning, pod, inference, tuning, ...; never each other)  <-
  toolkit/evaluation (the harness on the inference engine), toolkit/post_training (rollouts
  from the engine for the training step), toolkit/serving (the HTTP layer over the engine)
  <-  toolkit's commands (toolkit/*.py)  <-  experiments, scripts

Sizes: no module over 500 lines, no function over 80 lines (nested functions count towards
the function they sit in), outside tests/.

Docstrings: every package's `__init__` docstring lists its modules and subpackages, one bullet
of meaning each ("- `name`: what it is"), and nothing that is not there.

Scripts never touch sys.path: they import the installed packages.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("sharding", "models", "toolkit", "experiments", "scripts")
SHARED = {"toolkit", "toolkit.errors", "toolkit.accelerators", "toolkit.workdir",
          "toolkit.runtime", "toolkit.command_line", "toolkit.xla_flags", "toolkit.allocator"}
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80


@dataclasses.dataclass(frozen=True)
class Problem:
  rule: str
  where: str
  detail: str

  def __str__(self) -> str:
    return f"{self.rule}: {self.where}: {self.detail}"


def _relative(path: pathlib.Path) -> str:
  """`path` from the repository root it sits in (the one holding toolkit/)."""
  for parent in path.parents:
    if (parent / "toolkit").is_dir():
      return str(path.relative_to(parent))
  return str(path)


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every Python file of the packages above."""
  found = {}
  for package in PACKAGES:
    for path in sorted((root / package).rglob("*.py")):
      parts = list(path.relative_to(root).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      found[".".join(parts)] = path
  return found


def layer(module: str, known: dict[str, pathlib.Path]) -> tuple[int, str]:
  """(rank, group): a module may import ranks at or below its own; groups of rank 3 (data,
  hf) and of rank 5 (the other concern subpackages) may not import each other."""
  parts = module.split(".")
  if parts[0] == "sharding":
    return 0, "sharding"
  if parts[0] == "models":
    return 1, "models"
  if parts[0] in ("experiments", "scripts"):
    return 7, parts[0]
  if module in SHARED:
    return 2, "shared"
  package = ".".join(parts[:2])
  if len(parts) >= 2 and package in known and known[package].name == "__init__.py":
    concern = parts[1]
    # hf (the Hugging Face format) ranks with data: training's `init_from=hf:DIR` reads
    # weights through it.
    # evaluation runs the harness on inference's engine, post_training samples rollouts with
    # it for training's step and serving is the HTTP layer over it: above the other concerns.
    return {"data": (3, "data"), "hf": (3, "hf"), "training": (4, "training"),
            "evaluation": (6, "evaluation"), "post_training": (6, "post_training"),
            "serving": (6, "serving")}.get(concern, (5, concern))
  return 7, "commands"  # toolkit/<command>.py


def imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[tuple[str, int]]:
  """(imported module, line) for every import of a known module in `path`, at any depth
  (imports inside functions count: a circle through a lazy import is still a circle)."""
  tree = ast.parse(path.read_text(), str(path))
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name in known:
          found.append((alias.name, node.lineno))
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        if submodule in known:
          found.append((submodule, node.lineno))
        elif node.module in known:
          found.append((node.module, node.lineno))
  return found


def direction_problems(known: dict[str, pathlib.Path]) -> list[Problem]:
  problems = []
  for module, path in known.items():
    rank, group = layer(module, known)
    for imported, line in imports(path, known):
      other_rank, other_group = layer(imported, known)
      where = f"{_relative(path)}:{line}"
      target = _relative(known[imported])
      if other_rank > rank:
        problems.append(Problem("direction", where, f"{group} imports {other_group} ({target}); "
                                f"{other_group} sits above {group}"))
      elif other_rank == rank and rank in (3, 5) and other_group != group:
        problems.append(Problem("sideways", where, f"{group} imports {other_group} ({target}); "
                                f"subpackages of one rank never import each other"))
  return problems


def cycle_problems(known: dict[str, pathlib.Path]) -> list[Problem]:
  """Import circles (Tarjan's strongly connected components)."""
  graph = {m: sorted({i for i, _ in imports(p, known) if i != m}) for m, p in known.items()}
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def visit(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for other in graph[node]:
      if other not in index:
        visit(other)
        low[node] = min(low[node], low[other])
      elif other in on_stack:
        low[node] = min(low[node], index[other])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        components.append(sorted(component))

  sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
  for node in graph:
    if node not in index:
      visit(node)
  return [Problem("cycle", " <-> ".join(_relative(known[m]) for m in c),
                  "these modules import each other") for c in components]


def size_problems(known: dict[str, pathlib.Path]) -> list[Problem]:
  problems = []
  for path in known.values():
    text = path.read_text()
    where = _relative(path)
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
      problems.append(Problem("module size", where, f"{lines} lines > {MAX_MODULE_LINES}"))
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
          problems.append(Problem("function size", f"{where}:{node.lineno}",
                                  f"{node.name} has {length} lines > {MAX_FUNCTION_LINES}"))
  return problems


def _listed(docstring: str) -> set[str]:
  """The names a package docstring's bullets list: each bullet is "- `a`, `b`: what they are",
  its names before the first colon (a subpackage as `name/`), on one line or wrapped."""
  bullets = re.split(r"^- ", docstring, flags=re.M)[1:]
  return {name for bullet in bullets for name in re.findall(r"`(\w+/?)`", bullet.split(":")[0])}


def docstring_problems(known: dict[str, pathlib.Path]) -> list[Problem]:
  """Every package's docstring lists its modules and subpackages, and nothing else (scripts/
  is a folder of entry points, not a package of meshkit's code)."""
  problems = []
  for module, path in known.items():
    if path.name != "__init__.py" or module.split(".")[0] == "scripts":
      continue
    folder = path.parent
    present = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
    present |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    listed = _listed(ast.get_docstring(ast.parse(path.read_text())) or "")
    where = _relative(path)
    for name in sorted(present - listed):
      problems.append(Problem("docstring", where, f"`{name}` is not listed in its bullets "
                              "(\"- `name`: one line of what it is\")"))
    for name in sorted(listed - present):
      problems.append(Problem("docstring", where, f"`{name}` is listed but not in {folder.name}/"))
  return problems


def path_problems(known: dict[str, pathlib.Path]) -> list[Problem]:
  """No script edits sys.path: scripts import the installed packages (`make` installs meshkit
  editable, which puts the repository's root on the path)."""
  problems = []
  for module, path in known.items():
    if module.split(".")[0] != "scripts":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr == "path"
          and isinstance(node.value, ast.Name) and node.value.id == "sys"):
        problems.append(Problem("sys.path", f"{_relative(path)}:{node.lineno}",
                                "a script imports the installed packages; it never edits "
                                "sys.path"))
  return problems


def check(root: pathlib.Path = ROOT) -> list[Problem]:
  known = modules(root)
  return (direction_problems(known) + cycle_problems(known) + size_problems(known)
          + docstring_problems(known) + path_problems(known))


def largest(known: dict[str, pathlib.Path], count: int = 5) -> tuple[list, list]:
  """The longest modules and functions, for the report."""
  module_sizes = sorted(((len(p.read_text().splitlines()), _relative(p))
                         for p in known.values()), reverse=True)[:count]
  functions = []
  for path in known.values():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        functions.append((node.end_lineno - node.lineno + 1,
                          f"{_relative(path)}:{node.lineno} {node.name}"))
  return module_sizes, sorted(functions, reverse=True)[:count]


def main() -> int:
  known = modules()
  problems = check()
  module_sizes, function_sizes = largest(known)
  print(f"{len(known)} modules checked: imports one way, no circles, package docstrings list "
        f"their modules, modules <= "
        f"{MAX_MODULE_LINES} lines, functions <= {MAX_FUNCTION_LINES} lines")
  print("longest modules:   " + ", ".join(f"{path} ({n})" for n, path in module_sizes))
  print("longest functions: " + ", ".join(f"{where} ({n})" for n, where in function_sizes))
  for problem in problems:
    print(f"  {problem}")
  print(f"{len(problems)} problem(s)")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
