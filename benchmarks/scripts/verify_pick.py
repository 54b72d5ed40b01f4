"""Prints the VerifyConfig fields (JSON) of the fastest passing variant of
a verify_sweep.py result (device time per verify + commit iteration);
"{}" (the default) when none passed."""

import json
import sys


def main():
  with open(sys.argv[1]) as f:
    variants = json.load(f)["variants"]
  timed = [(r["device_ms_per_iter"], r["config"]) for r in variants.values()
           if r.get("check") == "PASS" and "device_ms_per_iter" in r
           and r.get("config") is not None]
  print(json.dumps(min(timed, key=lambda t: t[0])[1] if timed else {}))


if __name__ == "__main__":
  main()
