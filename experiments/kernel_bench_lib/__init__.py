"""The pieces of experiments/kernel_bench.py: random data (`data`), the
timed steps and their kernel variants (`steps`), the timing loop
(`timing`), the checks against the reference (`checks`) and the reports
(`report`)."""
