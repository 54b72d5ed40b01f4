"""The loop that verify_sweep.py and output_split.py share: one record per
named variant, errors recorded rather than raised, one line printed per
variant, everything written as JSON at the end."""

import json


def run(names, variants: dict, config_cls, measure, res: dict, out: str):
  """For each name: its config (config_cls(**variants[name]); a None entry
  is the XLA reference op, config None) and implementation ("pallas" or
  "reference") start its record r, then measure(name, r, config, impl)
  fills r. An exception is recorded in r["error"], with r["check"] "FAIL"
  unless the variant's check passed before it. The records go to
  res["variants"], and res to the JSON file `out`."""
  for name in names:
    fields = variants[name]
    config = None if fields is None else config_cls(**fields)
    impl = "reference" if config is None else "pallas"
    r = dict(config=fields, implementation=impl)
    try:
      measure(name, r, config, impl)
    except Exception as e:  # pylint: disable=broad-except
      r["check"] = r.get("check", "FAIL")
      r["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    res["variants"][name] = r
    print(name, {k: v for k, v in r.items() if k not in ("top", "config")},
          flush=True)
  with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
