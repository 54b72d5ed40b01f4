"""The implementation entry of the op dispatcher (no project imports).

A kernel package lists its implementations as a plain table,

  IMPLEMENTATIONS = (("selective_state_update", Implementation(...)), ...)

which the dispatcher (`replayssm_jax.dispatch`) reads when it loads the
package; the package never imports the dispatcher. Users may also add
entries at run time with `replayssm_jax.register_implementation`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to run an op.

  Attributes:
    name: the name users pass as `implementation=`.
    fn: callable with the reference op's signature plus `config=` keyword.
    supports: callable(**op_kwargs) -> None | str; a string says why the
      implementation cannot take these inputs on this device.
    preferred: callable() -> bool; whether implementation=None may pick it
      (e.g. a Pallas kernel only on GPU: elsewhere it runs in the slow
      interpret mode, which only an explicit request gets).
    priority: higher runs first when implementation=None.
    rows: fn takes `rows=` [k] (a slot per token row of a pool's state,
      `replayssm_jax.slots`) and reads and writes those state rows in
      place; otherwise a row-indexed call runs fn on gathered rows.
  """
  name: str
  fn: Callable
  supports: Callable[..., str | None] = lambda **_: None
  preferred: Callable[[], bool] = lambda: True
  priority: int = 0
  rows: bool = False
