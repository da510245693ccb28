"""The data of the example local evaluation tasks in experiments/eval_tasks/ (docs/evaluation.md):
small sums and differences, written as JSONL, the same every time (a fixed seed; no
download). The files in experiments/eval_tasks/ are this script's output with its default
--out (tests/scripts/test_eval_task_data.py checks they still are); elsewhere:

  python scripts/data/eval_task_data.py --out=/tmp/eval_tasks

arithmetic_choice.jsonl  {"question": "7 + 5", "choices": ["12", "11", "13", "2"], "answer": 0}
                         four choices, one right (multiple_choice: the log-likelihood of each)
arithmetic_answer.jsonl  {"question": "7 + 5", "answer": "12"}  (generate_until: exact match)
"""
from __future__ import annotations

import json
import os
import random

EXAMPLES = 40


def _question(rng: random.Random) -> tuple[str, int]:
  a, b = rng.randint(1, 20), rng.randint(1, 20)
  if rng.random() < 0.5:
    return f"{a} + {b}", a + b
  a, b = max(a, b), min(a, b)
  return f"{a} - {b}", a - b


def choice_examples(count: int = EXAMPLES, seed: int = 0) -> list[dict]:
  """`count` questions, each with the right answer among three wrong ones near it."""
  rng = random.Random(seed)
  examples = []
  for _ in range(count):
    question, value = _question(rng)
    wrong = rng.sample(sorted({value + d for d in (-10, -2, -1, 1, 2, 10)} - {value}), 3)
    choices = [str(v) for v in [value, *wrong]]
    rng.shuffle(choices)
    examples.append({"question": question, "choices": choices,
                     "answer": choices.index(str(value))})
  return examples


def answer_examples(count: int = EXAMPLES, seed: int = 1) -> list[dict]:
  rng = random.Random(seed)
  return [{"question": q, "answer": str(v)} for q, v in (_question(rng) for _ in range(count))]


def files() -> dict[str, str]:
  """File name -> its text."""
  lines = lambda examples: "".join(json.dumps(e) + "\n" for e in examples)
  return {"arithmetic_choice.jsonl": lines(choice_examples()),
          "arithmetic_answer.jsonl": lines(answer_examples())}


def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  out = flags.DEFINE_string("out", "experiments/eval_tasks", "Folder for the JSONL files.")

  def run(argv) -> None:
    del argv
    os.makedirs(out.value, exist_ok=True)
    for name, text in files().items():
      with open(os.path.join(out.value, name), "w", encoding="utf-8") as f:
        f.write(text)
      print(f"wrote {os.path.join(out.value, name)} ({text.count(chr(10))} examples)")

  app.run(run)


if __name__ == "__main__":
  main()
