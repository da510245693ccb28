"""OpenAI's completions and chat completions as data: request bodies checked and turned into
engine requests, and the response, chunk and error objects, in the shapes the official
`openai` client parses (openai/types/completion.py, chat/chat_completion{,_chunk}.py).

No HTTP here: toolkit/serving/openai_api.py serves these over aiohttp.

Fields (`POST /v1/completions`, `POST /v1/chat/completions`):
  model             the served model's name (GET /v1/models); another name is a 404
  prompt            completions: text, a list of texts, token ids, or a list of token-id lists
  messages          chat: [{"role": system | developer | user | assistant, "content": text or
                    [{"type": "text", "text": ...}], "name"?}], rendered by the chat template
  max_tokens        (chat also max_completion_tokens) new tokens per choice; default the
                    server's --max_tokens, cut to what the context leaves
  temperature       [0, 2], top_p (0, 1], seed [0, 2**32); omitted: the server's flags, and a
                    random seed per choice (choice i of n draws with seed + i when given)
  n                 choices per prompt; prompts x n <= MAX_CHOICES
  stop              up to 4 strings, matched on the decoded text (OpenAI's `stop` takes strings
                    only): the text ends before the first one, finish_reason "stop"
  stream, stream_options.include_usage
Extensions, with vLLM's names: top_k, stop_token_ids (ids that end a choice), ignore_eos.
Accepted and ignored: user, metadata, store, service_tier, parallel_tool_calls,
prompt_cache_key, safety_identifier. Refused with a 400 unless left at their defaults:
logprobs, top_logprobs, echo, best_of, suffix, logit_bias, frequency/presence penalties,
tools and functions, response_format other than text, audio, prediction. Any other field is a
400, as OpenAI answers it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from toolkit.data import text as text_data
from toolkit.data.chat_template import ChatTemplate, ChatTokenizer
from toolkit.errors import ConfigError
from toolkit.inference.codec import Codec
from toolkit.inference.sampling import CANDIDATES, RequestError, SamplingParams

MAX_CHOICES = 64       # prompts x n in one request: each choice is one engine request
MAX_STOP_STRINGS = 4   # as OpenAI
MAX_STOP_CHARS = 256   # per stop string: the stream holds back up to this many characters
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "developer", "user", "assistant")
# A plain template for models without one of their own (byte-level models): "role: content"
# lines, then "assistant:" for the model to continue.
DEFAULT_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: "
                         "{{ message['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")

_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls",
            "prompt_cache_key", "safety_identifier"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stop_token_ids", "ignore_eos", "stream", "stream_options"}
# field -> values that leave it off (anything else asks for what this server does not do)
_OFF = {"logprobs": (None, False), "top_logprobs": (None,), "echo": (None, False),
        "best_of": (None, 1), "suffix": (None,), "logit_bias": (None, {}),
        "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "tools": (None, []),
        "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
        "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
        "audio": (None,), "prediction": (None,), "web_search_options": (None,),
        "reasoning_effort": (None,), "verbosity": (None,)}
_COMPLETION_OFF = ("logprobs", "echo", "best_of", "suffix", "logit_bias", "frequency_penalty",
                   "presence_penalty")
_COMPLETION_FIELDS = _COMMON | _IGNORED | {"prompt"} | set(_COMPLETION_OFF)
_CHAT_FIELDS = _COMMON | _IGNORED | {"messages", "max_completion_tokens"} | (
    set(_OFF) - {"echo", "best_of", "suffix"})
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 405: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error",
          504: "server_error"}


class OpenAIError(Exception):
  """A request answered with an error: the HTTP status and OpenAI's error object."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                      "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ModelContext:
  """What parsing needs to know about the served model."""
  name: str
  vocab_size: int
  max_model_len: int                   # prompt + max_tokens must fit
  defaults: SamplingParams             # the server's sampling flags
  codec: Codec                         # prompt text in, completion text out, EOS ids
  encode_chat: Callable[[list[dict]], np.ndarray]  # messages -> prompt ids (the template)
  draw_seed: Callable[[], int]         # a random seed in [0, 2**32)
  end_of_turn: tuple[int, ...] = ()    # ends a chat answer: the template's end-of-turn token
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass(frozen=True)
class Job:
  """One request, checked: choice c continues prompts[c // n] with params[c]."""
  chat: bool
  model: str
  prompts: list[np.ndarray]
  n: int
  params: list[SamplingParams]
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool

  def prompt_of(self, choice: int) -> np.ndarray:
    return self.prompts[choice // self.n]


# --- field checks ------------------------------------------------------------------------------

def _bad(message: str, param: str | None, code: str | None = None) -> OpenAIError:
  return OpenAIError(400, message, param, code)


def _show(value) -> str:
  """A value for an error message, cut short (a request may send a megabyte in one field)."""
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, low: int, high: int | None = None) -> int | None:
  value = body.get(name)
  if value is not None and not (_is_int(value) and low <= value and (high is None or
                                                                      value <= high)):
    bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
    raise _bad(f"'{name}' must be an integer {bounds}; got {_show(value)}", name)
  return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False
            ) -> float | None:
  value = body.get(name)
  if value is None:
    return None
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        and (low < value if low_open else low <= value) and value <= high)
  if not ok:
    bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    raise _bad(f"'{name}' must be a number in {bounds}; got {_show(value)}", name)
  return float(value)


def _bool(body: dict, name: str, container: str = "") -> bool:
  value = body.get(name)
  if value is not None and not isinstance(value, bool):
    raise _bad(f"'{container}{name}' must be true or false; got {_show(value)}",
               container + name)
  return bool(value)


def _is_off(value, offs: tuple) -> bool:
  """Whether `value` is one of `offs` (False is not 0 here, nor True 1)."""
  for off in offs:
    if off is None or isinstance(off, bool):
      found = value is off
    elif isinstance(off, (int, float)):
      found = isinstance(value, (int, float)) and not isinstance(value, bool) and value == off
    else:
      found = value == off
    if found:
      return True
  return False


def _check_fields(body, allowed: set[str]) -> None:
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object", None)
  for name in body:
    if name not in allowed:
      raise _bad(f"Unrecognized request argument supplied: {name[:100]}", name[:100],
                 "unknown_parameter")
    if name in _OFF and not _is_off(body[name], _OFF[name]):
      raise _bad(f"'{name}' is not supported by this server; leave it out", name,
                 "unsupported_parameter")


def _check_model(body: dict, ctx: ModelContext) -> str:
  model = body.get("model", ctx.name)
  if not isinstance(model, str):
    raise _bad(f"'model' must be a string; got {_show(model)}", "model")
  if model != ctx.name:
    raise OpenAIError(404, f"The model '{model[:200]}' does not exist; this server serves "
                           f"'{ctx.name}' (GET /v1/models)", "model", "model_not_found")
  return model


def _token_ids(value, ctx: ModelContext, param: str) -> np.ndarray:
  bad = next((t for t in value if not 0 <= t < ctx.vocab_size), None)
  if bad is not None:
    raise _bad(f"'{param}' holds token id {_show(bad)}, outside [0, {ctx.vocab_size})", param)
  return np.asarray(value, np.int32)


def _text(value: str, param: str) -> str:
  if (problem := text_data.utf8_problem(value)) is not None:
    raise _bad(f"'{param}' is not valid UTF-8 text ({problem})", param)
  return value


def _prompts(body: dict, ctx: ModelContext) -> list[np.ndarray]:
  """Completions' prompt: text, texts, token ids, or lists of token ids."""
  value = body.get("prompt")
  shape = "text, a list of texts, a list of token ids or a list of such lists"
  if isinstance(value, str):
    return [ctx.codec.encode(_text(value, "prompt"))]
  if not isinstance(value, list) or not value:
    raise _bad(f"'prompt' must be {shape}; got {_show(value)}", "prompt")
  if all(isinstance(p, str) for p in value):
    items = [ctx.codec.encode(_text(p, f"prompt[{i}]")) for i, p in enumerate(value)]
  elif all(_is_int(t) for t in value):
    items = [_token_ids(value, ctx, "prompt")]
  elif all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
    items = [_token_ids(p, ctx, f"prompt[{i}]") for i, p in enumerate(value)]
  else:
    raise _bad(f"'prompt' must be {shape}, without mixing them or empty lists", "prompt")
  return items


def _content(message: dict, where: str) -> str:
  content = message.get("content")
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(
      isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
      for p in content):
    return "".join(p["text"] for p in content)
  raise _bad(f"'{where}.content' must be a string or a list of {{\"type\": \"text\", "
             f"\"text\": ...}} parts (this model reads text only)", f"{where}.content")


def _messages(body: dict) -> list[dict]:
  value = body.get("messages")
  if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
    raise _bad(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages", "messages")
  messages = []
  for i, message in enumerate(value):
    where = f"messages[{i}]"
    if not isinstance(message, dict):
      raise _bad(f"'{where}' must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
      raise _bad(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}; got {_show(role)}",
                 f"{where}.role")
    unknown = sorted(set(message) - {"role", "content", "name"})
    if unknown:
      key = unknown[0][:100]
      raise _bad(f"'{where}.{key}' is not supported by this server (text messages only: "
                 f"role, content, name)", f"{where}.{key}")
    if "name" in message and not isinstance(message["name"], str):
      raise _bad(f"'{where}.name' must be a string", f"{where}.name")
    messages.append({"role": role, "content": _text(_content(message, where),
                                                      f"{where}.content")})
  return messages


def _stop_strings(body: dict) -> tuple[str, ...]:
  value = body.get("stop")
  if value is None:
    return ()
  items = [value] if isinstance(value, str) else value
  if (not isinstance(items, list) or not 0 < len(items) <= MAX_STOP_STRINGS or not all(
      isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items)):
    raise _bad(f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings of 1 "
               f"to {MAX_STOP_CHARS} characters (token ids go in 'stop_token_ids')", "stop")
  return tuple(_text(s, "stop") for s in items)


def _stream_options(body: dict, stream: bool) -> bool:
  options = body.get("stream_options")
  if options is None:
    return False
  if not stream:
    raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
  if not isinstance(options, dict):
    raise _bad(f"'stream_options' must be an object; got {_show(options)}", "stream_options")
  unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
  if unknown:
    key = unknown[0][:100]
    raise _bad(f"Unrecognized stream option: {key}", f"stream_options.{key}",
               "unknown_parameter")
  _bool(options, "include_obfuscation", "stream_options.")
  return _bool(options, "include_usage", "stream_options.")


def _sampling(body: dict, prompts: list[np.ndarray], n: int, ctx: ModelContext,
              max_tokens_field: str, chat: bool = False) -> list[SamplingParams]:
  """SamplingParams of every choice (module docstring: defaults, seeds, stop ids)."""
  max_tokens = _int(body, max_tokens_field, 1)
  longest = max(len(p) for p in prompts)
  room = ctx.max_model_len - longest
  if room < 1 or (max_tokens is not None and max_tokens > room):
    asked = max_tokens or 1
    raise _bad(f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
               f"you requested {_show(longest + asked)} tokens ({longest} in the prompt, "
               f"{_show(asked)} for the completion). Please reduce the prompt or "
               f"'{max_tokens_field}'.",
               max_tokens_field if room >= 1 else "messages" if "messages" in body else "prompt",
               "context_length_exceeded")
  seed = _int(body, "seed", 0, 2**32 - 1)
  stop_ids = body.get("stop_token_ids")
  stop_ids = [] if stop_ids is None else stop_ids
  if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
    raise _bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
  eos = () if _bool(body, "ignore_eos") else ctx.codec.eos + (ctx.end_of_turn if chat else ())
  values = {"max_tokens": max_tokens or min(ctx.defaults.max_tokens, room),
            "temperature": _number(body, "temperature", 0, 2),
            "top_p": _number(body, "top_p", 0, 1, low_open=True),
            "top_k": _int(body, "top_k", 0, CANDIDATES),
            "stop_tokens": tuple(dict.fromkeys((*ctx.defaults.stop_tokens, *stop_ids, *eos)))}
  base = dataclasses.replace(ctx.defaults, **{k: v for k, v in values.items() if v is not None})
  try:
    base.validate(ctx.vocab_size)
  except RequestError as e:  # only stop_token_ids can still be wrong here
    raise _bad(str(e).replace("stop_tokens", "stop_token_ids"), "stop_token_ids") from None
  return [dataclasses.replace(base, seed=(seed + c % n) % 2**32 if seed is not None
                              else ctx.draw_seed()) for c in range(len(prompts) * n)]


def _job(body: dict, ctx: ModelContext, prompts: list[np.ndarray], chat: bool,
         max_tokens_field: str) -> Job:
  model = _check_model(body, ctx)
  for i, prompt in enumerate(prompts):
    if len(prompt) == 0:
      raise _bad(f"'prompt{'' if len(prompts) == 1 else f'[{i}]'}' is empty; give at least "
                 f"one token", "prompt")
  n = _int(body, "n", 1, MAX_CHOICES) or 1
  if len(prompts) * n > MAX_CHOICES:
    raise _bad(f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices in one "
               f"request; send several requests", "n")
  stream = _bool(body, "stream")
  include_usage = _stream_options(body, stream)
  return Job(chat, model, prompts, n, _sampling(body, prompts, n, ctx, max_tokens_field, chat),
             _stop_strings(body), stream, include_usage)


def parse_completion(body, ctx: ModelContext) -> Job:
  """A /v1/completions body as a Job; OpenAIError (400, 404) naming the field otherwise."""
  _check_fields(body, _COMPLETION_FIELDS)
  _check_model(body, ctx)
  if "prompt" not in body:
    raise _bad("'prompt' is required", "prompt")
  prompts = _prompts(body, ctx)
  if len(prompts) > MAX_CHOICES:
    raise _bad(f"'prompt' holds {len(prompts)} prompts; at most {MAX_CHOICES}", "prompt")
  return _job(body, ctx, prompts, chat=False, max_tokens_field="max_tokens")


def parse_chat(body, ctx: ModelContext) -> Job:
  """A /v1/chat/completions body as a Job, its messages through the chat template."""
  _check_fields(body, _CHAT_FIELDS)
  _check_model(body, ctx)
  messages = _messages(body)
  try:
    prompt = np.asarray(ctx.encode_chat(messages), np.int32)
  except ConfigError as e:  # the template's raise_exception: roles out of order, say
    raise _bad(str(e), "messages") from None
  if len(prompt) == 0:
    raise _bad("the chat template renders these messages as no tokens", "messages")
  field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
      "max_tokens")
  return _job(body, ctx, [prompt], chat=True, max_tokens_field=field)


# --- the chat template ----------------------------------------------------------------------

def _has_template(folder: str) -> bool:
  """Whether a tokenizer folder holds a chat template (where transformers looks)."""
  if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
    return True
  try:
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
      return bool(json.load(f).get("chat_template"))
  except (OSError, ValueError, AttributeError):
    return False  # ChatTokenizer.load names a broken file when it is read for a template


def trained_chat_template(config) -> str:
  """The chat template a fine-tune's data was rendered with (data.chat_template of an SFT, DPO
  or GRPO config), so that its chat answers are prompted as it learned them; '' for none (the
  tokenizer folder's, else the default)."""
  data = config.data
  if data.source not in ("chat", "preference", "prompts"):
    return ""
  return data.get("chat_template", "")


def chat_encoder(codec: Codec, chat_template: str = ""
                 ) -> tuple[Callable[[list[dict]], np.ndarray], str, tuple[int, ...]]:
  """(messages -> prompt ids, which template that is, the ids that end an answer) for `codec`'s
  model: `chat_template` (Jinja text or a .jinja file) when given, else the tokenizer folder's
  template, else DEFAULT_CHAT_TEMPLATE. Rendered as transformers' apply_chat_template renders
  it (toolkit/data/chat_template.py), tokenized without adding special tokens (a template that
  wants a BOS writes it). A model's own template ends an answer at its end-of-turn token, as
  the model was trained to write it; the default template ends none (a model without one was
  never trained on its turns)."""
  folder = "bytes"
  if not codec.byte_level:
    path = codec.tokenizer.path
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
  if chat_template or (folder != "bytes" and _has_template(folder)):
    chat = ChatTokenizer.load(folder, chat_template)
    try:
      end = (chat.end_of_turn(),)
    except ConfigError:  # a template that writes nothing after an answer
      end = ()
    return chat.encode_prompt, chat.template.where, end
  template = ChatTemplate(DEFAULT_CHAT_TEMPLATE, where="the default chat template")

  def encode(messages: list[dict]) -> np.ndarray:
    rendered = template.render(messages, add_generation_prompt=True)
    return np.asarray(codec.tokenizer.encode(rendered), np.int32)
  return encode, template.where, ()


# --- responses -----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


class Reply:
  """The objects of one answer: the whole response, or its stream's chunks."""

  def __init__(self, job: Job):
    self.job = job
    self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())

  def _head(self, kind: str) -> dict:
    return {"id": self.id, "object": kind, "created": self.created, "model": self.job.model}

  def response(self, texts: Sequence[str], reasons: Sequence[str], usage_: dict) -> dict:
    if self.job.chat:
      choices = [{"index": i, "message": {"role": "assistant", "content": t},
                  "logprobs": None, "finish_reason": r}
                 for i, (t, r) in enumerate(zip(texts, reasons))]
      return {**self._head("chat.completion"), "choices": choices, "usage": usage_}
    choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
               for i, (t, r) in enumerate(zip(texts, reasons))]
    return {**self._head("text_completion"), "choices": choices, "usage": usage_}

  def chunk(self, index: int, text: str, finish_reason: str | None = None,
            role: bool = False) -> dict:
    """A stream chunk of choice `index`: new text, and the finish reason on its last one.
    `role` makes the chat stream's first chunk of a choice (the assistant role)."""
    if self.job.chat:
      delta = {"role": "assistant", "content": text} if role else (
          {"content": text} if text or finish_reason is None else {})
      choice = {"index": index, "delta": delta, "logprobs": None,
                "finish_reason": finish_reason}
      kind = "chat.completion.chunk"
    else:
      choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
      kind = "text_completion"
    body = {**self._head(kind), "choices": [choice]}
    return {**body, "usage": None} if self.job.include_usage else body

  def usage_chunk(self, usage_: dict) -> dict:
    """The chunk before [DONE] with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if self.job.chat else "text_completion"
    return {**self._head(kind), "choices": [], "usage": usage_}


def models_list(ctx: ModelContext) -> dict:
  """GET /v1/models: the one served model (max_model_len as vLLM reports it)."""
  return {"object": "list", "data": [{"id": ctx.name, "object": "model", "created": ctx.created,
                                      "owned_by": "meshkit", "max_model_len": ctx.max_model_len,
                                      "vocab_size": ctx.vocab_size}]}
