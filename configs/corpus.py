r"""The real-text corpus (experiments/build_corpus.py).

Full corpus (every source document on the machine, ~100 MB):

  python -m experiments.build_corpus --config=configs/corpus.py \
      --workdir=runs/corpus

Smoke run (a few documents per source; used by tests):

  python -m experiments.build_corpus --config=configs/corpus.py:smoke \
      --workdir=runs/corpus_smoke

Excerpt (each split's leading whole documents of the built corpus in
`corpus.excerpt_of`, a few hundred KB: the real-text fixture under
tests/fixtures/text_corpus, scored by the precision study's CI test):

  python -m experiments.build_corpus --config=configs/corpus.py:excerpt \
      --workdir=tests/fixtures/text_corpus
"""

import ml_collections

from configs import _args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  _args.check_arg(arg, "excerpt")
  smoke = arg == "smoke"
  config = ml_collections.ConfigDict()
  c = config.corpus = ml_collections.ConfigDict()
  c.sources = ("python_stdlib", "manpages")
  # Shares of the documents (by their path's hash) held out; the smoke
  # run's few documents need larger shares to fill every split.
  c.validation_fraction = 0.25 if smoke else 0.01
  c.test_fraction = 0.25 if smoke else 0.01
  # 0: every document; the smoke run reads a few per source.
  c.max_documents_per_source = 40 if smoke else 0
  c.min_total_bytes = 0 if smoke else 50_000_000
  # Where a source's files are read from ("": the machine's own: the
  # running Python's stdlib, /usr/share/man).
  c.roots = dict(python_stdlib="", manpages="")
  # Excerpt mode: the built corpus to cut ("" builds one) and the bytes
  # kept per split.
  c.excerpt_of = "runs/corpus" if arg == "excerpt" else ""
  c.excerpt_bytes = dict(train=16_384, validation=65_536, test=16_384)
  return config
