"""Text through a Hugging Face tokenizer with the model's BOS and EOS: `toolkit.sample`
continues a prompt exactly as transformers' greedy `generate` does (so does `toolkit.generate`:
tests/toolkit/test_convert.py), and requests (prompts files, `toolkit.serve`) are encoded and
decoded with it. Byte-level text stays the default."""
import pathlib

import pytest

from tests.toolkit.hf import reference
from toolkit import conversion
from toolkit.data import text as text_data
from toolkit.errors import ConfigError
from toolkit.inference import engine as engine_lib, requests, text as text_lib
from toolkit.inference.codec import BYTE_LEVEL, Codec
from toolkit.inference.sampling import SamplingParams

FIXTURE_TOKENIZER = str(pathlib.Path(__file__).resolve().parents[2] / "fixtures" /
                        "tokenizer.json")
BOS, EOS = reference.tiny_hf_model.BOS, reference.tiny_hf_model.EOS
PROMPT = "Lists are "


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf") / "tiny"
  return path, reference.write_folder(path)


def _text(path, ids) -> str:
  """transformers' own decoding of `ids` with the folder's tokenizer, special tokens left out."""
  tokenizer = reference.transformers.AutoTokenizer.from_pretrained(str(path))
  return tokenizer.decode(ids, skip_special_tokens=True)


def _greedy(model, prompt_ids, count: int) -> list[int]:
  with reference.torch.no_grad():
    out = model.generate(reference.torch.tensor([prompt_ids]), max_new_tokens=count,
                         do_sample=False)[0, len(prompt_ids):].tolist()
  return out[:out.index(EOS)] if EOS in out else out


def test_codec_bytes_by_default_and_tokenizer_json_with_special_tokens(folder, tmp_path):
  assert list(BYTE_LEVEL.encode("Hé")) == list(text_data.encode("Hé"))
  assert BYTE_LEVEL.bos is None and BYTE_LEVEL.eos == ()
  codec = Codec.load(str(folder[0]))  # the folder: tokenizer.json, ids from its configs
  assert (codec.bos, codec.eos) == (BOS, (EOS,))
  assert list(codec.encode("Hé")) == [BOS, *"Hé".encode()]
  assert codec.decode([BOS, *"Hé".encode(), EOS]) == "Hé"
  assert codec.stop_at_eos(SamplingParams(stop_tokens=(10,))).stop_tokens == (10, EOS)
  # A BPE tokenizer.json on its own (no configs beside it: no BOS or EOS).
  bpe = Codec.load(FIXTURE_TOKENIZER)
  assert bpe.bos is None and bpe.decode(bpe.encode("hello world")) == "hello world"
  with pytest.raises(ConfigError, match="has token ids up to 399, beyond the model's "
                                        "vocab_size=258"):
    bpe.check(258)
  with pytest.raises(ConfigError, match="does not exist; give a tokenizer.json"):
    Codec.load(str(tmp_path))


def test_sample_continues_like_transformers(folder, tmp_path):
  path, model = folder
  conversion.import_checkpoint(str(path), str(tmp_path / "imported"))
  greedy = text_lib.sample_from_checkpoint(str(tmp_path / "imported"), PROMPT, 16,
                                           temperature=0.0, seed=0, tokenizer=str(path))
  expected = _greedy(model, [BOS, *PROMPT.encode()], 16)
  assert greedy == PROMPT + _text(path, expected)


def test_requests_take_and_return_text_through_the_tokenizer(folder):
  """What toolkit.serve and prompts files do with each request (parse_prompt, the EOS stop,
  result_record), with the folder's codec."""
  codec = Codec.load(str(folder[0]))
  vocab_size = folder[1].config.vocab_size
  assert list(requests.parse_prompt({"prompt": PROMPT}, vocab_size, codec)) == [
      BOS, *PROMPT.encode()]
  assert list(requests.parse_prompt({"tokens": [5, 6]}, vocab_size, codec)) == [5, 6]
  result = engine_lib.Result(tokens=[*b"ok ", BOS, *b"go"], finish_reason="stop",
                             prompt_tokens=11, latency_s=0.0, time_to_first_token_s=0.0)
  record = requests.result_record(result, {"id": 3}, codec)
  assert record["completion"] == _text(folder[0], result.tokens) == "ok go"
  assert record["id"] == 3 and record["tokens"] == result.tokens
