"""The `--config=file.py:<arg>` check shared by the config files."""


def check_arg(arg: str | None, *variants: str) -> None:
  """Accepts None or "" (the full config), "smoke" and `variants`."""
  allowed = ("", "smoke") + variants
  if arg not in (None,) + allowed:
    names = ", ".join(repr(a) for a in allowed)
    raise ValueError(f"config arg must be one of {names}, got {arg!r}.")


def bench_config(arg: str | None, smoke_model: dict, model: dict):
  """`check_arg(arg)`, then a ConfigDict with seed 0 and `model` (a copy of
  smoke_model for arg "smoke", else of model); returns (config, smoke)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  check_arg(arg)
  smoke = arg == "smoke"
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = ml_collections.ConfigDict(dict(smoke_model if smoke
                                                else model))
  return config, smoke
