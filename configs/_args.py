"""The `--config=file.py:<arg>` check shared by the config files."""


def check_arg(arg: str | None, *variants: str) -> None:
  """Accepts None or "" (the full config), "smoke" and `variants`."""
  allowed = ("", "smoke") + variants
  if arg not in (None,) + allowed:
    names = ", ".join(repr(a) for a in allowed)
    raise ValueError(f"config arg must be one of {names}, got {arg!r}.")
