"""The real-text precision study across models: one table and one figure.

Reads every `<model folder>/study/metrics.jsonl` (and `study_f32/`, the
same model in float32 activations, where present) under --studies and
writes --out_dir/across.md (a row per model) and across.png (four panels
against the parameter count, Mamba-2 solid, Gated DeltaNet dashed): the
worst relative perplexity change of the replay presets and of the
every-step baselines beside the 1% target; the next-token distributions'
mean total-variation distance to the reference at L 16 in float32
activations (bf16 replay against the every-step bf16 state, the f16
master with an fp8 read copy against the every-step fp8 state); the
lowest greedy agreement of the six 16-bit-master presets in float32
activations (where all six ran) beside the every-step bf16 state's and
the 0.99 target; and
the first recorded layer's largest state error against float64 over its
recorded points (the bf16 and f16 masters against their every-step
states; the peak, not the last point's: a replay state between flushes
whose checkpoint has decayed away ends at the f32 decode's error
whatever its master's precision). A value a study did not
record is "-" in the table and left out of the figure.

  python benchmarks/scripts/text_precision_across.py \\
      --studies=benchmarks/text_precision --out_dir=benchmarks/text_precision
"""

import argparse
import glob
import os

import numpy as np

from configs import precision_text
from experiments import common
from replayssm_jax.models import states
from replayssm_jax.precision import PrecisionPolicy

SIXTEEN_BIT = ("bfloat16", "float16")  # storage dtypes
EIGHT_BIT = ("float8_e4m3fn", "int8")
# The presets whose master is 16-bit (the greedy target's), and the
# study's targets.
SIXTEEN_BIT_MASTERS = tuple(p for p in precision_text.GREEDY_TARGET_PRESETS
                            if p != "f32")
_STUDY = precision_text.get_config("fixture")
PPL_TOLERANCE, AGREEMENT_TARGET = (_STUDY.ppl_tolerance,
                                   _STUDY.agreement_target)


def _records(path):
  return common.read_metrics(path) if os.path.exists(path) else []


def _find(recs, **want):
  return [r for r in recs if all(r.get(k) == v for k, v in want.items())]


def _one(recs, key, **want):
  """`key` of the one record matching `want`, else None."""
  hits = _find(recs, **want)
  return hits[0].get(key) if hits else None


def _storage(policy):
  return states.baseline_storage_dtype(PrecisionPolicy.preset(policy))


def model_row(folder: str) -> dict | None:
  """The cross-model figures of one model folder (None: no study)."""
  recs = _records(os.path.join(folder, "study", "metrics.jsonl"))
  f32 = _records(os.path.join(folder, "study_f32", "metrics.jsonl"))
  info = next((r for r in recs if r.get("kind") == "model"), None)
  if info is None:
    return None
  row = dict(model=info["model"], family=info["model"].split("_")[0],
             parameters=info["num_params"],
             training_bytes=info.get("recipe", {}).get("token_budget"))
  replay = _find(recs, kind="replay")
  if replay:
    worst = max(replay, key=lambda r: abs(r["rel_perplexity"]))
    row["worst_replay_ppl"] = worst["rel_perplexity"]
    row["worst_replay_run"] = f"{worst['policy']} L {worst['L']}"
    row["f32_replay_ppl"] = max(
        (abs(r["rel_perplexity"]) for r in _find(replay, policy="f32")),
        default=None)
  base = _find(recs, kind="baseline")
  if base:
    row["worst_baseline_ppl"] = max(
        (r["rel_perplexity"] for r in base), key=abs)
  for label in ("bf16+rn", "f16+rn", "fp8+rn", "int8+rn"):
    row[f"ppl {label}"] = _one(base, "rel_perplexity", label=label)
  # Mean total variation at L 16, bf16 activations.
  l16 = [r for r in _find(replay, L=16) if "mean_tv" in r]
  if l16:
    row["tv_f32"] = _one(l16, "mean_tv", policy="f32")
    row["tv_16bit"] = [r["mean_tv"] for r in l16
                       if r["policy"] != "f32"
                       and _storage(r["policy"]) in SIXTEEN_BIT]
    row["tv_8bit"] = [r["mean_tv"] for r in l16
                      if _storage(r["policy"]) in EIGHT_BIT]
    row["tv bf16+rn"] = _one(base, "mean_tv", label="bf16+rn")
    row["tv fp8+rn"] = _one(base, "mean_tv", label="fp8+rn")
  # The same in float32 activations.
  for key, kind, label in (("f32act tv bf16", "replay", "bf16"),
                           ("f32act tv bf16+rn", "baseline", "bf16+rn"),
                           ("f32act tv f16+fp8", "replay", "f16+fp8"),
                           ("f32act tv fp8+rn", "baseline", "fp8+rn")):
    row[key] = _one(f32, "mean_tv", kind=kind, label=label)
  # Greedy agreement over the long generations.
  for act, rs in (("bf16act", recs), ("f32act", f32)):
    greedy = _find(rs, kind="generation", mode="greedy")
    masters = [r for r in greedy if r["run_kind"] == "replay"
               and r["policy"] in SIXTEEN_BIT_MASTERS]
    if masters:
      row[f"{act} greedy min"] = min(r["agreement"] for r in masters)
      row[f"{act} greedy met"] = sum(r["agreement"] >= AGREEMENT_TARGET
                                     for r in masters)
      row[f"{act} greedy runs"] = len(masters)
    row[f"{act} greedy f32"] = _one(greedy, "agreement", run_kind="replay",
                                    policy="f32")
    row[f"{act} greedy bf16+rn"] = _one(greedy, "agreement",
                                        run_kind="baseline", label="bf16+rn")
  # The first recorded layer's peak state error against float64.
  errs = _find(recs, kind="state_error")
  if errs:
    first = min(r["block"] for r in errs)
    for key, kind, label in (("se bf16", "replay", "bf16"),
                             ("se bf16+rn", "baseline", "bf16+rn"),
                             ("se f16", "replay", "f16"),
                             ("se f16+rn", "baseline", "f16+rn")):
      row[key] = _one(errs, "peak_state_max_rel", block=first,
                      run_kind=kind, label=label)
  return row


def _pct(x):
  return "-" if x is None else f"{100 * x:+.4f}%"


def _e(x):
  return "-" if x is None else f"{x:.1e}"


def _a(x):
  return "-" if x is None else f"{x:.3f}"


def _span(xs):
  if not xs:
    return "-"
  return _e(min(xs)) if min(xs) == max(xs) else f"{min(xs):.1e}-{max(xs):.1e}"


def table(rows: list[dict]) -> str:
  out = []
  for r in rows:
    cell = dict(model=r["model"],
                parameters=f"{r['parameters'] / 1e6:.1f}M",
                bytes=("-" if r["training_bytes"] is None
                       else f"{r['training_bytes'] / 1e6:.1f}M"))
    cell["worst replay ppl"] = (
        f"{_pct(r.get('worst_replay_ppl'))} ({r['worst_replay_run']})"
        if "worst_replay_run" in r else "-")
    cell["f32 replay ppl"] = (
        "-" if r.get("f32_replay_ppl") is None
        else f"up to {100 * r['f32_replay_ppl']:.4f}%")  # a magnitude
    cell["every step bf16 / f16 / fp8 / int8 ppl"] = " / ".join(
        _pct(r.get(f"ppl {k}+rn")) for k in ("bf16", "f16", "fp8", "int8"))
    cell["tv at L 16: f32 replay; 16-bit; 8-bit copies; "
         "every step bf16 / fp8"] = (
        f"{_e(r.get('tv_f32'))}; {_span(r.get('tv_16bit'))}; "
        f"{_span(r.get('tv_8bit'))}; {_e(r.get('tv bf16+rn'))} / "
        f"{_e(r.get('tv fp8+rn'))}")
    cell["tv at L 16 in f32 activations: bf16 vs every step; "
         "f16+fp8 vs every step"] = (
        f"{_e(r.get('f32act tv bf16'))} vs {_e(r.get('f32act tv bf16+rn'))}; "
        f"{_e(r.get('f32act tv f16+fp8'))} vs "
        f"{_e(r.get('f32act tv fp8+rn'))}")
    for act, name in (("bf16act", "greedy"),
                      ("f32act", "greedy in f32 activations")):
      runs = r.get(f"{act} greedy runs")
      cell[f"{name}: f32 replay; 16-bit masters >= {AGREEMENT_TARGET:g}, "
           "lowest; "
           "every step bf16"] = (
          f"{_a(r.get(f'{act} greedy f32'))}; "
          + (f"{r[f'{act} greedy met']} of {runs}, "
             f"{_a(r[f'{act} greedy min'])}" if runs else "-")
          + f"; {_a(r.get(f'{act} greedy bf16+rn'))}")
    cell["peak state error, first layer: bf16 vs every step; "
         "f16 vs every step"] = (
        f"{_e(r.get('se bf16'))} vs {_e(r.get('se bf16+rn'))}; "
        f"{_e(r.get('se f16'))} vs {_e(r.get('se f16+rn'))}")
    out.append(cell)
  return common.markdown_table(out, list(out[0]) if out else [])


def plot(rows: list[dict], path: str) -> None:
  # pylint: disable=g-import-not-at-top
  from matplotlib import colormaps, ticker
  fig, axes = common.new_figure(2, 2, figsize=(12, 8.5))
  panels = [
      (axes[0, 0], "|relative perplexity change| (worst run)",
       [("replay presets", lambda r: abs(r["worst_replay_ppl"])
         if "worst_replay_ppl" in r else None),
        ("every-step baselines", lambda r: abs(r["worst_baseline_ppl"])
         if "worst_baseline_ppl" in r else None)], PPL_TOLERANCE, True),
      (axes[0, 1], "mean TV to the reference, L 16, f32 activations",
       [("bf16 replay", lambda r: r.get("f32act tv bf16")),
        ("every-step bf16", lambda r: r.get("f32act tv bf16+rn")),
        ("f16 + fp8 copy", lambda r: r.get("f32act tv f16+fp8")),
        ("every-step fp8", lambda r: r.get("f32act tv fp8+rn"))], None,
       True),
      (axes[1, 0], "greedy agreement, 2048 tokens, f32 activations",
       [("lowest 16-bit master", lambda r: r.get("f32act greedy min")
         if r.get("f32act greedy runs") == len(SIXTEEN_BIT_MASTERS) else None),
        ("every-step bf16", lambda r: r.get("f32act greedy bf16+rn"))],
       AGREEMENT_TARGET, False),
      (axes[1, 1], "peak state error vs float64, first layer",
       [("bf16 master", lambda r: r.get("se bf16")),
        ("every-step bf16", lambda r: r.get("se bf16+rn")),
        ("f16 master", lambda r: r.get("se f16")),
        ("every-step f16", lambda r: r.get("se f16+rn"))], None, True)]
  colors = colormaps["tab10"].colors
  for ax, title, series, target, logy in panels:
    for i, (name, get) in enumerate(series):
      for family, style in (("mamba2", "-o"), ("gdn", "--s")):
        pts = sorted((r["parameters"], get(r)) for r in rows
                     if r["family"] == family and get(r) is not None)
        if pts:
          x, y = zip(*pts)
          ax.plot(np.array(x) / 1e6, y, style, color=colors[i],
                  label=f"{name}, {'Mamba-2' if family == 'mamba2' else 'GDN'}")
    if target is not None:
      ax.axhline(target, color="k", lw=0.8, ls=":", label="target")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.FixedLocator([20, 50, 100, 200, 300]))
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    if logy:
      ax.set_yscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
  common.save_plot(fig, path, dpi=110)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--studies", default="benchmarks/text_precision")
  ap.add_argument("--out_dir", default="benchmarks/text_precision")
  args = ap.parse_args()
  rows = [r for r in map(model_row, sorted(glob.glob(
      os.path.join(args.studies, "*")))) if r is not None]
  if not rows:
    raise SystemExit(f"no <model>/study/metrics.jsonl under {args.studies}")
  rows.sort(key=lambda r: (r["family"] != "mamba2", r["parameters"]))
  os.makedirs(args.out_dir, exist_ok=True)
  md = table(rows)
  with open(os.path.join(args.out_dir, "across.md"), "w") as f:
    f.write("# The real-text precision study across models\n\n"
            "Written by `python benchmarks/scripts/text_precision_across.py"
            "` from each model folder's study/ and study_f32/ records "
            "(benchmarks/README.md, Precision policies on real text, says "
            "what each column measures).\n\n" + md + "\n")
  plot(rows, os.path.join(args.out_dir, "across.png"))
  print(md)


if __name__ == "__main__":
  main()
