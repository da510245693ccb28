"""Chat templates rendered exactly as Hugging Face transformers renders them, the spans of a
rendered conversation that the assistant wrote, and its tokens with the assistant's marked
(`ChatTokenizer`: a model folder's tokenizer.json, or bytes).

A model's chat template is a Jinja template (its folder's `chat_template.jinja`, else the
`chat_template` of `tokenizer_config.json`). `ChatTemplate.render` builds the Jinja
environment transformers builds in `transformers.utils.chat_template_utils`
(`_cached_compile_jinja_template`, transformers 5.24): a sandboxed immutable environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` tag,
the `tojson` filter without HTML escaping, `raise_exception`, `strftime_now`, the restricted
`dict` and `namespace`; it passes the folder's named special tokens (`bos_token`,
`eos_token`, ...) and `add_generation_prompt` as `apply_chat_template` does, and cleans the
messages as it does (keys whose value is None dropped, reasoning fields aliased). The text is
then tokenized with special tokens off (`add_special_tokens=False`): a template that wants a
BOS writes it itself. tests/toolkit/data/test_chat_template.py checks the token ids against
`AutoTokenizer.apply_chat_template` for several templates.

Assistant spans (`ChatTemplate.assistant_spans`). What the loss trains on is, for each
assistant turn, the text the model itself must produce: everything the template writes for
the turn after its generation prompt, the content and the end-of-turn marker
(`<|im_end|>\\n` in ChatML, `<|eot_id|>` in Llama 3). Two ways to find it:
  * a template with `{% generation %}` blocks marks it itself (transformers'
    `return_assistant_tokens_mask` reads the same blocks): those spans are used;
  * any other template is rendered prefix by prefix: turn i of the assistant spans from the
    end of `render(messages[:i], add_generation_prompt=True)` to the end of
    `render(messages[:i + 1])`, both checked to be prefixes of the whole rendering. This
    needs no markup in the template, so it works for the templates published models ship
    (few have generation blocks). A template that renders earlier turns differently once
    later ones follow (Qwen3 drops the reasoning of earlier turns, for one) fails the prefix
    check and is refused by name: add `{% generation %}` blocks to it (data.chat_template).
"""
from __future__ import annotations

import contextvars
import copy
import datetime
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

from toolkit.data import text
from toolkit.errors import ConfigError

BYTES = "bytes"
Span = tuple[int, int]
# The named special tokens transformers passes to every template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# A message's reasoning, under the names templates read it by (transformers' _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# While a rendering tracks its generation blocks: (the blocks rendered so far, the spans).
_TRACKING: contextvars.ContextVar = contextvars.ContextVar("generation_tracking", default=None)


def _jinja():
  try:
    import jinja2  # pylint: disable=g-import-not-at-top
    import jinja2.ext  # pylint: disable=g-import-not-at-top
    import jinja2.sandbox  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError("chat templates need jinja2: pip install -e '.'") from None
  return jinja2


@functools.cache
def environment():
  """The Jinja environment of transformers' apply_chat_template, with a `{% generation %}`
  tag whose spans `ChatTemplate.assistant_spans` reads."""
  jinja2 = _jinja()

  class GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and, while a rendering
    tracks them (`_TRACKING`), records the body's span of the output."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body
                                    ).set_lineno(lineno)

    def _generation(self, caller):
      text = caller()
      tracking = _TRACKING.get()
      if tracking is not None:
        blocks, spans = tracking
        start = len("".join(blocks))
        spans.append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own filter: Jinja's escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format):  # pylint: disable=redefined-builtin
    return datetime.datetime.now().strftime(format)

  class TemplateDict:
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  class TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore-prefixed attributes (as transformers')."""

    def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but "
            f"got {name!r}. Please rename the attribute.")

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[GenerationTracker, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                     dict=TemplateDict(), namespace=TemplateNamespace)
  return env


def clean_messages(messages: Sequence[Mapping]) -> list[dict]:
  """The messages as transformers hands them to a template: copies, keys whose value is None
  dropped, a reasoning field filled in under each name templates read it by."""
  cleaned = []
  for message in messages:
    message = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                     None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    cleaned.append(message)
  return cleaned


class ChatTemplate:
  """One chat template with the special-token strings it is rendered with. `where` names the
  template's origin in errors (a file, or the config field)."""

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
               where: str = "data.chat_template"):
    jinja2 = _jinja()
    self.source, self.where = source, where
    self.special_tokens = {k: str(v) for k, v in (special_tokens or {}).items()
                           if k in SPECIAL_TOKEN_NAMES and v is not None}
    try:
      self._template = environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise ConfigError(f"{where}: the chat template is not valid Jinja (line {e.lineno}: "
                        f"{e.message}); fix the template") from None
    self.has_generation_blocks = bool(_GENERATION_TAG.search(source))

  def _render(self, messages: Sequence[Mapping], add_generation_prompt: bool,
              spans: list[Span] | None = None) -> str:
    values = dict(messages=clean_messages(messages), tools=None, documents=None,
                  add_generation_prompt=add_generation_prompt, **self.special_tokens)
    if spans is None:
      return self._template.render(**values)
    blocks: list[str] = []
    token = _TRACKING.set((blocks, spans))
    try:
      for block in self._template.generate(**values):
        blocks.append(block)
    finally:
      _TRACKING.reset(token)
    return "".join(blocks)

  def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = False) -> str:
    """The conversation as text, as `apply_chat_template(..., tokenize=False)` gives it.
    Raises ConfigError when the template raises (its `raise_exception` message)."""
    jinja2 = _jinja()
    try:
      return self._render(messages, add_generation_prompt)
    except (jinja2.exceptions.TemplateError, TypeError) as e:  # TypeError: "a" + 1 and such
      raise ConfigError(f"the chat template ({self.where}) refused the conversation: "
                        f"{e}") from None

  def assistant_spans(self, messages: Sequence[Mapping]) -> tuple[str, list[Span]]:
    """(the rendered conversation, the character spans of its assistant turns): the
    template's `{% generation %}` blocks when it has them, else each assistant turn rendered
    after its prompt (module docstring). ConfigError when neither applies."""
    jinja2 = _jinja()
    spans: list[Span] = []
    try:
      if self.has_generation_blocks:
        return self._render(messages, False, spans), spans
      text = self._render(messages, False)
      for i, message in enumerate(messages):
        if message.get("role") != "assistant":
          continue
        prompt = self._render(messages[:i], True)
        through = self._render(messages[:i + 1], False)
        if not (text.startswith(prompt) and text.startswith(through)
                and len(prompt) <= len(through)):
          raise ConfigError(
              f"the chat template ({self.where}) renders the conversation differently once "
              f"later turns follow assistant turn {i}, so its assistant text cannot be found "
              f"by rendering prefixes; mark it with {{% generation %}}...{{% endgeneration %}} "
              f"in the template (data.chat_template), or train on everything "
              f"(data.train_on='all')")
        spans.append((len(prompt), len(through)))
      return text, spans
    except (jinja2.exceptions.TemplateError, TypeError) as e:  # TypeError: "a" + 1 and such
      raise ConfigError(f"the chat template ({self.where}) refused the conversation: "
                        f"{e}") from None


# --- rendered text -> tokens ----------------------------------------------------------------

def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path} is not a readable JSON file ({e})") from None
  if not isinstance(value, dict):
    raise ConfigError(f"{path} does not hold a JSON object")
  return value


def _token_string(value) -> str | None:
  """A tokenizer_config.json special token: a string or an AddedToken's {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _template_text(value: str) -> tuple[str, str]:
  """data.chat_template's text and where it came from: a .jinja file's contents, or itself."""
  if value.endswith(".jinja") and os.path.isfile(value):
    with open(value, encoding="utf-8") as f:
      return f.read(), value
  return value, "data.chat_template"


class ChatTokenizer:
  """A chat template and the tokenizer its text goes through: a Hugging Face tokenizer.json
  (the `tokenizers` library, special tokens off as in apply_chat_template) or UTF-8 bytes."""

  def __init__(self, template: ChatTemplate, hf_tokenizer=None, name: str = BYTES):
    self.template, self._hf, self.name = template, hf_tokenizer, name

  @classmethod
  def load(cls, tokenizer: str, chat_template: str = "") -> ChatTokenizer:
    """`tokenizer`: "bytes" or a Hugging Face folder; `chat_template`: a template (text or a
    .jinja file) that replaces the folder's, required for bytes."""
    override = _template_text(chat_template) if chat_template else None
    if tokenizer in ("", BYTES):
      if override is None:
        raise ConfigError("data.chat_template is empty, and byte-level text (data.tokenizer="
                          "'bytes') has no template of its own; give the template (Jinja text "
                          "or a .jinja file), or a Hugging Face folder in data.tokenizer")
      return cls(ChatTemplate(override[0], where=override[1]))
    file = os.path.join(tokenizer, "tokenizer.json")
    if not os.path.isfile(file):
      raise ConfigError(f"data.tokenizer={tokenizer!r}: {file} does not exist; give a Hugging "
                        f"Face model folder or 'bytes'")
    try:
      import tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ConfigError("chat data through a tokenizer.json needs the `tokenizers` library: "
                        "pip install -e '.[text]'") from None
    try:
      hf_tokenizer = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # pylint: disable=broad-except  # the library raises plain Exception
      raise ConfigError(f"{file} is not a valid tokenizer.json ({e})") from None
    config_file = os.path.join(tokenizer, "tokenizer_config.json")
    config = _read_json(config_file) if os.path.isfile(config_file) else {}
    special = {name: _token_string(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    if override is not None:
      source, where = override
    else:
      source, where = cls._folder_template(tokenizer, config, config_file)
    return cls(ChatTemplate(source, special, where), hf_tokenizer, tokenizer)

  @staticmethod
  def _folder_template(folder: str, config: dict, config_file: str) -> tuple[str, str]:
    """The folder's default template, where transformers looks: chat_template.jinja first,
    then tokenizer_config.json's chat_template (a string, or named templates)."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        return f.read(), jinja_file
    value = config.get("chat_template")
    if isinstance(value, list):
      value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
      value = value.get("default")
    if not isinstance(value, str) or not value:
      raise ConfigError(f"{folder} has no chat template (neither chat_template.jinja nor a "
                        f"chat_template in tokenizer_config.json); give one in "
                        f"data.chat_template")
    return value, config_file

  @property
  def vocab_size(self) -> int:
    return 256 if self._hf is None else self._hf.get_vocab_size(with_added_tokens=True)

  def token_ids(self, rendered: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, first character, end character) of each token of `rendered`."""
    if self._hf is None:
      ids = np.frombuffer(rendered.encode("utf-8"), np.uint8).astype(np.int32)
      chars = np.repeat(np.arange(len(rendered)),
                        [len(c.encode("utf-8")) for c in rendered]) if ids.size else ids
      return ids, chars, chars + 1
    encoding = self._hf.encode(rendered, add_special_tokens=False)
    offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
    return np.asarray(encoding.ids, np.int32), offsets[:, 0], offsets[:, 1]

  def encode(self, messages: Sequence[Mapping], train_on: str = "assistant"
             ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, which tokens the loss trains on) of a whole conversation. A token is the
    assistant's when it overlaps an assistant span, as transformers' assistant mask does."""
    if train_on == "all":
      ids, _, _ = self.token_ids(self.template.render(messages))
      return ids, np.ones(ids.shape, bool)
    rendered, spans = self.template.assistant_spans(messages)
    ids, starts, ends = self.token_ids(rendered)
    mask = np.zeros(ids.shape, bool)
    for start, end in spans:
      mask |= (starts < end) & (ends > start)
    return ids, mask

  def encode_prompt(self, messages: Sequence[Mapping]) -> np.ndarray:
    """The ids a model continues to answer `messages`: rendered with the generation prompt."""
    return self.token_ids(self.template.render(messages, add_generation_prompt=True))[0]

  def end_of_turn(self) -> int:
    """The first token the template closes an assistant turn with (what it writes after the
    content: "\\n" for experiments/sft.py's byte template, <|im_end|> in ChatML, <|eot_id|>
    in Llama 3): greedy generation of an answer stops there."""
    rendered, spans = self.template.assistant_spans(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    start, end = spans[-1]
    turn = rendered[start:end]
    ids = self.token_ids(turn[turn.index("y") + 1:])[0]
    if not ids.size:
      raise ConfigError(f"the chat template ({self.template.where}) writes nothing after an "
                        f"assistant turn's content, so a generated answer has no end")
    return int(ids[0])

  def decode(self, ids) -> str:
    if self._hf is None:
      return text.decode(ids)
    return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)
