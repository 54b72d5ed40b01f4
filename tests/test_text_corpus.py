"""The real-text corpus: roff extraction, the split rule, the builder's
smoke run (on a stdlib and a man directory made here, so the test does
not depend on what the machine has installed), the byte tokenizer, and
TextTask's batches and integrity checks."""

import gzip
import json
import os

import numpy as np
import pytest

from configs import corpus as corpus_config
from experiments import build_corpus
from replayssm_jax import tasks
from replayssm_jax import text_corpus as TC

ROFF = r""".\" a comment line
.TH FROB 1 "2026" "frob 1.0"
.SH NAME
frob \- twiddle the \fBbits\fR of a file
.SH SYNOPSIS
.B frob
[\fI\-v\fP] \fIfile\fR
.PP
Frob reads \(lqfile\(rq and writes it back\(emchanged.
.sp
.IP \(bu 2
one item
.IP ""
bare item
"""


def test_roff_to_text():
  assert build_corpus.roff_to_text(ROFF) == (
      "NAME\nfrob - twiddle the bits of a file\nSYNOPSIS\nfrob\n[-v] file"
      "\n\nFrob reads \"file\" and writes it back-changed.\n\n*\none "
      "item\n\nbare item\n")


def test_split_rule():
  # Fixed per path, independent of the other documents; shares as set.
  paths = [f"dir/file{i}.py" for i in range(4000)]
  splits = [build_corpus.split_of("src", p, 0.1, 0.2) for p in paths]
  assert splits == [build_corpus.split_of("src", p, 0.1, 0.2) for p in paths]
  share = {s: splits.count(s) / len(paths) for s in TC.SPLITS}
  assert abs(share["validation"] - 0.1) < 0.02
  assert abs(share["test"] - 0.2) < 0.02
  assert build_corpus.split_of("src", "a", 0.0, 0.0) == "train"


def _sources(tmp_path):
  lib = tmp_path / "lib"
  lib.mkdir()
  for i in range(30):
    (lib / f"mod{i:02d}.py").write_text(
        f'"""Module {i}."""\n\ndef f{i}(x):\n  return x + {i}\n' * (i + 1))
  (lib / "dup.py").write_text((lib / "mod03.py").read_text())  # a duplicate
  (lib / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: skipped
  man = tmp_path / "man" / "man1"
  man.mkdir(parents=True)
  for i in range(12):
    with gzip.open(man / f"frob{i}.1.gz", "wt") as f:
      f.write(ROFF * (i + 2))
  with gzip.open(man / "alias.1.gz", "wt") as f:
    f.write(".so man1/frob0.1\n")  # an alias: skipped
  return str(lib), str(tmp_path / "man")


def test_build_corpus_smoke(tmp_path):
  lib, man = _sources(tmp_path)
  config = corpus_config.get_config("smoke")
  config.corpus.roots = dict(python_stdlib=lib, manpages=man)
  out = tmp_path / "corpus"
  manifest = build_corpus.run(config, str(out))
  docs = [json.loads(x) for x in (out / "documents.jsonl").read_text()
          .splitlines()]
  assert {d["source"] for d in docs} == {"python_stdlib", "manpages"}
  assert len(docs) == 30 + 12  # duplicate, non-UTF-8 file and alias skipped
  data = TC.load_corpus(str(out))
  for split in TC.SPLITS:
    mine = [d for d in docs if d["split"] == split]
    assert mine, split  # the smoke shares fill every split
    # Documents joined by one separator byte each, in order.
    assert len(data[split]) == sum(d["bytes"] for d in mine) + len(mine) - 1
    assert manifest["splits"][split]["bytes"] == len(data[split])
    assert (data[split] == TC.DOC_SEP).sum() == len(mine) - 1
  assert manifest["corpus_sha256"] == TC.corpus_hash(str(out))
  assert json.loads((out / "tokenizer.json").read_text()) == (
      TC.ByteTokenizer().to_dict())
  for name in ("config.json", "metrics.jsonl", "doc_bytes.png"):
    assert (out / name).stat().st_size > 0
  # The same sources give the same corpus.
  again = build_corpus.run(config, str(tmp_path / "again"))
  assert again["corpus_sha256"] == manifest["corpus_sha256"]
  config.corpus.min_total_bytes = 10 ** 9
  with pytest.raises(ValueError, match="min_total_bytes"):
    build_corpus.run(config, str(tmp_path / "small"))
  config.corpus.sources = ("python_stdlib", "books")
  with pytest.raises(ValueError, match="unknown.*books"):
    build_corpus.run(config, str(tmp_path / "bad"))


def test_byte_tokenizer():
  tok = TC.ByteTokenizer()
  text = "def f(x):\n  return 'naïve' + x\n"
  ids = tok.encode(text)
  assert ids.dtype == np.uint8 and tok.decode(ids) == text
  assert TC.ByteTokenizer.from_dict(tok.to_dict()) == tok
  with pytest.raises(ValueError, match="NUL"):
    tok.encode("a\x00b")
  with pytest.raises(ValueError, match="ids must lie"):
    tok.decode([300])


def test_text_task(tmp_path):
  lib, man = _sources(tmp_path)
  config = corpus_config.get_config("smoke")
  config.corpus.roots = dict(python_stdlib=lib, manpages=man)
  out = str(tmp_path / "corpus")
  build_corpus.run(config, out)
  task = tasks.make_task(dict(name="text", corpus_dir=out, seq_len=16))
  b = task.batch(3, 4)
  assert b["inputs"].shape == (4, 16) and b["inputs"].dtype == np.int32
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  np.testing.assert_array_equal(task.batch(3, 4)["inputs"], b["inputs"])
  train = TC.load_corpus(out)["train"]
  # Each crop is a window of the training split.
  row = b["inputs"][0]
  starts = [i for i in range(len(train) - 16)
            if (train[i:i + 16] == row).all()]
  assert starts
  v = task.batch(0, 2, "val")
  assert v["inputs"].shape == (2, 16)
  assert task.to_dict()["corpus_sha256"] == TC.corpus_hash(out)
  with pytest.raises(ValueError, match="split must be one of"):
    task.batch(0, 2, "dev")
  with pytest.raises(ValueError, match="not corpus_sha256"):
    tasks.make_task(dict(name="text", corpus_dir=out, corpus_sha256="0" * 64))
  # A changed split file is refused, naming it.
  path = os.path.join(out, "test.bin")
  data = bytearray(open(path, "rb").read())
  data[0] ^= 1
  open(path, "wb").write(bytes(data))
  with pytest.raises(ValueError, match="test.bin: sha256"):
    tasks.make_task(dict(name="text", corpus_dir=out))
  with pytest.raises(FileNotFoundError, match="build_corpus"):
    tasks.make_task(dict(name="text", corpus_dir=str(tmp_path / "none")))


@pytest.mark.parametrize("arg", ["smoke", "gdn_smoke"])
def test_train_text_smoke(tmp_path, arg):
  """configs/train_text.py's smoke runs train a Mamba-2 and a Gated
  DeltaNet hybrid on a built corpus: the loss drops below the uniform
  byte's ln 256, and the run records the corpus's hash."""
  pytest.importorskip("optax")
  from configs import train_text  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top
  lib, man = _sources(tmp_path)
  cc = corpus_config.get_config("smoke")
  cc.corpus.roots = dict(python_stdlib=lib, manpages=man)
  corpus = str(tmp_path / "corpus")
  build_corpus.run(cc, corpus)
  config = train_text.get_config(arg)
  config.task.corpus_dir = corpus
  out = train.run(config, str(tmp_path / "run"))
  task = json.loads((tmp_path / "run" / "task.json").read_text())
  assert task["corpus_sha256"] == TC.corpus_hash(corpus)
  losses = [r["loss"] for r in out["history"]]
  assert losses[-1] < min(losses[0], np.log(256)), losses
