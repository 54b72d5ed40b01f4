"""The built-in character corpus of `CharTask`: templated English sentences
and arithmetic facts, generated here (no download), over a fixed character
vocabulary.

  CHARS                 the vocabulary (id = index).
  char_corpus(n, seed)  n characters of generated text (deterministic).
  encode_chars(text)    text -> int32 ids.
  decode_chars(ids)     ids -> text.
"""

from __future__ import annotations

import functools

import numpy as np

from replayssm_jax import _validation as V

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
  V.int_at_least("num_chars", num_chars)
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
