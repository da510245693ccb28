"""Generation with the KV-cache engine: sharded == unsharded, batch-invariance, continuous
batching, stop conditions, sampling and compile counts."""
import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from models import Llama, LlamaConfig
from toolkit.inference import engine as engine_lib, sampling
from toolkit.inference.sampling import RequestError, SamplingParams

CFG = LlamaConfig.preset("tiny")


@pytest.fixture(scope="module")
def params():
  return nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(params=0)), nnx.Param))


@pytest.fixture(scope="module")
def engine(params):
  """One unsharded engine for most tests: its compiled shapes are shared between them."""
  return make_engine(params)


def make_engine(params, ici="data:1", preset="dp", devices=1, cache_length=64):
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ici, "mesh.ici"), [],
                            jax.devices()[:devices])
  return engine_lib.Engine(CFG, params, mesh, sharding.Rules.preset(preset), cache_length)


def prompts_and_params(count, seed=0, temperature=0.0, max_length=15):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, CFG.vocab_size, int(rng.integers(1, max_length + 1))).astype(np.int32)
             for _ in range(count)]
  params = [SamplingParams(max_tokens=int(rng.integers(1, 14)), temperature=temperature,
                           top_k=int(rng.integers(0, 20)), top_p=float(rng.uniform(0.5, 1)),
                           seed=i) for i in range(count)]
  return prompts, params


def tokens_of(results):
  return [r.tokens for r in results]


def test_greedy_sharded_equals_unsharded_and_alone_equals_batched(params, engine):
  prompts, settings = prompts_and_params(10, max_length=30)  # two prompt buckets
  sharded = make_engine(params, "fsdp:4,tensor:2", "fsdp_tp", devices=8)
  # The cache is really laid out by the rules: pages over fsdp like the batch, kv_heads over
  # tensor.
  assert sharded.cache_sharding.spec == jax.sharding.PartitionSpec(None, "tensor", "fsdp")
  batched = tokens_of(engine_lib.generate(engine, prompts, settings, batch_size=4))
  assert batched == tokens_of(engine_lib.generate(sharded, prompts, settings, batch_size=8))
  alone = [engine_lib.generate(engine, [p], [s], batch_size=1)[0].tokens
           for p, s in zip(prompts, settings)]
  assert batched == alone
  assert [len(t) for t in batched] == [s.max_tokens for s in settings]
  # Every shape was traced (compiled) exactly once, though generate ran 11 times: a step per
  # (rows per group, tokens per row, pages in the pool); decoding has one token per row, and
  # a pool holds batch_size x 4 pages (cache 64 in pages of 16).
  assert set(engine.traces.values()) == {1} and set(sharded.traces.values()) == {1}
  assert {("step", (4,), (1,), 16), ("step", (1,), (1,), 4)} <= set(engine.traces)
  # 8 places over 4 devices: 1 or 2 decode rows per device.
  assert {k for k in sharded.traces if k[2] == (1,)} <= {("step", (4,), (1,), 32),
                                                        ("step", (8,), (1,), 32)}


def test_greedy_tokens_equal_recomputing_the_full_forward_pass(params, engine):
  """The cache (written row by row in place) against no cache at all: each new token the
  argmax of the full forward pass over prompt + tokens so far, sharded and not."""
  prompts, _ = prompts_and_params(3, seed=4, max_length=12)
  settings = [SamplingParams(max_tokens=6)] * 3
  model = Llama(CFG, rngs=nnx.Rngs(params=0))  # the `params` fixture's model
  # Right-padded to one length (causal: padding after a position never changes it).
  forward = jax.jit(lambda tokens, last: model(tokens)[0, last])
  expected = []
  for prompt in prompts:
    tokens = list(prompt)
    for _ in range(6):
      padded = np.zeros((1, 32), np.int32)
      padded[0, :len(tokens)] = tokens
      tokens.append(int(np.argmax(forward(padded, len(tokens) - 1))))
    expected.append(tokens[len(prompt):])
  sharded = make_engine(params, "fsdp:4,tensor:2", "fsdp_tp", devices=8)
  assert tokens_of(engine_lib.generate(engine, prompts, settings, batch_size=4)) == expected
  assert tokens_of(engine_lib.generate(sharded, prompts, settings, batch_size=8)) == expected


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
  prompts, settings = prompts_and_params(6, seed=1, temperature=1.0)
  batched = tokens_of(engine_lib.generate(engine, prompts, settings, batch_size=4))
  assert batched == tokens_of(engine_lib.generate(engine, prompts[::-1], settings[::-1],
                                                  batch_size=2))[::-1]
  assert batched[0] == engine_lib.generate(engine, prompts[:1], settings[:1], 1)[0].tokens
  reseeded = [SamplingParams(**{**s.__dict__, "seed": s.seed + 100}) for s in settings]
  assert batched != tokens_of(engine_lib.generate(engine, prompts, reseeded, batch_size=4))


def test_stop_tokens_end_a_request_without_the_stop_token(engine):
  prompt = np.arange(5, dtype=np.int32)
  free = engine_lib.generate(engine, [prompt], [SamplingParams(max_tokens=12)], 1)[0]
  assert free.finish_reason == "length" and len(free.tokens) == 12
  stop = free.tokens[4]
  first = free.tokens.index(stop)
  stopped = engine_lib.generate(
      engine, [prompt], [SamplingParams(max_tokens=12, stop_tokens=(stop,))], 1)[0]
  assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[:first]


def test_continuous_batching_refills_slots(engine):
  batcher = engine_lib.Batcher(engine, batch_size=2)
  results = {}
  prompts, settings = prompts_and_params(5, seed=3)
  for i, (p, s) in enumerate(zip(prompts, settings)):
    batcher.submit(engine_lib.Request(p, s, lambda r: results.__setitem__(r.tag, r), tag=i))
  steps = 0
  while batcher.step():
    steps += 1
    assert steps < 100
  expected = [engine_lib.generate(engine, [p], [s], 1)[0].tokens for p, s in zip(prompts, settings)]
  assert [results[i].tokens for i in range(5)] == expected
  # Slots were reused while others were still decoding: fewer steps than one batch after another.
  assert batcher.counters["prefill_calls"] > 1 and batcher.counters["requests_finished"] == 5


def test_a_failing_step_answers_its_requests_and_the_batcher_goes_on(engine, monkeypatch):
  batcher = engine_lib.Batcher(engine, batch_size=2)
  results = []
  prompt = np.arange(3, dtype=np.int32)
  real_step = engine.step

  def broken(*args, **kwargs):
    raise RuntimeError("device lost")

  monkeypatch.setattr(engine, "step", broken)
  batcher.submit(engine_lib.Request(prompt, SamplingParams(max_tokens=4), results.append))
  with pytest.raises(RuntimeError, match="device lost"):
    batcher.step()
  assert results[0].finish_reason == "error" and "device lost" in results[0].error
  assert batcher.active == 0 and batcher.page_stats()["in_use"] == 0
  monkeypatch.setattr(engine, "step", real_step)
  batcher.submit(engine_lib.Request(prompt, SamplingParams(max_tokens=4), results.append))
  while batcher.step():
    pass
  assert results[1].finish_reason == "length" and len(results[1].tokens) == 4


def test_bad_requests_are_refused_with_the_field_named(params, engine):
  good = np.arange(4, dtype=np.int32)
  cases = [
      (np.zeros(0, np.int32), SamplingParams(), "prompt is empty"),
      (np.array([300], np.int32), SamplingParams(), r"token ids must be in \[0, 256\)"),
      (np.arange(60, dtype=np.int32), SamplingParams(max_tokens=8), "exceeds the cache length 64"),
      (good, SamplingParams(temperature=-1.0), "temperature=-1.0 must be >= 0"),
      (good, SamplingParams(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
      (good, SamplingParams(top_k=-2), "top_k=-2"),
      (good, SamplingParams(max_tokens=0), "max_tokens=0"),
      (good, SamplingParams(stop_tokens=(999,)), "stop_tokens entry 999"),
  ]
  for prompt, settings, message in cases:
    with pytest.raises(RequestError, match=message):
      engine.check_request(prompt, settings)
  with pytest.raises(RequestError, match="unknown field 'temp'"):
    SamplingParams.from_dict({"temp": 1.0}, 256)
  with pytest.raises(RequestError, match="multiple of 4"):
    make_engine(params, "fsdp:4,tensor:2", "fsdp_tp", devices=8).check_batch_size(6)


def _reference_support(logits, temperature, top_k, top_p):
  """The tokens a top-k/top-p sampler may draw, by a plain NumPy sort (float64)."""
  scaled = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-scaled, kind="stable")
  if top_k:
    order = order[:top_k]
  probs = np.exp(scaled[order] - scaled[order].max())
  probs /= probs.sum()
  keep = (np.cumsum(probs) - probs) < top_p
  return set(order[keep].tolist())


@pytest.mark.parametrize("vocab", [40, 3000])  # 3000: more tokens than sampling.CANDIDATES
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.5), (8, 0.7), (1, 1.0)])
def test_sampler_draws_only_from_the_top_k_top_p_set(top_k, top_p, vocab):
  logits = jax.random.normal(jax.random.key(0), (vocab,)) * 3
  draws = 400
  rows = sampling.row_arrays([SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p,
                                             seed=7)] * draws)
  tokens = jax.jit(sampling.sample)(np.tile(logits, (draws, 1)), rows,
                                    np.arange(draws, dtype=np.int32))
  drawn = set(np.asarray(tokens).tolist())
  support = _reference_support(logits, 0.7, top_k, top_p)
  assert drawn <= support
  # With hundreds of draws every kept token of non-negligible mass shows up.
  assert len(drawn) >= min(len(support), 3)
  greedy = sampling.sample(logits[None], sampling.row_arrays([SamplingParams()]),
                           np.zeros(1, np.int32))
  assert int(greedy[0]) == int(np.argmax(logits))


def test_sampler_selects_without_sorting_the_vocabulary():
  rows = sampling.row_arrays([SamplingParams(temperature=1.0, top_k=5, top_p=0.9)] * 2)
  jaxpr = str(jax.make_jaxpr(sampling.sample)(np.zeros((2, 32_000), np.float32), rows,
                                              np.zeros(2, np.int32)))
  assert "top_k" in jaxpr and " sort" not in jaxpr and "sort[" not in jaxpr
  with pytest.raises(RequestError, match=f"top_k=300 must be an integer in \\[0, "
                     f"{sampling.CANDIDATES}\\]"):
    SamplingParams(top_k=300).validate(32_000)


def test_a_mixture_of_experts_generates_what_its_forward_pass_predicts():
  """A Mixtral-style model split over the expert axis generates greedily the tokens its full
  forward pass predicts, one at a time. It trained with capacity routing; the engine routes
  dropless, so no token depends on the others in the batch."""
  cfg = LlamaConfig.preset("moe_tiny", moe_dispatch="capacity", capacity_factor=1.0)
  params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(params=0)),
                                                      nnx.Param)))()
  mesh = sharding.make_mesh(sharding.parse_axis_sizes("fsdp:2,expert:4", "mesh.ici"))
  engine = engine_lib.Engine(cfg, params, mesh, sharding.Rules.preset("fsdp_ep"), 32)
  assert engine.model_cfg.moe_dispatch == "dropless"
  prompts, _ = prompts_and_params(5, seed=4, max_length=12)
  settings = [SamplingParams(max_tokens=6) for _ in prompts]
  generated = tokens_of(engine_lib.generate(engine, prompts, settings, batch_size=8))
  # The reference: the whole sequence so far through the dropless model on one device,
  # right-padded to 32 (causal attention and per-token routing ignore the padding).
  dropless = nnx.merge(nnx.split(nnx.eval_shape(lambda: Llama(
      engine.model_cfg, rngs=nnx.Rngs(params=0))))[0], params)
  forward = jax.jit(lambda tokens: dropless(tokens))
  for prompt, tokens in zip(prompts, generated):
    sequence = list(prompt)
    for _ in range(6):
      padded = np.zeros((1, 32), np.int32)
      padded[0, :len(sequence)] = sequence
      sequence.append(int(np.argmax(forward(padded)[0, len(sequence) - 1])))
    assert tokens == sequence[len(prompt):]
