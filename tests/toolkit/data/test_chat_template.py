"""Chat templates (toolkit/data/chat_template.py): the token ids of a conversation equal
transformers' `AutoTokenizer.apply_chat_template(..., tokenize=True)` for a Llama 3 template, a
ChatML one, a Zephyr-style one with a system prompt and the generation prompt, and one that
uses the environment's extras (namespace, tojson, raise_exception, loop controls); the loss
mask covers exactly the assistant turns: their content and the end-of-turn marker the
template writes after it, found in the rendered text independently of the code under test,
and equal to transformers' own assistant mask where the template has {% generation %} blocks.

The tokenizer folders are built here from tests/fixtures/tokenizer.json (a 400-token BPE) with
each template's special tokens added: no download."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from tests import extras
from toolkit.data import chat
from toolkit.errors import ConfigError

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tokenizer.json"

# Meta Llama 3 Instruct's template (BOS from the folder's bos_token, contents trimmed).
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2.5's ChatML: a default system prompt when the conversation has none.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
# Zephyr's: one tag per line, so trim_blocks and lstrip_blocks decide the whitespace.
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# The environment's extras, and ChatML's assistant turn marked with {% generation %}.
EXTRAS = """{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] -%}{%- continue -%}
  {%- elif message['role'] not in ['user', 'assistant'] -%}
    {{- raise_exception('unknown role ' + message['role']) -}}
  {%- endif -%}
  {%- if loop.index0 <= 1 and ns.system -%}
    {{- '<|im_start|>system\n' + ns.system + ' ' + {'lang': 'é'} | tojson + '<|im_end|>\n' -}}
  {%- endif -%}
  {{- '<|im_start|>' + message['role'] + '\n' -}}
  {%- if message['role'] == 'assistant' -%}
    {%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\n' -}}
  {%- else -%}{{- message['content'] + '<|im_end|>\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

TEMPLATES = {
    # name: (template, special tokens added, tokenizer_config's named tokens, end of turn)
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "<|eot_id|>"),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"},
               "<|im_end|>\n"),
    "zephyr": (ZEPHYR, ["</s>", "<|user|>", "<|system|>", "<|assistant|>"],
               {"eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}},
               "</s>\n"),
    "extras": (EXTRAS, ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"},
               "<|im_end|>"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "You answer briefly, in plain words."},
     {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."},
     {"role": "user", "content": "And an even one?"},
     {"role": "assistant", "content": "Two, the only even prime.", "reasoning_content": None}],
]
# Ends with the user: rendered with the generation prompt, as for generation.
PROMPT = [{"role": "system", "content": "Be terse."},
          {"role": "user", "content": "Say <|im_start|> hello \u00e9\u00e9!"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, pathlib.Path]:
  """A Hugging Face tokenizer folder per template: the fixture BPE plus its special tokens,
  and tokenizer_config.json holding the template and the named tokens."""
  tokenizers = extras.require("tokenizers")
  made = {}
  for name, (template, added, named, _) in TEMPLATES.items():
    folder = tmp_path_factory.mktemp(name)
    tokenizer = tokenizers.Tokenizer.from_file(str(FIXTURE))
    tokenizer.add_special_tokens(added)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **named}))
    made[name] = folder
  return made


@pytest.fixture(scope="module")
def transformers_tokenizers(folders):
  transformers = extras.require("transformers")
  return {name: transformers.AutoTokenizer.from_pretrained(str(folder))
          for name, folder in folders.items()}


@pytest.mark.parametrize("name", TEMPLATES)
def test_token_ids_equal_transformers_apply_chat_template(name, folders,
                                                          transformers_tokenizers):
  tokenizer = chat.ChatTokenizer.load(str(folders[name]))
  reference = transformers_tokenizers[name]
  cases = [(c, False) for c in CONVERSATIONS] + [(c[:-1], True) for c in CONVERSATIONS]
  cases.append((PROMPT, True))
  for messages, generation_prompt in cases:
    want = reference.apply_chat_template(messages, tokenize=True, return_dict=False,
                                         add_generation_prompt=generation_prompt)
    ids = (tokenizer.encode_prompt(messages) if generation_prompt else
           tokenizer.encode(messages, "all")[0])
    assert ids.tolist() == list(want), (name, messages)
    if not generation_prompt:  # the masked encoding tokenizes the same text
      assert tokenizer.encode(messages)[0].tolist() == list(want)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
  """[start, end) of each run of True."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
  return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_loss_mask_covers_exactly_the_assistant_turns(name, folders,
                                                          transformers_tokenizers):
  """Each run of masked tokens decodes to one assistant turn's content followed by the
  template's end-of-turn marker, in order, and nothing else is masked; the masked text sits
  where the content appears in the rendered conversation."""
  end_of_turn = TEMPLATES[name][3]
  tokenizer = chat.ChatTokenizer.load(str(folders[name]))
  reference = transformers_tokenizers[name]
  for messages in CONVERSATIONS:
    ids, mask = tokenizer.encode(messages)
    rendered = reference.apply_chat_template(messages, tokenize=False)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = _runs(mask)
    assert len(runs) == len(answers), (name, runs)
    cursor = 0
    for (start, end), answer in zip(runs, answers):
      piece = reference.decode(ids[start:end].tolist())
      assert piece == answer + end_of_turn, (name, piece)
      at = rendered.index(answer + end_of_turn, cursor)  # the content's place in the text
      assert reference.decode(ids[:start].tolist()) == rendered[:at], name
      cursor = at + len(piece)
    if "{% generation %}" in TEMPLATES[name][0] or "{%- generation -%}" in TEMPLATES[name][0]:
      masks = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
      assert mask.astype(int).tolist() == list(masks["assistant_masks"]), name


def test_byte_level_template_and_the_end_of_turn_token():
  from experiments import sft  # pylint: disable=g-import-not-at-top
  tokenizer = chat.ChatTokenizer.load("bytes", sft.BYTE_TEMPLATE)
  messages = [{"role": "user", "content": "reverse abc"},
              {"role": "assistant", "content": "cbé"}]
  ids, mask = tokenizer.encode(messages)
  text = "U: reverse abc\nA: cbé\n"
  assert bytes(ids.tolist()) == text.encode()
  assert bytes(ids[mask].tolist()) == "cbé\n".encode()  # two bytes for é, both masked
  assert bytes(tokenizer.encode_prompt(messages[:1]).tolist()) == b"U: reverse abc\nA: "
  assert tokenizer.end_of_turn() == ord("\n")
  assert tokenizer.encode(messages, "all")[1].all()


def test_template_mistakes_are_one_error(folders, tmp_path):
  with pytest.raises(ConfigError, match="has no template of its own"):
    chat.ChatTokenizer.load("bytes", "")
  with pytest.raises(ConfigError, match=r"data.chat_template: the chat template is not valid "
                                        r"Jinja \(line 1"):
    chat.ChatTokenizer.load("bytes", "{% for m in messages %}")
  extras_folder = chat.ChatTokenizer.load(str(folders["extras"]))
  with pytest.raises(ConfigError, match="refused the conversation: unknown role tool"):
    extras_folder.encode([{"role": "tool", "content": "x"}])
  (tmp_path / "tokenizer.json").write_text(FIXTURE.read_text())
  with pytest.raises(ConfigError, match="has no chat template"):
    chat.ChatTokenizer.load(str(tmp_path))
  # A template that renders earlier turns differently once later ones follow.
  unstable = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] if loop.last else '...' }}"
              "\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
  with pytest.raises(ConfigError, match="renders the conversation differently once later turns "
                                        "follow assistant turn 1"):
    chat.ChatTokenizer.load("bytes", unstable).encode(CONVERSATIONS[1][1:])
