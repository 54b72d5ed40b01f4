"""A built real-text corpus on disk and its byte-level tokenizer.

`experiments/build_corpus.py` writes a corpus directory:

  train.bin, validation.bin, test.bin   the splits' token ids, uint8 (one
                                        byte of UTF-8 text per token;
                                        documents separated by DOC_SEP)
  manifest.json                         sources, licenses, per-split sizes
                                        and sha256, the corpus hash and the
                                        tokenizer
  documents.jsonl                       one line per document: source,
                                        path, package, split, bytes, sha256

  ByteTokenizer            vocab 256 (a token is a byte; DOC_SEP = 0, the
                           NUL byte, never occurs in the text).
  load_corpus(directory)   {split: read-only uint8 memmap}, each split's
                           size and sha256 checked against the manifest.
  corpus_hash(directory)   the manifest's corpus hash (recorded by models
                           trained on it).
  write_excerpt(src, dst, max_bytes)
                           a small corpus of each split's leading whole
                           documents (test fixtures); its manifest names the
                           corpus it was cut from.
  lineage(directory)       the corpus's own hash and, for an excerpt, its
                           source's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

SPLITS = ("train", "validation", "test")
DOC_SEP = 0
MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Byte-level tokenizer: UTF-8 bytes are the token ids."""

  vocab_size: int = 256
  doc_sep: int = DOC_SEP

  def encode(self, text: str) -> np.ndarray:
    """text -> uint8 ids (its UTF-8 bytes); NUL is refused (DOC_SEP)."""
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}.")
    data = text.encode("utf-8")
    if b"\x00" in data:
      raise ValueError("text holds a NUL byte, which is the document "
                       "separator.")
    return np.frombuffer(data, np.uint8).copy()

  def decode(self, ids) -> str:
    """ids -> text (invalid UTF-8, e.g. a window cut inside a character,
    becomes U+FFFD; DOC_SEP becomes a newline)."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() > 255):
      raise ValueError(f"ids must lie in [0, 255], got range "
                       f"[{ids.min()}, {ids.max()}].")
    data = ids.astype(np.uint8).tobytes().replace(b"\x00", b"\n")
    return data.decode("utf-8", errors="replace")

  def to_dict(self) -> dict:
    return dict(kind="bytes", vocab_size=self.vocab_size,
                doc_sep=self.doc_sep, encoding="utf-8")

  @classmethod
  def from_dict(cls, spec: dict) -> "ByteTokenizer":
    if spec.get("kind") != "bytes" or spec.get("encoding") != "utf-8":
      raise ValueError(f"tokenizer spec must be a UTF-8 byte tokenizer "
                       f"(kind 'bytes'), got {spec!r}.")
    return cls(vocab_size=int(spec["vocab_size"]),
               doc_sep=int(spec["doc_sep"]))

  def save(self, path: str) -> str:
    with open(path, "w") as f:
      json.dump(self.to_dict(), f, indent=1)
    return path


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


def read_manifest(directory: str) -> dict:
  path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: corpus directories are "
                            f"written by experiments/build_corpus.py.")
  with open(path) as f:
    return json.load(f)


def corpus_hash(directory: str) -> str:
  """The corpus hash of a built corpus (sha256 over its splits' sha256)."""
  return read_manifest(directory)["corpus_sha256"]


def load_corpus(directory: str, verify: bool = True) -> dict[str, np.ndarray]:
  """{split: read-only uint8 memmap} of a built corpus.

  verify: check each split's size and sha256 against the manifest (a
  changed or truncated file is refused, naming it)."""
  manifest = read_manifest(directory)
  out = {}
  for split in SPLITS:
    path = os.path.join(directory, f"{split}.bin")
    want = manifest["splits"][split]
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path} not found (listed in {MANIFEST}).")
    size = os.path.getsize(path)
    if size != want["bytes"]:
      raise ValueError(f"{path} holds {size} bytes, {MANIFEST} says "
                       f"{want['bytes']}.")
    if verify and sha256_file(path) != want["sha256"]:
      raise ValueError(f"{path}: sha256 differs from {MANIFEST}'s.")
    out[split] = (np.memmap(path, np.uint8, mode="r") if size else
                  np.zeros((0,), np.uint8))
  return out


def _write_manifest(directory: str, manifest: dict) -> None:
  with open(os.path.join(directory, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1)


def _combined_hash(splits: dict) -> str:
  return hashlib.sha256("".join(splits[s]["sha256"]
                                for s in SPLITS).encode()).hexdigest()


def write_excerpt(src: str, dst: str, max_bytes: dict[str, int]) -> dict:
  """Writes to `dst` a corpus of each split's leading whole documents of
  the corpus `src`, at most max_bytes[split] bytes per split (at least one
  document, cut at max_bytes if the first is longer); returns its
  manifest, whose `excerpt_of` holds the source's corpus hash and the
  bytes taken (`lineage`)."""
  data = load_corpus(src)
  parent = read_manifest(src)
  os.makedirs(dst, exist_ok=True)
  splits = {}
  for split in SPLITS:
    ids = np.asarray(data[split][:max_bytes[split] + 1])
    cut = len(ids)
    if len(ids) > max_bytes[split]:  # end at the last separator in range
      seps = np.flatnonzero(ids[:max_bytes[split] + 1] == DOC_SEP)
      cut = int(seps[-1]) if len(seps) else max_bytes[split]
    path = os.path.join(dst, f"{split}.bin")
    with open(path, "wb") as f:
      f.write(ids[:cut].tobytes())
    splits[split] = dict(bytes=cut, sha256=sha256_file(path))
  manifest = dict(
      excerpt_of=dict(corpus_sha256=parent["corpus_sha256"],
                      max_bytes=dict(max_bytes),
                      rule="each split's leading documents up to max_bytes"),
      sources=parent.get("sources", {}), splits=splits,
      total_bytes=sum(v["bytes"] for v in splits.values()),
      tokenizer=parent["tokenizer"], corpus_sha256=_combined_hash(splits))
  _write_manifest(dst, manifest)
  ByteTokenizer.from_dict(parent["tokenizer"]).save(
      os.path.join(dst, "tokenizer.json"))
  return manifest


def lineage(directory: str) -> tuple[str, ...]:
  """(own corpus hash,) or, for an excerpt, (own hash, source's hash)."""
  manifest = read_manifest(directory)
  parent = manifest.get("excerpt_of", {}).get("corpus_sha256")
  return (manifest["corpus_sha256"],) + ((parent,) if parent else ())
