"""Every command the docs show, extracted, so that a test runs them as pasted.

  python scripts/dev/doc_commands.py          # list them: where, then the command

Where commands are found:
  - README.md and docs/*.md: fenced blocks. A block tagged `python` is one snippet; in any
    other block every line that starts a command (python, make, curl, pip, or NAME=VALUE
    before one) is a command, and lines ending in a backslash continue it. Other lines
    (output such as `error: ...`) are not commands.
  - The module docstrings of experiments/*.py, toolkit/*.py and scripts/*/*.py: indented lines
    that start a command, with the same continuation rule.

tests/test_doc_commands.py runs each one (short step counts where a flag allows it, a
reviewed skip list with a reason each), so the docs cannot drift from the code.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
# python/make/curl/pip, maybe after NAME=VALUE settings (alone on a line when it continues).
_STARTS = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python|make|curl|pip)\b|^(?:[A-Z_]+=\S+\s*)+\\$")
_FENCE = re.compile(r"^\s*```(\w*)\s*$")


@dataclasses.dataclass(frozen=True)
class DocCommand:
  where: str   # "docs/data.md:12": the file and the line the command starts on
  text: str    # as pasted, continuation lines kept
  kind: str    # "shell" or "python" (a snippet)
  block: int   # commands of one fenced block or docstring share it (a server and its clients)


def _commands_in_lines(lines: list[tuple[int, str]], where: str, block: int,
                       indented_only: bool) -> list[DocCommand]:
  found, current, start = [], [], 0
  for number, line in lines:
    if current:
      current.append(line)
    else:
      stripped = line.strip()
      if indented_only and not line.startswith("  "):
        continue
      if not _STARTS.match(stripped):
        continue
      current, start = [line], number
    if not line.rstrip().endswith("\\"):
      found.append(DocCommand(f"{where}:{start}", _dedent(current), "shell", block))
      current = []
  return found


def _dedent(lines: list[str]) -> str:
  indent = len(lines[0]) - len(lines[0].lstrip())
  return "\n".join(line[indent:] if line[:indent].isspace() else line.strip()
                   for line in lines).rstrip()


def from_markdown(path: pathlib.Path, first_block: int = 0) -> list[DocCommand]:
  """The commands of one Markdown file's fenced blocks."""
  where = str(path.relative_to(ROOT))
  found, block_lines, language, block = [], None, "", first_block
  for number, line in enumerate(path.read_text().splitlines(), start=1):
    fence = _FENCE.match(line)
    if fence and block_lines is None:
      block_lines, language, start = [], fence.group(1), number + 1
    elif fence:
      block += 1
      if language == "python":
        text = "\n".join(text for _, text in block_lines)
        found.append(DocCommand(f"{where}:{start}", text, "python", block))
      else:
        found.extend(_commands_in_lines(block_lines, where, block, indented_only=False))
      block_lines = None
    elif block_lines is not None:
      block_lines.append((number, line))
  return found


def from_docstring(path: pathlib.Path, first_block: int = 0) -> list[DocCommand]:
  """The commands of one Python module's docstring."""
  tree = ast.parse(path.read_text())
  docstring = ast.get_docstring(tree, clean=False)
  if not docstring or not tree.body:
    return []
  first_line = tree.body[0].lineno  # the docstring's opening quotes
  lines = list(enumerate(docstring.splitlines(), start=first_line))
  return _commands_in_lines(lines, str(path.relative_to(ROOT)), first_block + 1,
                            indented_only=True)


def all_commands(root: pathlib.Path = ROOT) -> list[DocCommand]:
  """README.md, docs/*.md, then the docstrings of experiments/, toolkit/ and scripts/."""
  found: list[DocCommand] = []
  sources = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
  for pattern in ("experiments/*.py", "toolkit/*.py", "scripts/*/*.py"):
    sources += sorted(root.glob(pattern))
  for path in sources:
    block = found[-1].block if found else 0
    found += from_markdown(path, block) if path.suffix == ".md" else from_docstring(path, block)
  return found


def main() -> None:
  for command in all_commands():
    print(f"{command.where}  [{command.kind}]")
    print("    " + command.text.replace("\n", "\n    "))


if __name__ == "__main__":
  main()
