"""Training tasks for small hybrid LMs, with evaluation helpers.

Three tasks, all deterministic given a seed (batches are drawn with numpy,
whose generators give the same bits on every platform and jax version):

  MQARTask   multi-query associative recall (Zoology / Based papers):
             key-value pairs, then queries of earlier keys; the model must
             emit each queried key's value. Loss and accuracy only at the
             query positions.
  CharTask   character-level language modelling of a built-in corpus of
             templated English sentences and arithmetic facts (generated
             here, no download); train/val split, random crops; scored by
             per-character cross-entropy / perplexity.
  TextTask   byte-level language modelling of a built real-text corpus
             (`experiments/build_corpus.py`: the Python standard library's
             sources and the installed manual pages, fixed train /
             validation / test split); random crops; nats per byte.

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

The character corpus lives in `replayssm_jax.corpus` and the evaluation
helpers in `replayssm_jax.task_eval`; both are re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax import text_corpus
from replayssm_jax.corpus import (CHARS, char_corpus, decode_chars,
                                  encode_chars)
from replayssm_jax.task_eval import (Batch, aggregate, decode_accuracy,
                                     decode_logits, decode_metrics,
                                     decode_sums, finalize, forward_logits,
                                     forward_metrics, forward_sums,
                                     masked_loss, masked_sums)

__all__ = [
    "CHARS", "Batch", "CharTask", "MQARTask", "SPLITS", "TASKS", "Task",
    "TextTask", "crop_batch",
    "char_corpus", "decode_accuracy", "decode_chars", "decode_logits",
    "decode_metrics", "decode_sums", "encode_chars", "finalize",
    "forward_logits", "forward_metrics", "forward_sums", "make_task",
    "masked_loss", "masked_sums",
]

SPLITS = ("train", "val")


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
    V.int_at_least("batch_size", batch_size)
    _split_id(split)
    i = V.int_at_least("start", start, 0)
    while True:
      yield self.batch(i, batch_size, split)
      i += 1

  def eval_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
    """The fixed validation batches 0 .. num_batches - 1."""
    V.int_at_least("num_batches", num_batches)
    return [self.batch(i, batch_size, "val") for i in range(num_batches)]

  def evaluate(self, model, batches: Sequence[Batch]) -> dict:
    """Full-forward metrics summed over `batches` (see `Metrics`)."""
    return aggregate(forward_sums(model, b) for b in _as_list(batches))

  def decode_evaluate(self, model, batches: Sequence[Batch],
                      ssm_mode: str = "replay", buffer_len: int = 16, *,
                      prefill_len: int = 1,
                      implementation: str | None = None,
                      **state_kwargs) -> dict:
    """Like `evaluate`, with the logits of a prefill + teacher-forced
    decode (`decode_logits`) instead of the full forward."""
    return aggregate(
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
    V.int_at_least("vocab_size", self.vocab_size)
    n = V.int_at_least("num_kv_pairs", self.num_kv_pairs)
    V.int_at_least("seq_len", self.seq_len)
    if self.num_queries is None:
      object.__setattr__(self, "num_queries", n)
    q = V.int_at_least("num_queries", self.num_queries)
    V.int_at_least("seed", self.seed, 0)
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
    index = V.int_at_least("index", index, 0)
    b = V.int_at_least("batch_size", batch_size)
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
    V.int_at_least("seq_len", self.seq_len)
    V.int_at_least("corpus_chars", self.corpus_chars)
    V.int_at_least("seed", self.seed, 0)
    V.int_at_least("corpus_seed", self.corpus_seed, 0)
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
    return crop_batch(self._splits[_split_id(split)], self.seq_len,
                      self.seed, index, batch_size, split == "train")


def crop_batch(ids, seq_len: int, seed: int, index: int, batch_size: int,
               train: bool) -> Batch:
  """Batch `index` of a token stream: random crops of seq_len + 1 tokens
  (train: drawn from (seed, index)), or consecutive non-overlapping
  windows index * batch_size .. (index + 1) * batch_size - 1, seq_len
  apart, wrapping around (evaluation). Every position is scored."""
  index = V.int_at_least("index", index, 0)
  b = V.int_at_least("batch_size", batch_size)
  hi = len(ids) - seq_len - 1  # last valid crop start
  if train:
    rng = np.random.default_rng((seed, 0, index))
    starts = rng.integers(0, hi + 1, b)
  else:
    windows = (hi + seq_len) // seq_len
    starts = ((index * b + np.arange(b)) % windows) * seq_len
  crops = np.asarray(ids[starts[:, None] + np.arange(seq_len + 1)[None, :]])
  return dict(inputs=crops[:, :-1].astype(np.int32),
              targets=crops[:, 1:].astype(np.int32),
              mask=np.ones((b, seq_len), np.float32))


@dataclasses.dataclass(frozen=True)
class TextTask(Task):
  """Next-byte prediction on a built real-text corpus
  (`experiments/build_corpus.py`, `replayssm_jax.text_corpus`).

  Splits "train", "val" (the corpus's validation split) and "test";
  batches as `crop_batch` (random crops of train, consecutive windows of
  val / test). Scored at every position: loss is nats per byte.

  Attributes:
    corpus_dir: the built corpus directory.
    seq_len: model input length.
    vocab_size: model vocab (>= 256, the byte vocabulary).
    seed: data seed (crops).
    corpus_sha256: if set, the corpus's hash must equal it (a model's
      task.json records the hash of the corpus it was trained on).
  """
  corpus_dir: str = ""
  seq_len: int = 256
  vocab_size: int = 256
  seed: int = 0
  corpus_sha256: str = ""
  name = "text"
  headline_metric = "loss"

  def __post_init__(self):
    V.int_at_least("seq_len", self.seq_len)
    V.int_at_least("seed", self.seed, 0)
    if self.vocab_size < 256:
      raise ValueError(f"vocab_size must be >= 256 (the byte vocabulary), "
                       f"got {self.vocab_size!r}.")
    actual = text_corpus.corpus_hash(self.corpus_dir)
    if self.corpus_sha256 and actual != self.corpus_sha256:
      raise ValueError(f"corpus_dir {self.corpus_dir!r} holds corpus "
                       f"{actual}, not corpus_sha256 {self.corpus_sha256}.")
    for split, ids in self._splits.items():
      if len(ids) < self.seq_len + 1:
        raise ValueError(f"the {split} split of {self.corpus_dir!r} holds "
                         f"{len(ids)} bytes, fewer than seq_len + 1 = "
                         f"{self.seq_len + 1}.")

  @functools.cached_property
  def _splits(self) -> dict[str, np.ndarray]:
    data = text_corpus.load_corpus(self.corpus_dir)
    return dict(train=data["train"], val=data["validation"],
                test=data["test"])

  def to_dict(self) -> dict:
    return dict(name=self.name, corpus_dir=self.corpus_dir,
                seq_len=self.seq_len, vocab_size=self.vocab_size,
                seed=self.seed,
                corpus_sha256=text_corpus.corpus_hash(self.corpus_dir))

  def batch(self, index: int, batch_size: int, split: str = "train") -> Batch:
    """Batch `index` of `split` ("train", "val" or "test")."""
    if split not in self._splits:
      raise ValueError(f"split must be one of {tuple(self._splits)}, got "
                       f"{split!r}.")
    return crop_batch(self._splits[split], self.seq_len, self.seed, index,
                      batch_size, split == "train")


TASKS = {"mqar": MQARTask, "char": CharTask, "text": TextTask}


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
