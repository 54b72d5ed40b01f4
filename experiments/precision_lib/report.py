"""summary.md and plots of the decode-precision study.

Tables per model: the accuracy delta and the relative perplexity change
(with the config.ppl_tolerance criterion) per preset x L beside the
every-step baselines; then every scored run, the long generations, the
state error against float64, and the targets:

  * every dual-precision preset (a read copy beside the master) within
    ppl_tolerance relative validation perplexity of the f32 reference at
    every L;
  * greedy agreement >= agreement_target over the generation for the
    16-bit-master presets (bf16 / f16 master), beside the f32 replay
    decode's (where it runs: the control);
  * the every-step bf16 baseline, for contrast.

A target reads "not run" where its records are missing (a stage left out).
"""

from __future__ import annotations

import os

import numpy as np

from experiments import common
from experiments.precision_lib import runs as R
from replayssm_jax.precision import PrecisionPolicy

SIXTEEN_BIT = ("bfloat16", "float16")


def _cell(r):
  return f"{r['delta_accuracy_points']:+.2f} ({'yes' if r['within'] else 'no'})"


def _ppl_cell(r):
  return (f"{100 * r['rel_perplexity']:+.4f}% "
          f"({'yes' if r['within_ppl'] else 'no'})")


def _tv_cell(r):  # records written before the distances: "-"
  return f"{r['mean_tv']:.1e}" if "mean_tv" in r else "-"


def _mine(records, name, kind=None):
  return [r for r in records if r.get("model") == name
          and (kind is None or r["kind"] == kind)]


def _baseline_cell(config, mine, pname, cell):
  key = R.baseline_key(R.make_policy(pname, config))
  label = R.baseline_label(key)
  b = next((r for r in mine if r["kind"] == "baseline"
            and r["label"] == label), None)
  if b is not None:
    return f"{b['label']}: {cell(b)}"
  if key == ("float32", "rn"):
    return "= reference"
  return "-"


def _pivot(config, mine, cell) -> str:
  rows = []
  for pname in R.table_policies(config):
    row = {"policy": pname}
    for r in mine:
      if r["kind"] == "replay" and r["policy"] == pname:
        row[f"L={r['L']}"] = cell(r)
    row["baseline (every step)"] = _baseline_cell(config, mine, pname, cell)
    rows.append(row)
  cols = ["policy"] + [f"L={L}" for L in config.buffer_lens]
  if config.baseline_contrast:
    cols.append("baseline (every step)")
  return common.markdown_table(rows, cols)


def _model_section(config, info, records) -> list[str]:
  name = info["model"]
  mine = _mine(records, name)
  ref = next((r for r in mine if r["kind"] == "reference"), None)
  dtype = f", {info['dtype']} activations" if info.get("dtype") else ""
  head = [f"## {name} ({info['task']}, pattern `{info['pattern']}`, "
          f"{info.get('num_params', 0):,} parameters{dtype})", ""]
  if ref is None:
    return head + ["(no scoring stage in these records)", ""]
  Ls = list(config.buffer_lens)
  return head + [
      f"seq_len {ref['seq_len']}, {ref['decode_steps']} decode steps, "
      f"{ref['num_targets']} scored targets. Reference (f32 baseline): "
      f"accuracy {ref['accuracy']:.4f}, loss {ref['loss']:.4f} (perplexity "
      f"{ref['perplexity']:.4f}); trained in `{info['train_workdir']}`. "
      "Flushes per row: "
      + ", ".join(f"L={L}: {ref['decode_steps'] // L}" for L in Ls) + ".",
      "",
      "Accuracy delta vs the reference (percentage points; |delta| <= "
      f"{config.within_points:g}?):", "",
      _pivot(config, mine, _cell), "",
      "Relative perplexity change vs the reference (|change| <= "
      f"{100 * config.ppl_tolerance:g}%?):", "",
      _pivot(config, mine, _ppl_cell), "",
      "Mean total-variation distance between the next-token distribution "
      "and the reference's at the scored positions: the per-step "
      "probability that a sample coupled to the reference's (the best "
      "coupling) differs from it:", "",
      _pivot(config, mine, _tv_cell), ""]


def _targets(config, models, records) -> list[str]:
  rows = []
  tol, target = config.ppl_tolerance, config.agreement_target
  for info in models:
    mine = _mine(records, info["model"])
    dual = [r for r in mine if r["kind"] == "replay"
            and PrecisionPolicy.preset(r["policy"]).read_dtype]
    greedy = [r for r in mine if r["kind"] == "generation"
              and r["mode"] == "greedy" and r["run_kind"] == "replay"
              and r.get("policy")
              and PrecisionPolicy.preset(r["policy"]).checkpoint_dtype
              in SIXTEEN_BIT]
    row = {"model": info["model"]}
    if dual:
      worst = max(dual, key=lambda r: abs(r["rel_perplexity"]))
      ok = sum(abs(r["rel_perplexity"]) <= tol for r in dual)
      row["dual-precision ppl"] = (
          f"{'met' if ok == len(dual) else 'missed'}: {ok}/{len(dual)} "
          f"within; worst {worst['policy']} L={worst['L']} "
          f"{100 * worst['rel_perplexity']:+.4f}%")
    else:
      row["dual-precision ppl"] = "not run"
    if greedy:
      worst = min(greedy, key=lambda r: r["agreement"])
      ok = all(r["agreement"] >= target for r in greedy)
      row["16-bit-master greedy agreement"] = (
          f"{'met' if ok else 'missed'}: min {worst['agreement']:.4f} "
          f"({worst['policy']} L={worst['L']}, {worst['new_tokens']} "
          "tokens)")
      control = [r for r in mine if r["kind"] == "generation"
                 and r["mode"] == "greedy" and r["run_kind"] == "replay"
                 and r.get("policy") == "f32"]
      if control:  # the same math in another order: the model's own noise
        row["16-bit-master greedy agreement"] += (
            f"; f32 replay {control[0]['agreement']:.4f}")
      diverged = [r for r in greedy
                  if r.get("divergence_margin_max") is not None]
      if diverged:  # near-ties (rounding anywhere decides them) or errors
        worst = max(diverged, key=lambda r: r["divergence_margin_max"])
        row["16-bit-master greedy agreement"] += (
            f"; reference margin at a divergence <= "
            f"{worst['divergence_margin_max']:.3g} (median over all tokens "
            f"{worst['ref_margin_median']:.3g})")
    else:
      row["16-bit-master greedy agreement"] = "not run"
    b = [r for r in mine if r["kind"] == "baseline"
         and r["label"] == "bf16+rn"]
    g = [r for r in mine if r["kind"] == "generation"
         and r["mode"] == "greedy" and r["label"] == "bf16+rn"]
    parts = []
    if b:
      parts.append(f"ppl {100 * b[0]['rel_perplexity']:+.4f}%")
    if g:
      parts.append(f"greedy agreement {g[0]['agreement']:.4f}")
    row["bf16 every-step baseline"] = "; ".join(parts) or "not run"
    rows.append(row)
  return ["## Targets", "",
          f"Dual-precision presets within {100 * tol:g}% relative "
          "perplexity at every L; greedy agreement >= "
          f"{target:g} for the 16-bit-master presets, beside the f32 "
          "replay decode's (the same math summed in another order: what "
          "rounding elsewhere in the model does alone); the every-step bf16 "
          "baseline for contrast.", "",
          common.markdown_table(rows, ["model", "dual-precision ppl",
                                       "16-bit-master greedy agreement",
                                       "bf16 every-step baseline"]), ""]


def write_summary(config, workdir, models, records) -> str:
  lines = [
      "# Decode accuracy and perplexity under precision policies",
      "",
      "Decode mode: prefill 1 token, then teacher-forced decode steps over "
      "each sequence. Reference: the f32 baseline decode. Replay buffers "
      f"{config.buffer_dtype}; SR seed {config.sr_seed}. 'baseline' = the "
      "full state stored every step in the policy's storage dtype "
      "(read_dtype, else checkpoint_dtype) with its rounding.",
      "",
  ]
  for info in models:
    lines += _model_section(config, info, records)
  scored = [r for r in records if r["kind"] in ("replay", "baseline")]
  if scored:
    cols = ["model", "kind", "label", "L", "flushes_per_row", "accuracy",
            "delta_accuracy_points", "within", "agreement", "loss",
            "delta_loss", "perplexity", "rel_perplexity", "within_ppl",
            "mean_kl", "mean_tv", "max_tv", "max_rel_logit_diff"]
    fmts = {"accuracy": ".4f", "delta_accuracy_points": "+.2f",
            "agreement": ".4f", "loss": ".4f", "delta_loss": "+.4f",
            "perplexity": ".4f", "rel_perplexity": "+.2e",
            "mean_kl": ".2e", "mean_tv": ".2e", "max_tv": ".2e",
            "max_rel_logit_diff": ".2e"}
    lines += ["## All runs", "",
              "agreement: share of scored positions where the greedy "
              "prediction equals the reference's; mean_kl: mean KL(reference "
              "|| run) of the next-token distributions (nats); mean_tv / "
              "max_tv: their total-variation distance, mean / max over the "
              "scored positions; max_rel_logit_diff: max |logit - reference "
              "logit| / max |reference logit| over all positions.", "",
              common.markdown_table(scored, cols, fmts), ""]
  gen = [r for r in records if r["kind"] == "generation"]
  if gen:
    def shape(key):  # the records' (a merge of runs may mix them)
      return "/".join(sorted({str(r[key]) for r in gen}))
    temps = sorted({r["temperature"] for r in gen if r["mode"] == "sampled"})
    lines += [
        "## Long generation", "",
        f"{shape('rows')} prompts of {shape('prompt_len')} tokens, "
        f"{shape('new_tokens')} new tokens each, against the f32 baseline's"
        + (f"; sampled at temperature {'/'.join(f'{t:g}' for t in temps)} "
           "with the same PRNG key in every run" if temps else "")
        + ". agreement: share of tokens equal to the "
        "reference's; first divergence: index of a row's first differing "
        "token (median / min over rows); margin at divergence (greedy): "
        "the reference's top-1 minus top-2 logit where a row first "
        "differs (median / max over the diverged rows), beside its median "
        "over every generated position (ref margin).", "",
        common.markdown_table(gen, [
            "model", "mode", "run_kind", "label", "L", "new_tokens",
            "agreement", "first_divergence_median", "first_divergence_min",
            "never_diverged", "divergence_margin_median",
            "divergence_margin_max", "ref_margin_median"], dict(
                agreement=".4f", never_diverged=".2f",
                first_divergence_median=".0f",
                divergence_margin_median=".3f", divergence_margin_max=".3f",
                ref_margin_median=".2f")), ""]
  se = [r for r in records if r["kind"] == "state_error"]
  if se:
    lines += [
        "## State error against float64", "",
        "Each recorded layer's state stepped over the inputs it saw in the "
        "f32 baseline decode, beside a float64 recurrence from the same "
        "start (`experiments/precision_lib/state_error.py`). final / peak: "
        "max |S - S64| / max |S64| at the last point / its maximum over "
        "the points; out: the output's largest relative error.", "",
        common.markdown_table(se, [
            "model", "block", "mixer", "run_kind", "label", "L", "steps",
            "final_state_max_rel", "peak_state_max_rel", "max_out_rel"],
            {c: ".2e" for c in ("final_state_max_rel", "peak_state_max_rel",
                                "max_out_rel")}), ""]
  lines += _targets(config, models, records)
  return common.write_summary(workdir, "\n".join(lines))


# ------------------------------------------------------------------ plots
def _policy_axes(config, ax, mine, val, band=None):
  from matplotlib import colormaps  # pylint: disable=g-import-not-at-top
  Ls = list(config.buffer_lens)
  bl = {r["label"]: r for r in mine if r["kind"] == "baseline"}
  for k, pname in enumerate(R.table_policies(config)):
    color = colormaps["tab20"](k % 20)  # 13 presets: no colour twice
    rs = sorted((r for r in mine if r["kind"] == "replay"
                 and r["policy"] == pname), key=lambda r: r["L"])
    ax.plot([r["L"] for r in rs], [val(r) for r in rs], "o-", color=color,
            label=pname)
    key = R.baseline_key(R.make_policy(pname, config))
    b = bl.get(R.baseline_label(key))
    if b is not None and config.baseline_contrast:
      ax.plot([1], [val(b)], "s", mfc="none", color=color)
  if band is not None:
    ax.axhspan(-band, band, color="0.9", zorder=0)
  ax.set_xscale("log", base=2)
  ax.set_xticks([1] + Ls)
  ax.set_xticklabels(["1 (baseline)"] + [str(L) for L in Ls])
  ax.set_xlabel("buffer length L (hollow squares: baseline stored every "
                "step)")
  ax.grid(True, alpha=0.3)


def plot_scores(config, workdir, models, records) -> list[str]:
  """accuracy_delta.png (accuracy delta, greedy disagreement),
  perplexity.png (relative perplexity change, in the band of the
  criterion) and distance.png (mean total-variation distance to the
  reference on a log scale: the differences the perplexity band is too
  coarse to show; records without it are left out), one column per
  model."""
  scored = [m for m in models if _mine(records, m["model"], "reference")]
  if not scored:
    return []
  n = len(scored)
  out = []
  panels = (
      ("accuracy_delta.png", (
          (lambda r: r["delta_accuracy_points"],
           "accuracy - f32 reference (points)", config.within_points),
          (lambda r: 100.0 * (1.0 - r["agreement"]),
           "greedy predictions != f32 reference (%)", None))),
      ("perplexity.png", (
          (lambda r: 100.0 * r["rel_perplexity"],
           "perplexity / f32 reference - 1 (%)",
           100.0 * config.ppl_tolerance),)),
      ("distance.png", (
          (lambda r: r.get("mean_tv", np.nan),
           "mean total-variation distance to the f32 reference", "log"),)))
  for fname, rows in panels:
    fig, axes = common.new_figure(len(rows), n,
                                  figsize=(6.5 * n, 4.0 * len(rows)))
    for j, info in enumerate(scored):
      mine = _mine(records, info["model"])
      for i, (val, ylabel, band) in enumerate(rows):
        ax = axes[i][j]
        _policy_axes(config, ax, mine, val,
                     None if band == "log" else band)
        if band == "log":
          from matplotlib import ticker  # pylint: disable=g-import-not-at-top
          ax.set_yscale("log")
          # label minor ticks too (the values often span about a decade,
          # where powers of ten alone say little): 2-8 x 10^k within 30x,
          # 2 and 5 x 10^k beyond
          lo, hi = ax.get_ylim()
          keep = "2345678" if hi < 30 * lo else "25"
          ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
              lambda v, _, keep=keep: f"{v:.0e}" if f"{v:.0e}"[0] in keep
              else ""))
          ax.tick_params(axis="y", which="minor", labelsize=7)
          ax.grid(True, which="both", alpha=0.3)
        ax.set_ylabel(ylabel)
        if i == 0:
          ax.set_title(f"{info['model']} (seq_len {info['seq_len']})")
          ax.legend(fontsize=7, ncol=2)
    out.append(common.save_plot(fig, os.path.join(workdir, fname)))
  return out


def plot_state_error(workdir, models, records) -> str | None:
  """state_error.png: per model, the state error (max over the recorded
  layers) against float64 vs decode step, per run."""
  names = [m["model"] for m in models
           if _mine(records, m["model"], "state_error")]
  if not names:
    return None
  fig, axes = common.new_figure(1, len(names),
                                figsize=(6.5 * len(names), 4.5))
  for ax, name in zip(axes[0], names):
    mine = _mine(records, name, "state_error")
    runs = {}
    for r in mine:
      runs.setdefault((r["run_kind"], r["label"], r["L"]), []).append(r)
    from matplotlib import colormaps  # pylint: disable=g-import-not-at-top
    colors = colormaps["tab20"]
    for k, ((kind, label, L), rs) in enumerate(sorted(
        runs.items(), key=lambda kv: (kv[0][0] != "replay", kv[0][1],
                                      kv[0][2] or 0))):
      err = np.max([r["state_max_rel"] for r in rs], axis=0)
      ax.plot(rs[0]["points"], np.maximum(err, 1e-17),
              "-" if kind == "replay" else "--", color=colors(k % 20),
              label=f"{label} L={L}" if kind == "replay" else
              f"baseline {label}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel("max|S - S64| / max|S64| (max over layers)")
    ax.set_title(f"{name} (dashed: every-step baselines)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
  return common.save_plot(fig, os.path.join(workdir, "state_error.png"))


def plot_generation(workdir, models, records) -> str | None:
  """generation.png: greedy / sampled token agreement per run."""
  names = [m["model"] for m in models
           if _mine(records, m["model"], "generation")]
  if not names:
    return None
  fig, axes = common.new_figure(1, len(names),
                                figsize=(12.0 * len(names), 4.5))
  for ax, name in zip(axes[0], names):
    gen = _mine(records, name, "generation")
    labels = list(dict.fromkeys(
        f"{r['label']} L={r['L']}" if r["run_kind"] == "replay"
        else f"baseline {r['label']}" for r in gen))
    x = np.arange(len(labels))
    for k, mode in enumerate(dict.fromkeys(r["mode"] for r in gen)):
      val = {(f"{r['label']} L={r['L']}" if r["run_kind"] == "replay"
              else f"baseline {r['label']}"): r["agreement"]
             for r in gen if r["mode"] == mode}
      ax.bar(x + 0.4 * k, [val.get(lbl, np.nan) for lbl in labels], 0.4,
             label=mode)
    ax.set_xticks(x + 0.2)
    ax.set_xticklabels(labels, rotation=70, fontsize=6)
    ax.set_ylabel("token agreement with the f32 baseline")
    ax.set_ylim(0, 1.02)
    ax.set_title(name)
    ax.legend()
  return common.save_plot(fig, os.path.join(workdir, "generation.png"))
