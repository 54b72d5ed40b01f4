"""Synthetic training tasks for small hybrid LMs, with evaluation helpers.

Two tasks, both deterministic given a seed (batches are drawn with numpy,
whose generators give the same bits on every platform and jax version):

  MQARTask   multi-query associative recall (Zoology / Based papers):
             key-value pairs, then queries of earlier keys; the model must
             emit each queried key's value. Loss and accuracy only at the
             query positions.
  CharTask   character-level language modelling of a built-in corpus of
             templated English sentences and arithmetic facts (generated
             here, no download); train/val split, random crops; scored by
             per-character cross-entropy / perplexity.

A batch is a dict of numpy arrays (next-token prediction):
  inputs   [batch, seq_len] int32 token ids fed to the model;
  targets  [batch, seq_len] int32, targets[:, t] = the token after
           inputs[:, t];
  mask     [batch, seq_len] float32, 1 where the target is scored.

Evaluation, full sequence or decode:

  task.evaluate(model, batches)               full-forward metrics
  task.decode_evaluate(model, batches, ssm_mode="replay", buffer_len=16,
                       checkpoint_dtype=jnp.bfloat16)
  forward_logits(model, inputs)               jitted model(inputs)
  forward_metrics(model, batch)               one batch, full forward
  decode_metrics(model, batch, ssm_mode, buffer_len, **state_kwargs)
  decode_accuracy(model, batch, ssm_mode, buffer_len, **state_kwargs)

The decode helpers run the model in DECODE mode: `prefill` of the first
`prefill_len` tokens, then `decode_step` over the rest of the inputs
(teacher-forced, one `lax.scan` under `jax.jit`), and score the same
positions as the full forward. `**state_kwargs` go to `model.init_state`
(checkpoint_dtype, buffer_dtype, kv_dtype, ...), so decode-time state
policies can be compared on trained models.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

F32 = jnp.float32
SPLITS = ("train", "val")
Batch = dict  # {"inputs", "targets", "mask"} -> np.ndarray


def _positive_int(name: str, v: Any, minimum: int = 1) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}.")
  return int(v)


def _split_id(split: str) -> int:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
  return SPLITS.index(split)


# ------------------------------------------------------------------ base
class Task:
  """Shared batch iteration and evaluation of the tasks.

  Subclasses set `name`, `vocab_size`, `seq_len` and implement
  `batch(index, batch_size, split)` and `to_dict()`.
  """
  name: str = ""
  vocab_size: int
  seq_len: int
  # The metric that summarizes a run (model selection, plots).
  headline_metric: str = "accuracy"

  def batch(self, index: int, batch_size: int, split: str = "train") -> Batch:
    raise NotImplementedError

  def to_dict(self) -> dict:
    raise NotImplementedError

  def batches(self, batch_size: int, split: str = "train",
              start: int = 0) -> Iterator[Batch]:
    """Endless iterator over batches `start`, `start + 1`, ... of `split`.

    Batch i is a pure function of (task settings, seed, split, i), so a
    run restarted at step i sees the same data.
    """
    _positive_int("batch_size", batch_size)
    _split_id(split)
    i = _positive_int("start", start, 0)
    while True:
      yield self.batch(i, batch_size, split)
      i += 1

  def eval_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
    """The fixed validation batches 0 .. num_batches - 1."""
    _positive_int("num_batches", num_batches)
    return [self.batch(i, batch_size, "val") for i in range(num_batches)]

  def evaluate(self, model, batches: Sequence[Batch]) -> dict:
    """Full-forward metrics summed over `batches` (see `Metrics`)."""
    return _aggregate(forward_sums(model, b) for b in _as_list(batches))

  def decode_evaluate(self, model, batches: Sequence[Batch],
                      ssm_mode: str = "replay", buffer_len: int = 16, *,
                      prefill_len: int = 1,
                      implementation: str | None = None,
                      **state_kwargs) -> dict:
    """Like `evaluate`, with the logits of a prefill + teacher-forced
    decode (`decode_logits`) instead of the full forward."""
    return _aggregate(
        decode_sums(model, b, ssm_mode, buffer_len, prefill_len=prefill_len,
                    implementation=implementation, **state_kwargs)
        for b in _as_list(batches))


def _as_list(batches) -> list:
  if isinstance(batches, dict):
    batches = [batches]
  batches = list(batches)
  if not batches:
    raise ValueError("batches must hold at least one batch.")
  return batches


# ------------------------------------------------------------------ MQAR
@dataclasses.dataclass(frozen=True)
class MQARTask(Task):
  """Multi-query associative recall.

  Token layout: 0 is the filler token; keys are 1 .. num_keys and values
  num_keys + 1 .. vocab_size - 1 (num_keys = (vocab_size - 1) // 2). A
  sequence of seq_len + 1 tokens is

    k_1 v_1 k_2 v_2 ... k_N v_N | filler with num_queries pairs "k v"

  with N = num_kv_pairs distinct random keys, random values (repeats
  allowed), and the queries: num_queries distinct keys among the N (random
  order), each followed by its value, placed at random pair-aligned slots of
  the query region (Zoology places them with a power law; here uniformly).
  inputs = tokens[:-1], targets = tokens[1:], mask = 1 exactly at the input
  positions holding a query key (whose target is its value).

  Attributes:
    vocab_size: token ids (>= 2 * num_kv_pairs + 1).
    num_kv_pairs: key-value pairs N in the context.
    seq_len: model input length (>= 2 * (num_kv_pairs + num_queries) - 1).
    num_queries: queries per sequence (<= num_kv_pairs; default N).
    seed: data seed.
  """
  vocab_size: int = 64
  num_kv_pairs: int = 8
  seq_len: int = 64
  num_queries: int | None = None
  seed: int = 0
  name = "mqar"
  headline_metric = "accuracy"

  def __post_init__(self):
    _positive_int("vocab_size", self.vocab_size)
    n = _positive_int("num_kv_pairs", self.num_kv_pairs)
    _positive_int("seq_len", self.seq_len)
    if self.num_queries is None:
      object.__setattr__(self, "num_queries", n)
    q = _positive_int("num_queries", self.num_queries)
    _positive_int("seed", self.seed, 0)
    if q > n:
      raise ValueError(f"num_queries ({q}) must be <= num_kv_pairs ({n}): "
                       f"queried keys are distinct.")
    if self.num_keys < n or self.num_values < 1:
      raise ValueError(f"vocab_size {self.vocab_size} is too small for "
                       f"{n} distinct keys: need vocab_size >= {2 * n + 1} "
                       f"(filler + keys + values).")
    if self.query_slots < q:
      raise ValueError(f"seq_len {self.seq_len} is too short for {n} pairs "
                       f"and {q} queries: need seq_len >= {2 * (n + q) - 1}.")

  @property
  def num_keys(self) -> int:
    return (self.vocab_size - 1) // 2

  @property
  def num_values(self) -> int:
    return self.vocab_size - 1 - self.num_keys

  @property
  def query_slots(self) -> int:
    """Pair-aligned slots for queries after the key-value pairs."""
    return (self.seq_len + 1 - 2 * self.num_kv_pairs) // 2

  def to_dict(self) -> dict:
    return dict(name=self.name, vocab_size=self.vocab_size,
                num_kv_pairs=self.num_kv_pairs, seq_len=self.seq_len,
                num_queries=self.num_queries, seed=self.seed)

  def batch(self, index: int, batch_size: int, split: str = "train") -> Batch:
    """Batch `index` of `split` (a pure function of the arguments)."""
    index = _positive_int("index", index, 0)
    b = _positive_int("batch_size", batch_size)
    rng = np.random.default_rng((self.seed, _split_id(split), index))
    n, q = self.num_kv_pairs, self.num_queries
    # Distinct keys per row: the first n of a random permutation.
    keys = np.argsort(rng.random((b, self.num_keys)), axis=1)[:, :n] + 1
    values = rng.integers(0, self.num_values, (b, n)) + 1 + self.num_keys
    which = np.argsort(rng.random((b, n)), axis=1)[:, :q]  # queried pairs
    slots = np.argsort(rng.random((b, self.query_slots)), axis=1)[:, :q]
    pos = 2 * n + 2 * slots  # [b, q] position of each query key
    tokens = np.zeros((b, self.seq_len + 1), np.int32)
    tokens[:, 0:2 * n:2] = keys
    tokens[:, 1:2 * n:2] = values
    rows = np.arange(b)[:, None]
    tokens[rows, pos] = np.take_along_axis(keys, which, axis=1)
    tokens[rows, pos + 1] = np.take_along_axis(values, which, axis=1)
    mask = np.zeros((b, self.seq_len), np.float32)
    mask[rows, pos] = 1.0
    return dict(inputs=tokens[:, :-1].copy(), targets=tokens[:, 1:].copy(),
                mask=mask)


# ------------------------------------------------------------ char corpus
# Fixed character vocabulary (id = index); the corpus only uses these.
CHARS = ("\n !'(),-.:;=?*+0123456789"
         "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")

_NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi",
          "Ivan", "Judy", "Mallory", "Oscar", "Peggy", "Trent", "Victor",
          "Walter")
_NOUNS = ("cat", "dog", "bird", "fox", "horse", "teacher", "farmer",
          "child", "sailor", "baker", "king", "queen", "robot", "student",
          "doctor", "painter")
_ADJS = ("small", "old", "young", "quiet", "happy", "clever", "tired",
         "brave", "gray", "red", "tall", "lazy", "kind", "strange")
_OBJS = ("apple", "letter", "book", "stone", "key", "song", "river", "hat",
         "lamp", "map", "box", "ship", "garden", "window", "coin", "bell")
_VERBS = (("sees", "see", "saw"), ("finds", "find", "found"),
          ("likes", "like", "liked"), ("carries", "carry", "carried"),
          ("paints", "paint", "painted"), ("opens", "open", "opened"),
          ("follows", "follow", "followed"), ("watches", "watch", "watched"),
          ("keeps", "keep", "kept"), ("loses", "lose", "lost"))
_PLACES = ("in the garden", "near the river", "at the market", "on the hill",
           "under the bridge", "by the window", "in the old house",
           "at night", "in the morning", "after the rain")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six",
                 "seven", "eight", "nine", "ten", "eleven", "twelve")


class _Gen:
  """A tiny deterministic sentence generator over a numpy Generator."""

  def __init__(self, rng: np.random.Generator):
    self._rng = rng
    self._u, self._i = [], 0

  def uniform(self) -> float:
    if self._i == len(self._u):  # numpy draws in bulk (cheaper per draw)
      self._u, self._i = self._rng.random(1 << 16).tolist(), 0
    self._i += 1
    return self._u[self._i - 1]

  def integers(self, lo: int, hi: int | None = None) -> int:
    """Uniform int in [lo, hi) ([0, lo) when hi is None)."""
    lo, hi = (0, lo) if hi is None else (lo, hi)
    return lo + min(int(self.uniform() * (hi - lo)), hi - lo - 1)

  def pick(self, seq):
    return seq[self.integers(len(seq))]

  def chance(self, p: float) -> bool:
    return self.uniform() < p

  def subject(self):
    """(text, plural) of a subject noun phrase."""
    if self.chance(0.3):
      return self.pick(_NAMES), False
    plural = self.chance(0.35)
    noun = self.pick(_NOUNS)
    noun = noun + ("es" if noun.endswith("x") else "s") if plural else noun
    det = self.pick(("the", "some", "two", "many") if plural
                    else ("the", "a", "my", "one"))
    if self.chance(0.5):
      noun = f"{self.pick(_ADJS)} {noun}"
    return f"{det} {noun}", plural

  def obj(self):
    o = self.pick(_OBJS)
    if self.chance(0.4):
      o = f"{self.pick(_ADJS)} {o}"
    det = self.pick(("the", "a", "her", "his", "their"))
    if det == "a" and o[0] in "aeiou":
      det = "an"
    return f"{det} {o}"

  def sentence(self) -> str:
    kind = int(self.integers(7))
    if kind <= 2:  # agreement: singular "sees" / plural "see" / past "saw"
      subj, plural = self.subject()
      s, p, past = self.pick(_VERBS)
      tense = int(self.integers(3))
      verb = past if tense == 2 else (p if plural else s)
      text = f"{subj} {verb} {self.obj()}"
      if self.chance(0.5):
        text += f" {self.pick(_PLACES)}"
      return text[0].upper() + text[1:] + "."
    if kind == 3:  # addition with the right answer
      a, b = int(self.integers(100)), int(self.integers(100))
      return f"{a} + {b} = {a + b}."
    if kind == 4:  # small products
      a, b = int(self.integers(13)), int(self.integers(13))
      return f"{a} * {b} = {a * b}."
    if kind == 5:  # counting in words from a random start
      start = int(self.integers(6))
      n = int(self.integers(3, 7))
      words = _NUMBER_WORDS[start:start + n]
      return ("Count: " + ", ".join(words) + ".") if words else "Count."
    subj, plural = self.subject()  # questions
    s, p, _ = self.pick(_VERBS)
    q = f"{'Do' if plural else 'Does'} {subj} {p} {self.obj()}?"
    return q


@functools.lru_cache(maxsize=4)
def char_corpus(num_chars: int = 150_000, seed: int = 0) -> str:
  """The built-in corpus: `num_chars` characters of generated text.

  Lines of 1-4 sentences: templated English with subject-verb agreement
  (singular / plural / past), correct additions ("17 + 25 = 42.") and
  products, counting in words, and yes/no questions. Deterministic given
  (num_chars, seed); every character is in `CHARS`.
  """
  _positive_int("num_chars", num_chars)
  gen = _Gen(np.random.default_rng((seed, 12345)))
  parts, total = [], 0
  while total < num_chars:
    line = " ".join(gen.sentence() for _ in range(int(gen.integers(1, 5))))
    parts.append(line + "\n")
    total += len(line) + 1
  return "".join(parts)[:num_chars]


def encode_chars(text: str) -> np.ndarray:
  """Text -> int32 ids in `CHARS` (ValueError on other characters)."""
  table = {c: i for i, c in enumerate(CHARS)}
  bad = sorted(set(text) - set(table))
  if bad:
    raise ValueError(f"characters {bad} are not in the char vocabulary.")
  return np.fromiter((table[c] for c in text), np.int32, len(text))


def decode_chars(ids) -> str:
  """int ids -> text (ids >= len(CHARS), e.g. padding of a larger model
  vocab, become '?')."""
  return "".join(CHARS[i] if 0 <= i < len(CHARS) else "?"
                 for i in np.asarray(ids).ravel().tolist())


@dataclasses.dataclass(frozen=True)
class CharTask(Task):
  """Next-character prediction on the built-in corpus (`char_corpus`).

  The last `val_fraction` of the corpus is the validation text. Training
  batches are random crops of seq_len + 1 characters of the training text;
  validation batch i holds the non-overlapping windows i * batch_size ..
  (i + 1) * batch_size - 1 of the validation text (seq_len apart, wrapping
  around). Every position is scored.

  Attributes:
    seq_len: model input length.
    corpus_chars: corpus size in characters.
    val_fraction: share of the corpus held out for validation.
    vocab_size: model vocab (>= len(CHARS); larger pads, never targets).
    seed: data seed (crops) -- the corpus itself depends on corpus_seed.
    corpus_seed: seed of the generated corpus.
  """
  seq_len: int = 128
  corpus_chars: int = 150_000
  val_fraction: float = 0.1
  vocab_size: int = len(CHARS)
  seed: int = 0
  corpus_seed: int = 0
  name = "char"
  headline_metric = "loss"

  def __post_init__(self):
    _positive_int("seq_len", self.seq_len)
    _positive_int("corpus_chars", self.corpus_chars)
    _positive_int("seed", self.seed, 0)
    _positive_int("corpus_seed", self.corpus_seed, 0)
    if self.vocab_size < len(CHARS):
      raise ValueError(f"vocab_size must be >= {len(CHARS)} (the char "
                       f"vocabulary), got {self.vocab_size!r}.")
    if not 0 < self.val_fraction < 1:
      raise ValueError(f"val_fraction must lie in (0, 1), got "
                       f"{self.val_fraction!r}.")
    n_val = int(self.corpus_chars * self.val_fraction)
    if min(n_val, self.corpus_chars - n_val) < self.seq_len + 1:
      raise ValueError(f"corpus_chars {self.corpus_chars} x val_fraction "
                       f"{self.val_fraction} leaves a split shorter than "
                       f"seq_len + 1 = {self.seq_len + 1}.")

  @functools.cached_property
  def _splits(self) -> tuple[np.ndarray, np.ndarray]:
    ids = encode_chars(char_corpus(self.corpus_chars, self.corpus_seed))
    n_val = int(len(ids) * self.val_fraction)
    return ids[:-n_val], ids[-n_val:]

  def text(self, split: str = "train") -> np.ndarray:
    """The ids of a split's text (a read-only view)."""
    out = self._splits[_split_id(split)].view()
    out.flags.writeable = False
    return out

  def to_dict(self) -> dict:
    return dict(name=self.name, seq_len=self.seq_len,
                corpus_chars=self.corpus_chars,
                val_fraction=self.val_fraction, vocab_size=self.vocab_size,
                seed=self.seed, corpus_seed=self.corpus_seed)

  def batch(self, index: int, batch_size: int, split: str = "train") -> Batch:
    """Batch `index` of `split` (a pure function of the arguments)."""
    index = _positive_int("index", index, 0)
    b = _positive_int("batch_size", batch_size)
    ids = self._splits[_split_id(split)]
    hi = len(ids) - self.seq_len - 1  # last valid crop start
    if split == "train":
      rng = np.random.default_rng((self.seed, 0, index))
      starts = rng.integers(0, hi + 1, b)
    else:  # consecutive non-overlapping windows, wrapping around
      windows = (hi + self.seq_len) // self.seq_len
      starts = ((index * b + np.arange(b)) % windows) * self.seq_len
    crops = ids[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]
    return dict(inputs=crops[:, :-1].astype(np.int32),
                targets=crops[:, 1:].astype(np.int32),
                mask=np.ones((b, self.seq_len), np.float32))


TASKS = {"mqar": MQARTask, "char": CharTask}


def make_task(spec: dict) -> Task:
  """A task from a dict {"name": "mqar" | "char", **fields} (e.g. from
  `task.to_dict()` or a config); `spec` is not modified."""
  if not isinstance(spec, dict) and hasattr(spec, "to_dict"):
    spec = spec.to_dict()  # ml_collections.ConfigDict
  if not isinstance(spec, dict) or "name" not in spec:
    raise ValueError(f"task spec must be a dict with a 'name' in "
                     f"{sorted(TASKS)}, got {spec!r}.")
  kwargs = dict(spec)
  name = kwargs.pop("name")
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}.")
  fields = {f.name for f in dataclasses.fields(TASKS[name])}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ValueError(f"unknown fields {unknown} for task {name!r}; valid: "
                     f"{sorted(fields)}.")
  return TASKS[name](**kwargs)


# ---------------------------------------------------------------- metrics
def masked_sums(logits, targets, mask) -> dict:
  """Sums over the scored positions (traceable): cross-entropy `loss_sum`,
  `correct` greedy predictions and `count` (all float32 scalars)."""
  logits = logits.astype(F32)
  mask = mask.astype(F32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32),
                            axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(F32)
  return dict(loss_sum=jnp.sum((logz - tgt) * mask),
              correct=jnp.sum(correct * mask), count=jnp.sum(mask))


def masked_loss(logits, targets, mask):
  """Mean cross-entropy over the scored positions (traceable)."""
  s = masked_sums(logits, targets, mask)
  return s["loss_sum"] / jnp.maximum(s["count"], 1.0)


def finalize(sums: dict) -> dict:
  """Sums -> metrics: loss (mean CE, nats), accuracy (greedy), perplexity,
  bits_per_token and num_targets."""
  n = float(sums["count"])
  if n <= 0:
    raise ValueError("no scored positions (the mask is all zero).")
  loss = float(sums["loss_sum"]) / n
  return dict(loss=loss, accuracy=float(sums["correct"]) / n,
              perplexity=math.exp(min(loss, 700.0)),
              bits_per_token=loss / math.log(2), num_targets=int(n))


def _aggregate(sums_iter) -> dict:
  total = None
  for s in sums_iter:
    s = {k: float(v) for k, v in s.items()}
    total = s if total is None else {k: total[k] + s[k] for k in total}
  return finalize(total)


def _check_batch(model, batch) -> tuple:
  if not isinstance(batch, dict) or not {"inputs", "targets",
                                         "mask"} <= set(batch):
    raise ValueError("batch must be a dict with 'inputs', 'targets' and "
                     "'mask' (from a task's batch()).")
  inputs = np.asarray(batch["inputs"])
  targets = np.asarray(batch["targets"])
  mask = np.asarray(batch["mask"])
  if inputs.ndim != 2 or targets.shape != inputs.shape or (
      mask.shape != inputs.shape):
    raise ValueError(f"batch inputs/targets/mask must share one [batch, "
                     f"seq_len] shape, got {inputs.shape}, {targets.shape}, "
                     f"{mask.shape}.")
  for name, a in (("inputs", inputs), ("targets", targets)):
    if not np.issubdtype(a.dtype, np.integer):
      raise TypeError(f"batch {name} must be integer token ids, got "
                      f"{a.dtype}.")
    if a.size and (a.min() < 0 or a.max() >= model.config.vocab_size):
      raise ValueError(f"batch {name} must lie in [0, vocab_size = "
                       f"{model.config.vocab_size}), got [{a.min()}, "
                       f"{a.max()}].")
  return (jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32),
          jnp.asarray(mask, F32))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward_logits_jit(graphdef, params, inputs):
  return nnx.merge(graphdef, params)(inputs)


def forward_logits(model, inputs):
  """`model(inputs)` jit-compiled (once per model structure and shape):
  [b, T] int -> logits [b, T, vocab] float32."""
  inputs = np.asarray(inputs)
  from replayssm_jax.models import model as M  # pylint: disable=g-import-not-at-top
  M._check_tokens("inputs", inputs, 2, "[batch, seqlen]", model.config)  # pylint: disable=protected-access
  graphdef, params = nnx.split(model)
  return _forward_logits_jit(graphdef, params, jnp.asarray(inputs, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward_sums_jit(graphdef, params, inputs, targets, mask):
  model = nnx.merge(graphdef, params)
  return masked_sums(model(inputs), targets, mask)


def forward_sums(model, batch: Batch) -> dict:
  """`masked_sums` of the full-sequence forward of one batch."""
  inputs, targets, mask = _check_batch(model, batch)
  graphdef, params = nnx.split(model)
  return _forward_sums_jit(graphdef, params, inputs, targets, mask)


def forward_metrics(model, batch: Batch) -> dict:
  """Full-forward metrics (`finalize`) of one batch."""
  return finalize(forward_sums(model, batch))


# ------------------------------------------------------------ decode mode
@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _decode_logits_jit(graphdef, params, inputs, state, prefill_len,
                       implementation):
  model = nnx.merge(graphdef, params)
  b = inputs.shape[0]
  lengths = jnp.full((b,), prefill_len, jnp.int32)
  x, state = model.forward(inputs[:, :prefill_len], lengths, state)
  first = model.logits(x)  # [b, prefill_len, vocab]

  def body(st, tok):
    logits, st = model.step(tok, st, implementation)
    return st, logits

  _, rest = jax.lax.scan(body, state, inputs[:, prefill_len:].T)
  return jnp.concatenate([first, jnp.swapaxes(rest, 0, 1)], axis=1)


def decode_logits(model, inputs, ssm_mode: str = "replay",
                  buffer_len: int = 16, *, prefill_len: int = 1,
                  implementation: str | None = None, **state_kwargs):
  """Logits of every input position [b, T, vocab] float32, in decode mode.

  The first `prefill_len` tokens go through `prefill` (chunked SSD; the
  logits of all of them are returned), the remaining T - prefill_len
  through `decode_step` one at a time, teacher-forced (the given inputs,
  not the model's predictions), in one jit-compiled `lax.scan`. In f32 the
  result equals `model(inputs)` up to association order.

  Args:
    model: a HybridLM.
    inputs: [batch, T] int token ids.
    ssm_mode: "replay" or "baseline" decode state of the Mamba layers.
    buffer_len: replay buffer length L.
    prefill_len: tokens run by prefill, 1 <= prefill_len <= T.
    implementation: SSM decode op implementation (dispatcher name).
    **state_kwargs: more `model.init_state` keywords (checkpoint_dtype,
      buffer_dtype, kv_dtype, conv_dtype, precision, row_ids).
  """
  inputs = np.asarray(inputs)
  if inputs.ndim != 2:
    raise ValueError(f"inputs must be [batch, seq_len], got shape "
                     f"{inputs.shape}.")
  b, t = inputs.shape
  if (isinstance(prefill_len, bool) or not isinstance(prefill_len, int)
      or not 1 <= prefill_len <= t):
    raise ValueError(f"prefill_len must be an int in [1, seq_len = {t}], "
                     f"got {prefill_len!r}.")
  state = model.init_state(b, t, ssm_mode=ssm_mode, buffer_len=buffer_len,
                           **state_kwargs)
  from replayssm_jax.models import model as M  # pylint: disable=g-import-not-at-top
  M.check_prefill_inputs(model, inputs[:, :prefill_len],
                         np.full((b,), prefill_len, np.int32), state)
  graphdef, params = nnx.split(model)
  return _decode_logits_jit(graphdef, params, jnp.asarray(inputs, jnp.int32),
                            state, prefill_len, implementation)


def decode_sums(model, batch: Batch, ssm_mode: str = "replay",
                buffer_len: int = 16, *, prefill_len: int = 1,
                implementation: str | None = None, **state_kwargs) -> dict:
  """`masked_sums` of `decode_logits` for one batch."""
  inputs, targets, mask = _check_batch(model, batch)
  logits = decode_logits(model, inputs, ssm_mode, buffer_len,
                         prefill_len=prefill_len,
                         implementation=implementation, **state_kwargs)
  return _sums_jit(logits, targets, mask)


_sums_jit = jax.jit(masked_sums)


def decode_metrics(model, batch: Batch, ssm_mode: str = "replay",
                   buffer_len: int = 16, *, prefill_len: int = 1,
                   implementation: str | None = None,
                   **state_kwargs) -> dict:
  """Decode-mode metrics (`finalize`) of one batch: loss, accuracy,
  perplexity, ... at the batch's scored positions."""
  return finalize(decode_sums(model, batch, ssm_mode, buffer_len,
                              prefill_len=prefill_len,
                              implementation=implementation, **state_kwargs))


def decode_accuracy(model, batch: Batch, ssm_mode: str = "replay",
                    buffer_len: int = 16, *, prefill_len: int = 1,
                    implementation: str | None = None,
                    **state_kwargs) -> float:
  """Greedy accuracy at the scored positions (MQAR: the queries) when the
  model runs in decode mode (prefill `prefill_len` tokens, then
  teacher-forced `decode_step`s); `**state_kwargs` go to `init_state`."""
  return decode_metrics(model, batch, ssm_mode, buffer_len,
                        prefill_len=prefill_len,
                        implementation=implementation,
                        **state_kwargs)["accuracy"]
