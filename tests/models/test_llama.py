"""The decoder against an independent float64 NumPy reference, and its structural options."""
import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Llama, LlamaConfig

# float32 model vs float64 reference on the tiny model: measured max |diff| ~1e-6 on logits of
# magnitude ~1; stated once here.
LOGITS_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def _rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _frequencies(cfg: LlamaConfig) -> np.ndarray:
  """Rotary inverse frequencies in float64; for rope_type "llama3" scaled one by one as in
  Meta's Llama 3.1 reference (`apply_scaling`): keep short wavelengths, divide long ones by
  the factor, interpolate between."""
  half = cfg.resolved_head_dim // 2
  freqs = 1.0 / cfg.rope_theta ** (np.arange(half) / half)
  if cfg.rope_type == "default":
    return freqs
  low_wavelength = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
  high_wavelength = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
  scaled = []
  for freq in freqs:
    wavelength = 2 * np.pi / freq
    if wavelength < high_wavelength:
      scaled.append(freq)
    elif wavelength > low_wavelength:
      scaled.append(freq / cfg.rope_factor)
    else:
      smooth = ((cfg.rope_original_max_positions / wavelength - cfg.rope_low_freq_factor)
                / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
      scaled.append((1 - smooth) * freq / cfg.rope_factor + smooth * freq)
  return np.asarray(scaled)


def _rotary(x, inv_freq):
  """x: (length, heads, head_dim); rotate-half convention, positions 0..length-1."""
  length, _, head_dim = x.shape
  half = head_dim // 2
  angles = np.arange(length)[:, None] * inv_freq[None, :]
  sin, cos = np.sin(angles)[:, None, :], np.cos(angles)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(cfg: LlamaConfig, params, tokens: np.ndarray) -> np.ndarray:
  """A plain float64 NumPy forward pass over one sequence, written from the Llama paper's
  description (not from models/llama.py): tokens (length,) -> logits (length, vocab)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = p["embed"][tokens]
  length = len(tokens)
  group = cfg.n_heads // cfg.n_kv_heads
  mask = np.tril(np.ones((length, length), bool))
  inv_freq = _frequencies(cfg)
  for i in range(cfg.n_layers):
    layer = jax.tree.map(lambda a, i=i: a[i], p["layers"])
    h = _rms_norm(x, layer["attention_norm"]["scale"], cfg.norm_eps)
    q = _rotary(np.einsum("te,ehd->thd", h, layer["attention"]["wq"]), inv_freq)
    k = _rotary(np.einsum("te,ehd->thd", h, layer["attention"]["wk"]), inv_freq)
    v = np.einsum("te,ehd->thd", h, layer["attention"]["wv"])
    heads = []
    for head in range(cfg.n_heads):
      kv = head // group
      scores = q[:, head] @ k[:, kv].T / np.sqrt(cfg.resolved_head_dim)
      scores = np.where(mask, scores, -np.inf)
      weights = np.exp(scores - scores.max(-1, keepdims=True))
      weights /= weights.sum(-1, keepdims=True)
      heads.append(weights @ v[:, kv])
    x = x + np.einsum("thd,hde->te", np.stack(heads, 1), layer["attention"]["wo"])
    h = _rms_norm(x, layer["mlp_norm"]["scale"], cfg.norm_eps)
    gate = h @ layer["mlp"]["w_gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ layer["mlp"]["w_up"])) @ layer["mlp"]["w_down"]
  x = _rms_norm(x, p["final_norm"]["scale"], cfg.norm_eps)
  return x @ (p["embed"].T if cfg.tie_embeddings else p["unembed"])


def _model_and_params(cfg, seed=0):
  model = Llama(cfg, rngs=nnx.Rngs(params=jax.random.key(seed)))
  return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_float64_reference(tie):
  cfg = LlamaConfig.preset("tiny", tie_embeddings=tie, init_std=0.2)  # larger init: non-trivial
  model, params = _model_and_params(cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 24))
  logits = np.asarray(model(jnp.asarray(tokens)))
  for row in range(2):
    np.testing.assert_allclose(logits[row], reference_logits(cfg, params, tokens[row]),
                               **LOGITS_TOLERANCE)


# head_dim 8, theta 1e4: wavelengths 6.3, 63, 628, 6283 positions. With original positions 64
# and frequency factors 1 and 4 the first is kept, the second interpolated, the last two
# divided by the factor: every branch of the scaling is used.
LLAMA3_ROPE = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=4.0, rope_original_max_positions=64)


def test_llama3_rope_scaling_matches_float64_reference():
  cfg = LlamaConfig.preset("tiny", init_std=0.2, **LLAMA3_ROPE)
  model, params = _model_and_params(cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 24))
  logits = np.asarray(model(jnp.asarray(tokens)))
  np.testing.assert_allclose(logits[0], reference_logits(cfg, params, tokens[0]),
                             **LOGITS_TOLERANCE)
  # The scaling changes the result: the same weights without it give other logits.
  plain = dataclasses.replace(cfg, rope_type="default")
  assert np.abs(logits[0] - reference_logits(plain, params, tokens[0])).max() > 1e-3


def test_llama_3_2_1b_preset_has_its_rope_scaling():
  cfg = LlamaConfig.preset("1b")
  assert (cfg.rope_type, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
          cfg.rope_original_max_positions, cfg.rope_theta) == ("llama3", 32.0, 1.0, 4.0, 8192,
                                                               500_000.0)


def test_attention_is_causal():
  cfg = LlamaConfig.preset("tiny", init_std=0.2)
  model, _ = _model_and_params(cfg)
  tokens = np.random.default_rng(1).integers(0, 256, size=(1, 16))
  changed = tokens.copy()
  changed[0, 10:] = (changed[0, 10:] + 1) % 256
  a, b = np.asarray(model(jnp.asarray(tokens))), np.asarray(model(jnp.asarray(changed)))
  np.testing.assert_array_equal(a[:, :10], b[:, :10])
  assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-3


@pytest.mark.parametrize("remat,scan", [("none", False), ("full", True), ("save_dots", True),
                                        ("save_dots", False), ("minimal", True),
                                        ("save_attention", False)])
def test_remat_and_scan_do_not_change_the_math(remat, scan):
  base = LlamaConfig.preset("tiny", init_std=0.2)
  variant = dataclasses.replace(base, remat=remat, scan_layers=scan)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, size=(2, 16)))
  m0, p0 = _model_and_params(base)
  m1, p1 = _model_and_params(variant)
  jax.tree.map(np.testing.assert_array_equal, p0, p1)  # same parameter tree either way
  loss = lambda m: jnp.mean(m(tokens) ** 2)
  np.testing.assert_allclose(nnx.jit(loss)(m1), nnx.jit(loss)(m0), rtol=1e-6)
  g0 = nnx.state(nnx.grad(loss)(m0), nnx.Param)
  g1 = nnx.state(nnx.grad(loss)(m1), nnx.Param)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)



@pytest.mark.parametrize("remat,kept,dropped", [
    ("minimal", {"query", "key", "value", "context", "mlp_gate", "mlp_up"}, set()),
    ("save_attention", {"query", "key", "value", "context"}, {"mlp_gate", "mlp_up"})])
def test_named_remat_policies_keep_what_they_say(remat, kept, dropped):
  """What the backward pass keeps from a layer's forward under the named policies: the named
  projections and attention output, never a (batch, heads, q, k) score tensor."""
  cfg = LlamaConfig.preset("tiny", remat=remat, attention="xla", scan_layers=False,
                           n_layers=1)
  model, _ = _model_and_params(cfg)
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, size=(2, 16)))
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  lines = printed.getvalue().splitlines()
  names = {line.split("named '")[1].split("'")[0] for line in lines if "named '" in line}
  assert kept <= names and not dropped & names, names
  # No (batch, heads, q, k) scores (nor (batch, q, heads, k)) among the residuals.
  assert not [line for line in lines if line.startswith(("f32[2,4,16,16]", "f32[2,16,4,16]"))]


def test_bfloat16_compute_tracks_float32():
  cfg = LlamaConfig.preset("tiny", init_std=0.2)
  m32, _ = _model_and_params(cfg)
  m16, _ = _model_and_params(dataclasses.replace(cfg, compute_dtype="bfloat16"))
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, size=(2, 16)))
  out16 = m16(tokens)
  assert out16.dtype == jnp.float32  # logits are returned in float32 for the loss
  # bfloat16 has an 8-bit mantissa: ~1e-2 relative error per op.
  np.testing.assert_allclose(out16, m32(tokens), rtol=0.1, atol=0.1)
  m_params16, p16 = _model_and_params(dataclasses.replace(cfg, param_dtype="bfloat16"))
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(p16))
  del m_params16


@pytest.mark.parametrize("name,expected", [("125m", 0.134e9), ("1b", 1.24e9), ("7b", 6.74e9),
                                           ("70b", 68.98e9)])
def test_presets_have_their_advertised_size(name, expected):
  cfg = LlamaConfig.preset(name)
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  counted = sum(a.size for a in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert counted == cfg.num_params()
  assert counted == pytest.approx(expected, rel=0.03)


def test_every_parameter_has_logical_axes():
  from sharding import LOGICAL_AXES  # pylint: disable=g-import-not-at-top
  abstract = nnx.eval_shape(lambda: Llama(LlamaConfig.preset("cpu"), rngs=nnx.Rngs(0)))
  for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    axes = variable.get_metadata()["out_sharding"]
    assert len(axes) == variable.get_value().ndim, path
    assert all(a in LOGICAL_AXES for a in axes), (path, axes)


@pytest.mark.parametrize("field,value,message", [
    ("n_kv_heads", 3, "not a multiple of model.n_kv_heads"),
    ("d_model", 30, "set model.head_dim explicitly"),
    ("remat", "sometimes", "model.remat='sometimes'"),
    ("compute_dtype", "float16", "model.compute_dtype='float16'"),
    ("n_layers", 0, "model.n_layers=0 must be >= 1"),
    ("rope_type", "yarn", "model.rope_type='yarn'"),
    ("rope_factor", 0.5, "rope_type='llama3' needs rope_factor >= 1")])
def test_config_errors_name_the_field(field, value, message):
  base = LlamaConfig.preset("tiny", **(LLAMA3_ROPE if field == "rope_factor" else {}))
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
    dataclasses.replace(base, **{field: value}).validate()
