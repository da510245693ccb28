"""A meshkit model as the evaluation harness's `LM` (lm-evaluation-harness's
`lm_eval.api.model.TemplateLM`): log-likelihoods from the batched, sharded scoring pass
(toolkit/evaluation/scoring.py), generation through the paged KV-cache engine
(toolkit/inference/engine.py), text through the model's tokenizer (toolkit/inference/codec.py).

Requests are handled as the harness's Hugging Face backend (`hf`, lm_eval/models/huggingface.py)
handles them with `add_bos_token=True`, so that the two give the same numbers on the same
weights: the BOS token (when the model has one) starts every encoded text that does not start
with it already; an empty context is the prefix token (BOS, else the end-of-text token); inputs
are cut from the left to `max_length` tokens; rolling log-likelihoods use the harness's
windows; a generation stops at a stop string ("until") or the model's EOS and is cut at the
first stop string, with at most max_gen_toks new tokens and prompts cut from the left to
max_length - max_gen_toks.

This module imports lm_eval: import it only on the evaluation path (toolkit/evaluation/
harness.py checks the package is there first).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.models.utils import postprocess_generated_text
from jax.sharding import Mesh

import sharding
from models import LlamaConfig
from toolkit.errors import ConfigError
from toolkit.evaluation.scoring import Scorer
from toolkit.inference import engine as engine_lib
from toolkit.inference.codec import Codec
from toolkit.inference.sampling import SamplingParams
from toolkit.training import metrics as metrics_lib

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for tasks that set none (HFLM's)
NEWLINE = 10  # byte-level models without an end-of-text token: the prefix of an empty context


class MeshkitLM(TemplateLM):
  """Parameters on a mesh, scored and continued for the harness. `batch_size` rows per forward
  pass and requests decoded together; `max_length` tokens per input (the training sequence
  length by default, toolkit/evaluation/harness.py)."""

  backend = "causal"

  def __init__(self, model_cfg: LlamaConfig, params, mesh: Mesh, rules: sharding.Rules,
               codec: Codec, max_length: int, batch_size: int = 32, seed: int = 0,
               options: engine_lib.Options = engine_lib.Options(), name: str = "meshkit"):
    super().__init__()
    self.codec, self._max_length, self.seed, self.name = codec, max_length, seed, name
    self.scorer = Scorer(model_cfg, params, mesh, rules, max_length, batch_size)
    self.options = options
    self.engine = options.engine(self.scorer.model_cfg, self.scorer.params, mesh, rules,
                                 max_length)
    self.generate_batch = min(self.scorer.batch_size, self.engine.batch_ways * max(
        1, self.scorer.batch_size // self.engine.batch_ways))
    vocab = model_cfg.vocab_size
    eot = codec.eos[0] if codec.eos else codec.tokenizer.eot_id
    self._eot = eot if eot is not None and eot < vocab else (
        codec.bos if codec.bos is not None else NEWLINE)

  def set_params(self, params) -> None:
    """New parameter values of the same model (the training loop's, every N steps)."""
    self.scorer.params = self.scorer.place(params)
    self.engine.params = self.scorer.params

  # --- what the harness asks of a model ------------------------------------------------------
  @property
  def eot_token_id(self) -> int:
    return self._eot

  @property
  def prefix_token_id(self) -> int:
    return self.codec.bos if self.codec.bos is not None else self._eot

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    """The harness's 256 for a task that sets none; half of max_length where 256 would leave
    the prompt no room (the `hf` backend would cut it to nothing)."""
    if DEFAULT_MAX_GEN_TOKS < self._max_length // 2:
      return DEFAULT_MAX_GEN_TOKS
    return self._max_length // 2

  @property
  def tokenizer_name(self) -> str:
    return self.codec.tokenizer.path.replace("/", "__")

  def get_model_info(self) -> dict:
    return {"model_name": self.name, "tokenizer": self.codec.tokenizer.path,
            "max_length": self._max_length, "batch_size": self.scorer.batch_size}

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 left_truncate_len: int | None = None, **kwargs) -> list[int]:
    del kwargs
    ids = [int(t) for t in self.codec.tokenizer.encode(string)]
    bos = self.codec.bos
    if bos is not None and add_special_tokens is not False and not (
        add_special_tokens is None and string.startswith(self._bos_text())):
      ids = [bos] + ids
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self.codec.decode(tokens)

  def _bos_text(self) -> str:
    return self.codec.tokenizer.decode([self.codec.bos], skip_special=False)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                            ) -> list[tuple[float, bool]]:
    del disable_tqdm, kwargs
    results = self.scorer.score([(context, continuation)
                                 for _, context, continuation in requests])
    for (key, _, _), answer in zip(requests, results):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, answer)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """The whole text's log-likelihood in the harness's disjoint windows of max_length
    tokens; every window of every request goes through one `score` call."""
    windows, owners = [], []
    for index, (string,) in enumerate(r.args for r in requests):
      for context, continuation in map(lm_utils.make_disjoint_window,
                                       lm_utils.get_rolling_token_windows(
                                           token_list=self.tok_encode(string),
                                           prefix_token=self.prefix_token_id,
                                           max_seq_len=self._max_length, context_len=1)):
        windows.append((None, context, continuation))
        owners.append(index)
    totals = [0.0] * len(requests)
    for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
      totals[index] += logprob
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or sampled, per the task's do_sample/temperature) continuations, requests with
    the same generation settings decoded together with continuous batching."""
    del disable_tqdm
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
    texts: list[str] = [""] * len(requests)
    for members in groups.values():
      contexts = [requests[i].args[0] for i in members]
      for i, text in zip(members, self._generate(contexts, requests[members[0]].args[1])):
        texts[i] = text
        self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return texts

  def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
    kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
    # EOS ends a request by its id (the engine's stop tokens): decoded text never holds it.
    until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
    max_new = kwargs.pop("max_gen_toks")
    if max_new >= self._max_length:
      raise ConfigError(f"the task asks for max_gen_toks={max_new} new tokens, not below the "
                        f"model's max_length={self._max_length}; raise --max_length")
    params = self._sampling(kwargs, max_new)
    prompts = []
    for context in contexts:
      ids = self.tok_encode(context, left_truncate_len=self._max_length - max_new)
      prompts.append(np.asarray(ids or [self.prefix_token_id], np.int32))
    tokens = generate_with_stops(self.engine, prompts, params, self.generate_batch, until,
                                 self.codec.decode, self.options, progress=_say_progress)
    return [postprocess_generated_text(self.codec.decode(t), until, None) for t in tokens]

  def _sampling(self, kwargs: dict, max_new: int) -> list[SamplingParams] | SamplingParams:
    sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
    params = SamplingParams(
        max_tokens=max_new, temperature=float(kwargs.get("temperature", 0.0)) if sample else 0.0,
        top_k=int(kwargs.get("top_k") or 0) if sample else 0,
        top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0, seed=self.seed)
    return self.codec.stop_at_eos(params)


PROGRESS_EVERY_S = 10.0  # how often a long generation says how far it is


def _say_progress(done: int, total: int, tokens: int, seconds: float) -> None:
  """One line on stderr (process 0): requests done, tokens/s, and the time left."""
  if jax.process_index() != 0:
    return
  left = "ETA " + metrics_lib.format_duration(seconds / done * (total - done)) if done else ""
  print(f"generating: {done}/{total} requests, {tokens / max(seconds, 1e-9):,.0f} tokens/s"
        + (f", {left}" if left else ""), file=sys.stderr, flush=True)


def generate_with_stops(engine: engine_lib.Engine, prompts: list[np.ndarray],
                        params: SamplingParams, batch_size: int, until: Sequence[str],
                        decode: Callable[[list[int]], str],
                        options: engine_lib.Options = engine_lib.Options(),
                        progress: Callable[[int, int, int, float], None] | None = None
                        ) -> list[list[int]]:
  """Each prompt's new tokens (without a stop token), with continuous batching of up to
  `batch_size` requests; a request ends early once its decoded text holds a stop string
  (the caller cuts the text there), which frees its place for the next prompt. Request i
  samples with seed params.seed + i. `progress(done, total, tokens, seconds)` is called every
  PROGRESS_EVERY_S while it runs."""
  if not prompts:
    return []
  batch_size = min(batch_size, engine.prefill_rows(len(prompts), batch_size))
  batcher = engine_lib.Batcher(engine, batch_size, **options.batcher())
  tokens: list[list[int]] = [[] for _ in prompts]
  finished: list[engine_lib.Result | None] = [None] * len(prompts)
  stops = [s for s in until if s]

  def on_done(result: engine_lib.Result) -> None:
    finished[result.tag] = result

  for i, prompt in enumerate(prompts):
    request = engine_lib.Request(
        prompt, dataclasses.replace(params, seed=(params.seed + i) % 2**32), on_done, tag=i)

    def on_token(token: int, i=i, request=request) -> None:
      tokens[i].append(token)
      if stops and any(s in decode(tokens[i]) for s in stops):
        batcher.cancel(request)

    request.on_token = on_token
    try:
      batcher.submit(request)
    except engine_lib.RequestError as e:
      raise ConfigError(f"a generation request does not fit the engine: {e}") from None
  start = last = time.monotonic()
  while batcher.step():
    if progress is not None and time.monotonic() - last >= PROGRESS_EVERY_S:
      last = time.monotonic()
      progress(sum(r is not None for r in finished), len(prompts), sum(map(len, tokens)),
               last - start)
  errors = [r.error for r in finished if r is not None and r.error]
  if errors:
    raise RuntimeError(f"generation failed: {errors[0]}")
  return tokens

