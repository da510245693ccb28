"""Preference pairs for preference tuning (toolkit/training/objectives/dpo.py): a prompt with a
preferred (chosen) and a dispreferred (rejected) completion, through the model's chat template,
as rows that each side's log-probability is read from.

Records. JSONL files (one pair per line) or Parquet (one per row), each
    {"prompt": "..." | [messages], "chosen": "..." | [messages], "rejected": "..." | [messages]}
trl's explicit-prompt preference form: a string prompt is one user turn, a string completion
one assistant turn; lists are messages as in chat data (toolkit/data/chat.py), so a prompt may
hold a system turn and earlier turns of the conversation. A record that is not such a pair, or
whose two completions are the same, is one error naming the file and the line.
`synthetic:NAME[:COUNT]` reads a built-in task (toolkit/data/instruct.py) instead: the prompt
is the instruction, chosen its right answer and rejected the right answer of another
instruction of the same split, so a wrong answer of the right form (for `repeat`, another
word).

Tokens. Each side is the prompt followed by its completion, rendered by the chat template and
tokenized as chat data is (`ChatTokenizer.encode`). Its completion tokens, the only ones a side's
log-probability sums over, are the assistant tokens past the prompt rendered with the
generation prompt (so an assistant turn inside the prompt counts for nothing); the prompt's
tokens must be the first tokens of both sides, or the pair is refused by name. A side longer
than `seq_len` + 1 tokens is cut to its first `seq_len` + 1 (`overlong="truncate"`; a pair
where a side keeps no completion token is dropped) or the pair is left out (`"drop"`).

Rows. `Pairs` holds every pair as (pairs, 2, seq_len) arrays, side 0 chosen and side 1
rejected: "inputs" and "targets" int32 (target t is token t + 1) and "completion_weights"
float32, 1 on the targets that are completion tokens and 0 on the prompt's and on padding. A
batch keeps its pairs whole on the leading axis, so however it is split over devices or into
micro-batches, both sides of a pair stay together. `PreferenceBatches` serves them: batch `s`
is a pure function of (seed, s), each epoch a new permutation of the pairs; the held-out
batches are the held-out pairs in order.

Reference. With `dpo.reference="precomputed"` (`reference_precomputed`) each batch also holds
"reference_logps" (pairs, 2) float32: each side's completion log-probability under the starting
weights, computed once before the first step (toolkit/training/dpo_reference.py) and attached
with `attach_reference`, so the step needs neither a second copy of the weights nor a second
forward pass.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from toolkit.data import chat, instruct, keys
from toolkit.data.chat_template import ChatTokenizer
from toolkit.data.feed import BatchIterator, Position, local_rows, step_iterator
from toolkit.errors import ConfigError

Messages = list[dict]
KEYS = ("inputs", "targets", "completion_weights")
REFERENCE = keys.REFERENCE_LOGPS  # (pairs, 2) float32, with dpo.reference="precomputed"
def reference_precomputed(reference: str, lora_rank: int) -> bool:
  """Whether DPO's reference log-probabilities are precomputed (dpo.reference, whose values
  toolkit/training/objectives/tasks.py `REFERENCES` lists): "precomputed", or "auto" without LoRA
  adapters; "base" (and "auto" with adapters) is the adapters' base model and "frozen" a copy
  of the starting weights in the train state, each run beside the policy in each step."""
  return reference == "precomputed" or (reference == "auto" and not lora_rank)


@dataclasses.dataclass(frozen=True)
class Pair:
  prompt: Messages
  chosen: Messages
  rejected: Messages
  where: str  # "FILE line N", "FILE row N", "synthetic:NAME train #N"


def _side(value, where: str, field: str, role: str) -> Messages:
  if isinstance(value, str):
    return [{"role": role, "content": value}]
  return chat.message_list(value, where, field)


def parse_record(record, where: str) -> Pair:
  """The pair of one JSON object (module docstring)."""
  if not isinstance(record, dict):
    raise ConfigError(f"{where}: not a JSON object; give {{\"prompt\": ..., \"chosen\": ..., "
                      f"\"rejected\": ...}}")
  missing = [key for key in ("prompt", "chosen", "rejected") if key not in record]
  if missing:
    raise ConfigError(f"{where}: has no {', '.join(map(repr, missing))} (keys: "
                      f"{', '.join(sorted(record)) or 'none'}); a preference pair needs "
                      f"\"prompt\", \"chosen\" and \"rejected\"")
  pair = Pair(_side(record["prompt"], where, "prompt", "user"),
              _side(record["chosen"], where, "chosen", "assistant"),
              _side(record["rejected"], where, "rejected", "assistant"), where)
  if pair.chosen == pair.rejected:
    raise ConfigError(f"{where}: \"chosen\" and \"rejected\" are the same completion, which "
                      f"states no preference; remove the pair or fix one side")
  return pair


def synthetic_pairs(name: str, split: str, count: int = instruct.TRAIN) -> list[Pair]:
  """Task `name`'s instructions of `split` as pairs: chosen the right answer, rejected the
  answer of the next instruction in the split that answers differently."""
  conversations = instruct.conversations(name, split, count)
  answers = [c[-1]["content"] for c in conversations]
  pairs = []
  for i, conversation in enumerate(conversations):
    j = next(k % len(answers) for k in range(i + 1, i + 1 + len(answers))
             if answers[k % len(answers)] != answers[i])
    pairs.append(Pair(conversation[:-1], conversation[-1:],
                      [{"role": "assistant", "content": answers[j]}],
                      f"synthetic:{name} {split} #{i}"))
  return pairs


def read_pairs(spec: str, field: str = "data.path", split: str = "train") -> list[Pair]:
  """Every pair of `spec` (files, or `synthetic:NAME`'s `split`), in file order."""
  task = instruct.parse(spec)
  if task is not None:
    return synthetic_pairs(task[0], split, task[1])
  found = [parse_record(record, where) for path in chat.data_files(spec, field)
           for where, record in chat.records(path)]
  if not found:
    raise ConfigError(f"{field}={spec!r} holds no preference pairs")
  return found


@dataclasses.dataclass(frozen=True)
class Pairs:
  """Tokenized pairs: each of KEYS (pairs, 2, seq_len), side 0 chosen, side 1 rejected."""
  name: str
  arrays: dict[str, np.ndarray]
  truncated: int = 0
  dropped: int = 0

  def __len__(self) -> int:
    return len(self.arrays["inputs"])


def _encode_side(tokenizer: ChatTokenizer, pair: Pair, completion: Messages,
                 prompt_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, completion mask) of the prompt followed by `completion`."""
  ids, assistant = tokenizer.encode(pair.prompt + completion, "assistant")
  if ids.size < prompt_ids.size or not np.array_equal(ids[:prompt_ids.size], prompt_ids):
    raise ConfigError(f"{pair.where}: the chat template's tokens for the prompt are not the "
                      f"first tokens of the prompt with its completion, so the completion "
                      f"cannot be told apart; check the template (data.chat_template)")
  completion_mask = assistant.copy()
  completion_mask[:prompt_ids.size] = False
  if not completion_mask.any():
    raise ConfigError(f"{pair.where}: a completion renders to no assistant tokens; give it "
                      f"as an assistant turn")
  return ids, completion_mask


def tokenize(pairs: list[Pair], tokenizer: ChatTokenizer, seq_len: int, name: str,
             overlong: str = "truncate") -> Pairs:
  """The pairs as rows of `seq_len` positions (module docstring)."""
  rows = {key: [] for key in KEYS}
  truncated = dropped = 0
  for pair in pairs:
    try:
      prompt_ids = tokenizer.encode_prompt(pair.prompt)
      sides = [_encode_side(tokenizer, pair, c, prompt_ids) for c in (pair.chosen, pair.rejected)]
    except ConfigError as e:
      message = str(e)
      raise ConfigError(message if message.startswith(pair.where)
                        else f"{pair.where}: {message}") from None
    if max(ids.size for ids, _ in sides) > seq_len + 1:
      sides = [(ids[:seq_len + 1], mask[:seq_len + 1]) for ids, mask in sides]
      if overlong == "drop" or not all(mask[1:].any() for _, mask in sides):
        dropped += 1
        continue
      truncated += 1
    padded = {key: np.zeros((2, seq_len), np.float32 if key == KEYS[2] else np.int32)
              for key in KEYS}
    for side, (ids, mask) in enumerate(sides):
      n = ids.size - 1
      padded["inputs"][side, :n] = ids[:-1]
      padded["targets"][side, :n] = ids[1:]
      padded["completion_weights"][side, :n] = mask[1:]
    for key in KEYS:
      rows[key].append(padded[key])
  if not rows["inputs"]:
    raise ConfigError(f"all {len(pairs)} preference pairs of {name} are longer than "
                      f"data.seq_len={seq_len} + 1 tokens and were dropped (data.overlong="
                      f"{overlong!r}); raise data.seq_len or use data.overlong='truncate'")
  return Pairs(name, {key: np.stack(value) for key, value in rows.items()}, truncated, dropped)


@dataclasses.dataclass(frozen=True)
class PreferenceData:
  """A run's tokenized pairs and the lines the start-up log prints about them."""
  train: Pairs
  held_out: Pairs
  tokenizer: ChatTokenizer
  notes: tuple[str, ...]

  @classmethod
  def from_config(cls, data_config, init_from: str = "") -> PreferenceData:
    d = data_config
    tokenizer = ChatTokenizer.load(chat.tokenizer_path(d, init_from), d.chat_template)
    train, held_out, source = chat.split_conversations(d, read_pairs, "preference pair")
    splits = (tokenize(train, tokenizer, d.seq_len, d.path, d.overlong),
              tokenize(held_out, tokenizer, d.seq_len, d.eval_path or f"{d.path} (held out)",
                       d.overlong))
    notes = (f"preference pairs: {len(splits[0]):,} training from {d.path}, {len(splits[1]):,} "
             f"held out ({source}), through {tokenizer.name}'s chat template",)
    return cls(splits[0], splits[1], tokenizer, notes)

  def check_vocab(self, vocab_size: int) -> None:
    chat.ChatData.check_vocab(self, vocab_size)


class PreferenceBatches:
  """Training and held-out batches of `pairs_per_batch` pairs, (pairs, 2, seq_len) each key,
  split over the mesh's batch axes by the leading (pair) axis."""

  def __init__(self, train: Pairs, held_out: Pairs, seed: int, pairs_per_batch: int,
               eval_batches: int, sharding: NamedSharding, notes: tuple[str, ...] = (),
               precomputed_reference: bool = False):
    if len(held_out) < pairs_per_batch:
      raise ConfigError(f"{held_out.name} holds {len(held_out)} pair(s), fewer than one batch "
                        f"of {pairs_per_batch}; give more held-out pairs or a smaller "
                        f"data.global_batch_size")
    self.train, self.held_out, self.seed, self.notes = train, held_out, seed, notes
    self.pairs_per_batch, self.sharding = pairs_per_batch, sharding
    self.eval_batches = min(eval_batches, len(held_out) // pairs_per_batch)
    self.shape = (pairs_per_batch, 2, train.arrays["inputs"].shape[-1])
    self.rows = local_rows(sharding, self.shape)
    self.precomputed_reference = precomputed_reference
    self.reference: dict[str, np.ndarray] | None = None  # "train", "held_out": (pairs, 2)
    spec = tuple(sharding.spec) + (None,) * 3
    self.reference_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[:2]))

  def attach_reference(self, train: np.ndarray, held_out: np.ndarray) -> None:
    """The starting weights' log-probabilities of each split's pairs, (pairs, 2) each."""
    for name, pairs, logps in (("train", self.train, train), ("held_out", self.held_out,
                                                               held_out)):
      if logps.shape != (len(pairs), 2):
        raise ValueError(f"{name} reference log-probabilities are {logps.shape}, not "
                         f"({len(pairs)}, 2)")
    self.reference = {"train": np.asarray(train, np.float32),
                      "held_out": np.asarray(held_out, np.float32)}

  def _rows(self, split: str, picked: np.ndarray) -> dict[str, np.ndarray]:
    pairs = self.train if split == "train" else self.held_out
    rows = {key: pairs.arrays[key][picked] for key in KEYS}
    if self.precomputed_reference:
      if self.reference is None:
        raise RuntimeError("dpo.reference='precomputed': attach_reference before the batches")
      rows[REFERENCE] = self.reference[split][picked]
    return rows

  def indices(self, step: int) -> np.ndarray:
    """The training pairs of batch `step`: positions step x P ... of the epochs' permutations."""
    n = len(self.train)
    position = step * self.pairs_per_batch + np.arange(self.pairs_per_batch)
    epochs, within = np.divmod(position, n)
    order = {int(e): np.random.default_rng([self.seed, int(e)]).permutation(n)
             for e in np.unique(epochs)}
    return np.asarray([order[int(e)][i] for e, i in zip(epochs, within)])

  def host_batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's pairs of batch `step`, on the host."""
    return self._rows("train", self.indices(step)[self.rows])

  def place(self, rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's `rows` of a batch as global arrays (KEYS, and REFERENCE if given)."""
    def make(key, x):
      if key == REFERENCE:
        return jax.make_array_from_process_local_data(self.reference_sharding, x,
                                                      self.shape[:2])
      return jax.make_array_from_process_local_data(self.sharding, x, self.shape)
    with jax.transfer_guard_host_to_device("allow"):  # a deliberate transfer (text.Batches)
      return {key: make(key, value) for key, value in rows.items()}

  def batch(self, step: int) -> dict[str, jax.Array]:
    return self.place(self.host_batch(step))

  def eval_batch(self, index: int) -> dict[str, jax.Array]:
    """Held-out batch `index`: pairs index x P ... in order, the same at every evaluation."""
    picked = (index * self.pairs_per_batch + np.arange(self.pairs_per_batch))[self.rows]
    return self.place(self._rows("held_out", picked))

  def iterator(self, start_step: int, position: Position | None = None,
               prefetch: int = 2) -> BatchIterator:
    """Batches from `start_step` on; a batch is a pure function of the step, so the saved
    `position` holds nothing more than the step."""
    del position
    return step_iterator(self.host_batch, self.place, start_step, prefetch)

  def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
    abstract = {key: jax.ShapeDtypeStruct(self.shape, np.float32 if key == KEYS[2] else np.int32,
                                          sharding=self.sharding) for key in KEYS}
    if self.precomputed_reference:
      abstract[REFERENCE] = jax.ShapeDtypeStruct(self.shape[:2], np.float32,
                                                 sharding=self.reference_sharding)
    return abstract

  def describe(self) -> str:
    share = lambda p: p.arrays["completion_weights"].sum() / max(p.arrays["inputs"].size, 1)
    return "\n".join([*self.notes, (
        f"preference pairs: {len(self.train):,} training, {len(self.held_out):,} held out "
        f"({self.eval_batches} batch(es) per eval), {self.pairs_per_batch} a batch (2 rows "
        f"each); {share(self.train):.0%} of the positions are completion tokens; longer than "
        f"seq_len + 1: {self.train.truncated + self.held_out.truncated} truncated, "
        f"{self.train.dropped + self.held_out.dropped} dropped")])
