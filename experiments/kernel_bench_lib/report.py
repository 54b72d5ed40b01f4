"""The kernel benchmark's reports: results.md tables and speedup.png."""

from __future__ import annotations

from experiments import common


# ---------------------------------------------------------------- reports
def _human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"


def _markdown(results: dict) -> str:
  meta = results["meta"]
  bw = results["stream_bandwidth"]
  cfg = results["config"]
  lines = [
      "# Decode-step kernel benchmark: baseline vs ReplaySSM",
      "",
      f"- device: {meta['device_kind']} ({meta['backend']}), jax "
      f"{meta['jax']}, jaxlib {meta['jaxlib']}, {meta['date']}",
      f"- command: `{meta['command_line']}`",
      f"- layer: nheads {cfg['nheads']}, headdim {cfg['headdim']}, dstate "
      f"{cfg['dstate']}, ngroups {cfg['ngroups']}; activations "
      f"{cfg['act_dtype']}, buffers {cfg['buffer_dtype']}, z "
      f"{cfg['has_z']}",
      f"- stream bandwidth (jitted x+1, read+write): {bw['gbps']:.1f} GB/s "
      f"median",
      f"- method: one jitted call runs >= {cfg['min_steps']} consecutive "
      f"steps over rotating donated state sets totalling >= "
      f"{_human_bytes(cfg['rotate_bytes'])}; median of {cfg['iters']} "
      f"calls after {cfg['warmup']} warm-up calls. amortized = ((L-1) * "
      "non_flush(fill (L-2)//2) + flush) / L; natural = counters advancing, "
      "rows staggered (count = row % L). speed-ups are over the same "
      "implementation's baseline step; `vs best` over the fastest baseline "
      "implementation; `pred` is the traffic model's baseline/amortized "
      "bytes; `%bw` = model bytes / time / stream bandwidth.",
      "",
      "## Summary (µs per decode step, medians)",
      "",
  ]
  cols = ["impl", "checkpoint_dtype", "batch", "L", "baseline_us",
          "non_flush_us", "flush_us", "amortized_us", "natural_us",
          "speedup_amortized", "speedup_natural", "speedup_vs_best_baseline",
          "predicted_speedup", "baseline_frac_bw", "natural_frac_bw",
          "checks_passed"]
  heads = {"checkpoint_dtype": "ckpt", "baseline_us": "base",
           "non_flush_us": "non-flush", "flush_us": "flush",
           "amortized_us": "amortized", "natural_us": "natural",
           "speedup_amortized": "x amort", "speedup_natural": "x natural",
           "speedup_vs_best_baseline": "x vs best", "predicted_speedup":
           "x pred", "baseline_frac_bw": "base %bw",
           "natural_frac_bw": "natural %bw", "checks_passed": "check"}
  fmts = {k: ".2f" for k in cols if k.endswith("_us")}
  fmts.update({k: ".2f" for k in cols if k.startswith(("speedup",
                                                       "predicted"))})
  fmts.update(baseline_frac_bw=".0%", natural_frac_bw=".0%")
  lines.append(common.markdown_table(results["summary"], cols, fmts, heads))
  lines += ["", "## Checks against the reference", ""]
  lines.append(common.markdown_table(
      results["checks"], ["impl", "op", "checkpoint_dtype", "batch", "L",
                          "passed", "max_err_y", "max_err_state",
                          "tolerance", "reason"],
      {"max_err_y": ".2e", "max_err_state": ".2e", "tolerance": ".0e"}))
  lines += ["", "## Every timing", ""]
  lines.append(common.markdown_table(
      results["timings"], ["impl", "op", "phase", "checkpoint_dtype",
                           "batch", "L", "fill", "median_us", "p10_us",
                           "p90_us", "achieved_gbps", "frac_stream_bw",
                           "num_sets", "steps_per_call", "hlo_state_copies"],
      {"median_us": ".2f", "p10_us": ".2f", "p90_us": ".2f",
       "achieved_gbps": ".0f", "frac_stream_bw": ".0%"}))
  return "\n".join(lines) + "\n"


def _plot(results: dict, path: str):
  rows = results["summary"]
  impls = sorted({r["impl"] for r in rows})
  dtypes = list(dict.fromkeys(r["checkpoint_dtype"] for r in rows))
  if not rows:
    dtypes, impls = ["none"], ["none"]
  fig, axes = common.new_figure(len(impls), len(dtypes),
                                figsize=(6 * len(dtypes), 4 * len(impls)))
  for i, impl in enumerate(impls):
    for j, sdt in enumerate(dtypes):
      ax = axes[i][j]
      sel = [r for r in rows if r["impl"] == impl
             and r["checkpoint_dtype"] == sdt
             and r["speedup_amortized"] is not None]
      for L in sorted({r["L"] for r in sel}):
        pts = sorted((r["batch"], r["speedup_amortized"],
                      r["predicted_speedup"]) for r in sel if r["L"] == L)
        xs = [p[0] for p in pts]
        line, = ax.plot(xs, [p[1] for p in pts], "o-", label=f"L={L}")
        ax.plot(xs, [p[2] for p in pts], ":", color=line.get_color(),
                alpha=0.6)
      ax.axhline(1.0, color="k", lw=0.8, ls="--")
      ax.set_xscale("log", base=2)
      batches = sorted({r["batch"] for r in sel})
      if batches:
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
      ax.set_xlabel("batch")
      ax.set_ylabel("replay amortized speed-up over baseline")
      ax.set_title(f"{impl}, {sdt} checkpoint "
                   f"({results['meta']['device_kind']})", fontsize=10)
      ax.grid(True, which="both", alpha=0.3)
      if sel:
        ax.legend(fontsize=8, title="dotted: model", title_fontsize=7)
  common.save_plot(fig, path)
