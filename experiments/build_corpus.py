r"""Builds the real-text corpus offline from text installed on the machine.

Sources (`corpus.sources`), each document one file, read in sorted path
order:
  * "python_stdlib": the Python standard library's own sources (every .py
    file under the running interpreter's stdlib directory, site-packages
    excluded; PSF License 2.0), strict UTF-8;
  * "manpages": the English manual pages of the installed Debian packages
    (/usr/share/man/man1 .. man8, gzip'd roff; each under its package's
    license, recorded per document from dpkg's file lists), turned into
    plain text by `roff_to_text`; `.so` aliases are skipped.
Documents with identical text are kept once. Each document goes to a split
by the sha256 of its "source:path" (`split_of`): a fixed assignment that
does not depend on which other files exist. Splits are written as uint8
byte streams (`replayssm_jax.text_corpus`), documents separated by NUL.

Usage (see configs/corpus.py):
  python -m experiments.build_corpus --config=configs/corpus.py \
      --workdir=runs/corpus
  python -m experiments.build_corpus --config=configs/corpus.py:smoke \
      --workdir=runs/corpus_smoke      # a few documents, seconds
  python -m experiments.build_corpus --config=configs/corpus.py:excerpt \
      --workdir=tests/fixtures/text_corpus  # the test fixture's excerpt

Outputs in --workdir: train.bin, validation.bin, test.bin, manifest.json,
documents.jsonl, tokenizer.json, config.json, metrics.jsonl (one line per
source), doc_bytes.png (document sizes per source).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig

from absl import logging
import numpy as np

from experiments import common
from replayssm_jax import text_corpus as TC

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "corpus.py")
LICENSES = {
    "python_stdlib": "PSF-2.0 (the Python Software Foundation License "
                     "of CPython's sources)",
    "manpages": "each page under its Debian package's license (Debian "
                "main; see /usr/share/doc/<package>/copyright); the "
                "package is recorded per document",
}

# ------------------------------------------------------------ roff -> text
_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),   # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),              # size changes
    (re.compile(r"\\\*(\[[^\]]*\]|\(..|.)"), ""),  # string registers
    (re.compile(r"\\\((em|en)"), "-"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\((oq|cq|aq)"), "'"),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),      # other named glyphs
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[e\\]"), r"\\"),
    (re.compile(r"\\[&|^%c:]"), ""),
    (re.compile(r"\\ "), " "),
    (re.compile(r"\\[\"#].*$"), ""),               # comments
    (re.compile(r"\\.") , ""),                      # anything else
]
# Requests whose arguments are text (section titles, fonts, items).
_TEXT_REQUESTS = {"SH", "SS", "B", "I", "BI", "IB", "BR", "RB", "IR", "RI",
                  "SM", "SB", "IP", "TP", "Nm", "Nd", "Sh", "Ss", "Pp",
                  "It", "Fl", "Ar", "Cm", "Op", "Dl", "Pa", "Xr", "UR", "MT"}


def roff_to_text(src: str) -> str:
  """Plain text of a man page's roff source: request lines dropped except
  those whose arguments are text (.SH, .B, .IR, ...: arguments kept, quotes
  removed), escapes replaced or dropped, blank runs squeezed."""
  out = []
  for line in src.splitlines():
    if line.startswith((".", "'")):
      parts = line[1:].strip().split(None, 1)
      if not parts or parts[0] not in _TEXT_REQUESTS or len(parts) < 2:
        if parts and parts[0] in ("PP", "LP", "P", "Pp", "SH", "sp"):
          out.append("")
        continue
      line = parts[1].replace('"', "")
      if parts[0] == "IP":  # .IP tag indent: the indent is no text
        line = (line.split() or [""])[0]
    for pattern, repl in _ESCAPES:
      line = pattern.sub(repl, line)
    out.append(line.rstrip())
  text = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()
  return text + "\n" if text else ""


# ---------------------------------------------------------------- sources
def stdlib_documents(limit: int | None, root: str = ""):
  """(path, text, package) of the stdlib .py files, sorted by path (root:
  the running interpreter's stdlib directory unless given)."""
  root = root or sysconfig.get_paths()["stdlib"]
  paths = []
  for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x != "site-packages")
    paths += [os.path.join(d, f) for f in files if f.endswith(".py")]
  n = 0
  for path in sorted(paths):
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except (UnicodeDecodeError, OSError):
      continue
    if "\x00" in text or not text.strip():
      continue
    yield os.path.relpath(path, root), text, f"cpython-{sys.version.split()[0]}"
    n += 1
    if limit and n >= limit:
      return


def _dpkg_owners(dpkg_info="/var/lib/dpkg/info") -> dict[str, str]:
  owners = {}
  if os.path.isdir(dpkg_info):
    for name in sorted(os.listdir(dpkg_info)):
      if name.endswith(".list"):
        pkg = name[:-5].split(":")[0]
        with open(os.path.join(dpkg_info, name), errors="replace") as f:
          for line in f:
            owners.setdefault(line.rstrip("\n"), pkg)
  return owners


def manpage_documents(limit: int | None, root: str = ""):
  """(path, text, package) of the English man pages, sorted by path (root:
  /usr/share/man unless given)."""
  root = root or "/usr/share/man"
  owners = _dpkg_owners()
  paths = []
  for section in range(1, 9):
    d = os.path.join(root, f"man{section}")
    if os.path.isdir(d):
      paths += [os.path.join(d, f) for f in os.listdir(d)
                if f.endswith(".gz") and not os.path.islink(
                    os.path.join(d, f))]
  n = 0
  for path in sorted(paths):
    try:
      with gzip.open(path, "rt", encoding="utf-8") as f:
        src = f.read()
    except (UnicodeDecodeError, OSError, EOFError):
      continue
    if src.lstrip().startswith(".so "):
      continue
    text = roff_to_text(src).replace("\x00", "")
    if len(text) < 200:
      continue
    yield os.path.relpath(path, root), text, owners.get(path, "unknown")
    n += 1
    if limit and n >= limit:
      return


SOURCES = {"python_stdlib": stdlib_documents, "manpages": manpage_documents}


def split_of(source: str, path: str, validation: float, test: float) -> str:
  """The split of a document: sha256("source:path") as a uniform number
  in [0, 1); below `validation`: validation, then test, else train."""
  h = int(hashlib.sha256(f"{source}:{path}".encode()).hexdigest()[:12], 16)
  u = h / float(1 << 48)
  return ("validation" if u < validation else
          "test" if u < validation + test else "train")


# -------------------------------------------------------------------- run
def _excerpt(config, workdir: str) -> dict:
  """An excerpt of a built corpus (`text_corpus.write_excerpt`)."""
  c = config.corpus
  workdir, _, writer = common.start_run(workdir, config)
  manifest = TC.write_excerpt(c.excerpt_of, workdir, dict(c.excerpt_bytes))
  writer.write(kind="excerpt", **manifest)
  common.log_block(common.write_summary(workdir, (
      "# corpus excerpt\n\n" + ", ".join(
          f"{s} {v['bytes']} bytes" for s, v in manifest["splits"].items())
      + f"\n\ncorpus sha256 {manifest['corpus_sha256']}, an excerpt of "
      f"{manifest['excerpt_of']['corpus_sha256']}\n")))
  return manifest


def run(config, workdir: str) -> dict:
  """Builds the corpus into `workdir`; returns its manifest."""
  c = config.corpus
  if c.get("excerpt_of"):
    return _excerpt(config, workdir)
  unknown = sorted(set(c.sources) - set(SOURCES))
  if unknown:
    raise ValueError(f"corpus.sources: unknown {unknown}; choose from "
                     f"{sorted(SOURCES)}.")
  workdir, _, writer = common.start_run(workdir, config)
  tok = TC.ByteTokenizer()
  outs = {s: open(os.path.join(workdir, f"{s}.bin"), "wb") for s in TC.SPLITS}
  sizes = {s: 0 for s in TC.SPLITS}
  seen, sizes_by_source = set(), {}
  limit = c.max_documents_per_source or None
  with open(os.path.join(workdir, "documents.jsonl"), "w") as docs:
    for source in c.sources:
      counts = dict(documents=0, duplicates=0, bytes=0,
                    **{s: 0 for s in TC.SPLITS})
      lengths = []
      for path, text, package in SOURCES[source](
          limit, c.get("roots", {}).get(source, "")):
        data = tok.encode(text).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
          counts["duplicates"] += 1
          continue
        seen.add(digest)
        split = split_of(source, path, c.validation_fraction,
                         c.test_fraction)
        if sizes[split]:
          outs[split].write(bytes([TC.DOC_SEP]))
          sizes[split] += 1
        outs[split].write(data)
        sizes[split] += len(data)
        counts["documents"] += 1
        counts["bytes"] += len(data)
        counts[split] += len(data)
        lengths.append(len(data))
        docs.write(json.dumps(dict(source=source, path=path, package=package,
                                   split=split, bytes=len(data),
                                   sha256=digest)) + "\n")
      sizes_by_source[source] = lengths
      writer.write(kind="source", source=source, license=LICENSES[source],
                   **counts)
      logging.info("%s: %d documents, %.1f MB (%d duplicates skipped)",
                   source, counts["documents"], counts["bytes"] / 1e6,
                   counts["duplicates"])
  for f in outs.values():
    f.close()
  total = sum(sizes.values())
  if total < c.min_total_bytes:
    raise ValueError(f"the corpus holds {total} bytes, fewer than "
                     f"corpus.min_total_bytes = {c.min_total_bytes}.")
  splits = {s: dict(bytes=sizes[s], sha256=TC.sha256_file(
      os.path.join(workdir, f"{s}.bin"))) for s in TC.SPLITS}
  manifest = dict(
      sources={s: dict(license=LICENSES[s]) for s in c.sources},
      python=sys.version.split()[0], platform=platform.platform(),
      splits=splits, total_bytes=total, tokenizer=tok.to_dict(),
      split_rule="sha256('source:path') -> [0, 1): validation below "
                 f"{c.validation_fraction}, test below "
                 f"{c.validation_fraction + c.test_fraction}",
      corpus_sha256=hashlib.sha256("".join(
          splits[s]["sha256"] for s in TC.SPLITS).encode()).hexdigest())
  with open(os.path.join(workdir, TC.MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1)
  tok.save(os.path.join(workdir, "tokenizer.json"))
  fig, axes = common.new_figure()
  ax = axes[0][0]
  for source, lengths in sizes_by_source.items():
    if lengths:
      ax.hist(np.log10(np.asarray(lengths)), bins=40, alpha=0.6,
              label=f"{source} ({len(lengths)} documents)")
  ax.set_xlabel("log10 document bytes")
  ax.set_ylabel("documents")
  ax.legend()
  common.save_plot(fig, os.path.join(workdir, "doc_bytes.png"))
  common.log_block(common.write_summary(workdir, (
      f"# corpus\n\n{total / 1e6:.1f} MB; " + ", ".join(
          f"{s} {sizes[s] / 1e6:.2f} MB" for s in TC.SPLITS)
      + f"\n\ncorpus sha256 {manifest['corpus_sha256']}\n")))
  return manifest


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/corpus")
