"""The baselines a click model's held-out AUC is compared with, on the same examples and the
same features (docs/recommendations.md):

- `logistic_regression`: scikit-learn's LogisticRegression (its defaults: L2, C=1, lbfgs) on
  the one-hot (multi-hot for bags) encoding of every categorical feature;
- `matrix_factorization`: logistic matrix factorisation of the user-item matrix alone,
  logit = b + b_user + b_item + <p_user, q_item>, trained with Adam and an L2 penalty
  (Koren et al., 2009, with the log loss of implicit feedback).

  train, test = movielens.split(movielens.read(movielens.fetch(cache)), test_fraction=0.2)
  logistic_regression(train, test)            # held-out ROC AUC
  matrix_factorization(train, test, seed=0)

scikit-learn is an optional dependency: `pip install -e '.[recommendations]'`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import sparse

from toolkit.data import movielens
from toolkit.errors import ConfigError

# Logistic matrix factorisation: rank, L2 penalty per example, Adam's rate, passes, batch.
MF_RANK, MF_L2, MF_LEARNING_RATE, MF_EPOCHS, MF_BATCH = 16, 1e-4, 3e-3, 10, 256


def _sklearn():
  """scikit-learn's linear_model and metrics, or one error naming the install."""
  try:
    from sklearn import linear_model, metrics  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError("the click baselines need scikit-learn: pip install -e "
                      "'.[recommendations]'") from None
  return linear_model, metrics


def multi_hot(examples: movielens.Examples) -> sparse.csr_matrix:
  """(n, sum of the tables' rows): a 1 at each of an example's ids, each feature's columns
  after the previous feature's."""
  offsets = np.concatenate([[0], np.cumsum(examples.rows)])
  n, features, bag = examples.ids.shape
  present = np.arange(bag)[None, None, :] < examples.lengths[:, :, None]
  example, feature, _ = np.nonzero(present)
  columns = examples.ids[present] + offsets[feature]
  return sparse.csr_matrix((np.ones(len(columns)), (example, columns)),
                           shape=(n, int(offsets[-1])))


def logistic_regression(train: movielens.Examples, test: movielens.Examples) -> float:
  """Held-out ROC AUC of scikit-learn's logistic regression at its defaults."""
  linear_model, metrics = _sklearn()
  model = linear_model.LogisticRegression(max_iter=1000).fit(multi_hot(train), train.labels)
  return float(metrics.roc_auc_score(test.labels, model.predict_proba(multi_hot(test))[:, 1]))


def matrix_factorization(train: movielens.Examples, test: movielens.Examples,
                         seed: int = 0) -> float:
  """Held-out ROC AUC of logistic matrix factorisation on (user, item) alone."""
  _, metrics = _sklearn()
  user, item = movielens.FEATURES.index("user"), movielens.FEATURES.index("item")
  users, items = train.rows[user], train.rows[item]
  init_key, order_key = jax.random.split(jax.random.key(seed))
  p_key, q_key = jax.random.split(init_key)
  params = {"bias": jnp.zeros(()), "user_bias": jnp.zeros(users), "item_bias": jnp.zeros(items),
            "p": 0.01 * jax.random.normal(p_key, (users, MF_RANK)),
            "q": 0.01 * jax.random.normal(q_key, (items, MF_RANK))}

  def logits(params, u, i):
    return (params["bias"] + params["user_bias"][u] + params["item_bias"][i]
            + jnp.sum(params["p"][u] * params["q"][i], axis=-1))

  def loss(params, u, i, y):
    z = logits(params, u, i)
    penalty = (jnp.sum(params["p"][u] ** 2) + jnp.sum(params["q"][i] ** 2)
               + jnp.sum(params["user_bias"][u] ** 2) + jnp.sum(params["item_bias"][i] ** 2))
    return jnp.mean(optax.sigmoid_binary_cross_entropy(z, y)) + MF_L2 * penalty / len(y)

  optimizer = optax.adam(MF_LEARNING_RATE)

  @jax.jit
  def epoch(params, state, order):
    def step(carry, index):
      params, state = carry
      grads = jax.grad(loss)(params, u_train[index], i_train[index], y_train[index])
      updates, state = optimizer.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None
    return jax.lax.scan(step, (params, state), order)[0]

  u_train, i_train = jnp.asarray(train.ids[:, user, 0]), jnp.asarray(train.ids[:, item, 0])
  y_train = jnp.asarray(train.labels, jnp.float32)
  batches = len(train) // MF_BATCH
  state = optimizer.init(params)
  for key in jax.random.split(order_key, MF_EPOCHS):
    order = jax.random.permutation(key, len(train))[:batches * MF_BATCH]
    params, state = epoch(params, state, order.reshape(batches, MF_BATCH))
  scores = logits(params, test.ids[:, user, 0], test.ids[:, item, 0])
  return float(metrics.roc_auc_score(test.labels, np.asarray(scores)))
