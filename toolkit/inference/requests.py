"""Generation requests as JSON: prompts files, request objects and result records, shared by
offline generation (toolkit.generate) and the server (toolkit.serve)."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os

import numpy as np

from toolkit.data import text
from toolkit.errors import ConfigError
from toolkit.inference import engine as engine_lib
from toolkit.inference.codec import BYTE_LEVEL, Codec
from toolkit.inference.sampling import RequestError, SamplingParams


def read_requests(path: str, defaults: SamplingParams, vocab_size: int,
                  codec: Codec = BYTE_LEVEL
                  ) -> tuple[list[dict], list[np.ndarray], list[SamplingParams]]:
  """Parses a prompts file (text through `codec`); every mistake is a ConfigError naming the
  file and line."""
  if not os.path.isfile(path):
    raise ConfigError(f"--prompts_file={path!r} does not exist; give a JSONL file with one "
                      f'{{"prompt": "..."}} object per line')
  lines, prompts, params = [], [], []
  for where, line in text.jsonl_lines(path):
    try:
      record = parse_json(line)
    except RequestError as e:
      raise ConfigError(f"{where} {e}") from None
    try:
      prompt = parse_prompt(record, vocab_size, codec)
      fields = {k: v for k, v in record.items() if k not in ("prompt", "tokens", "id")}
      fields.setdefault("seed", defaults.seed + len(prompts))
      params.append(codec.stop_at_eos(SamplingParams.from_dict(fields, vocab_size, defaults)))
    except RequestError as e:
      raise ConfigError(f"{where}: {e}") from None
    lines.append(record)
    prompts.append(prompt)
  if not prompts:
    raise ConfigError(f"--prompts_file={path!r} holds no prompts; give one JSON object per line")
  return lines, prompts, params


MAX_JSON_DEPTH = 32  # objects and lists inside each other; a request needs 2
_TOO_DEEP = f"is refused: JSON nested deeper than {MAX_JSON_DEPTH} levels"


def parse_json(data: str | bytes):
  """The JSON value in `data` (UTF-8 bytes or text), nested at most MAX_JSON_DEPTH deep;
  RequestError saying what is wrong otherwise."""
  try:
    value = json.loads(data)
  except json.JSONDecodeError as e:
    raise RequestError(f"is not valid JSON ({e.msg} at character {e.pos}); send one object "
                       f'such as {{"prompt": "The ", "max_tokens": 32}}') from None
  except UnicodeDecodeError as e:
    raise RequestError(f"is not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
  except RecursionError:  # deeper than the parser's own stack allows
    raise RequestError(_TOO_DEEP) from None
  except ValueError as e:  # an integer literal beyond Python's 4300 digits
    raise RequestError(f"is refused: {' '.join(str(e).split())[:120]}") from None
  if _depth(value) > MAX_JSON_DEPTH:
    raise RequestError(_TOO_DEEP)
  return value


def _depth(value) -> int:
  """How deep lists and objects nest in `value` (0 for a number or string), without
  recursion."""
  deepest, stack = 0, [(value, 1)]
  while stack:
    node, depth = stack.pop()
    if isinstance(node, dict):
      node = list(node.values())
    if isinstance(node, list):
      deepest = max(deepest, depth)
      stack.extend((child, depth + 1) for child in node if isinstance(child, (list, dict)))
  return deepest


def parse_prompt(record, vocab_size: int, codec: Codec = BYTE_LEVEL) -> np.ndarray:
  """Token ids from a request object's "prompt" (valid UTF-8 text, through `codec`: BOS first
  when the model has one) or "tokens" (ids in [0, vocab_size), taken as given)."""
  if not isinstance(record, dict):
    raise RequestError('the request must be a JSON object such as {"prompt": "The "}')
  if "prompt" not in record and "tokens" not in record:
    known = {"prompt", "tokens", "id"} | {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(record) - known)
    if unknown:  # a misspelled "prompt" is named, not reported as a missing one
      close = difflib.get_close_matches(unknown[0], ["prompt", "tokens"], n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise RequestError(f'unknown field {unknown[0]!r}{hint}; give "prompt" (text) or '
                         f'"tokens" (a list of ids)')
  if ("prompt" in record) == ("tokens" in record):
    raise RequestError('give exactly one of "prompt" (text) or "tokens" (a list of ids)')
  if "prompt" in record:
    if not isinstance(record["prompt"], str):
      raise RequestError(f'"prompt" must be a string, not {type(record["prompt"]).__name__}')
    if (problem := text.utf8_problem(record["prompt"])) is not None:
      raise RequestError(f'"prompt" is not valid UTF-8 text ({problem}); send text, or ids as '
                         f'"tokens"')
    return codec.encode(record["prompt"])
  tokens = record["tokens"]
  if not isinstance(tokens, list) or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in tokens):
    raise RequestError('"tokens" must be a list of integer token ids')
  # Checked before any conversion: an id beyond int32 must be a message, not an overflow.
  bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
  if bad is not None:
    raise RequestError(f"prompt token ids must be in [0, {vocab_size}); got {bad}")
  return np.asarray(tokens, np.int32)


def result_record(result: engine_lib.Result, request: dict | None = None,
                  codec: Codec = BYTE_LEVEL) -> dict:
  record = {"completion": codec.decode(result.tokens), "tokens": result.tokens,
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.tokens)}
  if request is not None and "id" in request:
    record = {"id": request["id"], **record}
  return record


def sampling_defaults(max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                      stop_tokens: list[str]) -> SamplingParams:
  try:
    stop = tuple(int(t) for t in stop_tokens)
  except ValueError:
    raise ConfigError(f"--stop_tokens={','.join(stop_tokens)}: give integer token ids, e.g. "
                      f"--stop_tokens=10") from None
  return dataclasses.replace(SamplingParams(), max_tokens=max_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop)
