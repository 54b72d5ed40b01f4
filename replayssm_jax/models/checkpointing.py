"""Exact save and restore of a decode state (`ModelState`) with orbax.

  save_state(path, state)        writes the state's leaves under the
                                 directory `path` and a JSON sidecar
                                 (`TREE_FILE`) listing every leaf's path,
                                 shape and dtype.
  restore_state(path, template)  reads them back onto `template`, a state
                                 with the same layout (e.g.
                                 `model.init_state(...)` with the arguments
                                 of the saved one).
  save_tree / restore_tree       the same for any pytree of arrays (the
                                 serving engine's snapshot).

Bit exactness: every floating-point leaf (float32, bfloat16, float16,
float8_e4m3fn, ...) is stored as the unsigned integers of its bits
(`jax.lax.bitcast_convert_type` to uint8 / uint16 / uint32 / uint64) and
bitcast back on restore, so that every bit survives, NaN payloads and the
stale slots of the replay buffers included, whatever dtypes the storage
backend supports. Integer and bool leaves are stored as they are. The
sidecar records both the leaf's dtype and its stored dtype.

Static pytree metadata (a layer's PrecisionPolicy, a replay state's
pending_window) is no leaf: it comes from the template. The sidecar keeps
the saved tree's structure as text (`static`), and a template whose
structure, leaf paths, shapes, dtypes or static metadata differ is refused
with a ValueError that names the first leaf (or field) that differs.

orbax-checkpoint is an optional dependency (extra "checkpoint"); it is
imported when a function runs. Neither function modifies, donates or
deletes the arrays passed in.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax.models import states as S

TREE_FILE = "tree.json"  # the sidecar, inside the checkpoint directory
ARRAYS_DIR = "arrays"  # the orbax checkpoint, inside the directory
FORMAT = "replayssm_jax.ModelState/1"


def _orbax():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "saving and restoring decode states needs orbax-checkpoint: "
        "pip install 'replayssm-jax[checkpoint]'.") from e
  return ocp


def _stored_dtype(dtype) -> np.dtype:
  """The dtype a leaf of `dtype` is written as: the unsigned integer of
  the same width for floating dtypes, the dtype itself otherwise."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return np.dtype(f"uint{8 * dtype.itemsize}")
  return dtype


def _key(i: int) -> str:
  return f"leaf_{i:05d}"


def describe(tree, fmt: str = FORMAT) -> dict:
  """The sidecar's description of a state (or of a template): leaf paths
  with their shapes, dtypes and stored dtypes, and the structure with the
  static metadata as text."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return dict(
      format=fmt,
      static=str(treedef),
      leaves=[dict(path=jax.tree_util.keystr(p), key=_key(i),
                   shape=list(np.shape(x)), dtype=np.dtype(x.dtype).name,
                   stored_dtype=_stored_dtype(x.dtype).name)
              for i, (p, x) in enumerate(leaves)])


def _check_state(name, state):
  if not isinstance(state, S.ModelState):
    raise TypeError(f"{name} must be a ModelState, got "
                    f"{type(state).__name__}.")
  _check_leaves(name, state)


def _check_leaves(name, tree):
  for p, x in jax.tree_util.tree_leaves_with_path(tree):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
      raise TypeError(f"{name} leaf {jax.tree_util.keystr(p)} is not an "
                      f"array (got {type(x).__name__}).")


def save_state(path, state: S.ModelState, *, overwrite: bool = False):
  """Writes `state` to the directory `path` (created; its parent must
  exist).

  Args:
    path: the checkpoint directory (a str or os.PathLike). It must not
      exist unless overwrite=True (then it is replaced).
    state: the ModelState, e.g. after `prefill` and some `decode_step`s.
      Its arrays are read, never modified or deleted.
    overwrite: replace an existing directory at `path`.

  Returns:
    The sidecar's description of the state (a dict, as in `TREE_FILE`).
  """
  _check_state("state", state)
  return save_tree(path, state, overwrite=overwrite)


def save_tree(path, tree, *, overwrite: bool = False, fmt: str = FORMAT,
              extra: dict | None = None) -> dict:
  """`save_state` of any pytree of arrays (its leaves bit for bit, its
  structure in the sidecar, tagged `fmt`); `extra` (JSON) is kept in the
  sidecar under "extra"."""
  _check_leaves("tree", tree)
  ocp = _orbax()
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path) and not overwrite:
    raise ValueError(f"path {path!r} exists; pass overwrite=True to "
                     f"replace it.")
  if not os.path.isdir(os.path.dirname(path)):
    raise ValueError(f"the parent directory of path {path!r} does not "
                     f"exist.")
  info = describe(tree, fmt)
  arrays = {}
  for leaf, x in zip(info["leaves"], jax.tree.leaves(tree)):
    x = jnp.asarray(x)
    if x.dtype != np.dtype(leaf["stored_dtype"]):
      x = jax.lax.bitcast_convert_type(x, leaf["stored_dtype"])
    arrays[leaf["key"]] = x
  if os.path.exists(path):
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(path)
  os.makedirs(path)
  with ocp.PyTreeCheckpointer() as ckpt:
    ckpt.save(os.path.join(path, ARRAYS_DIR), arrays)
  # The sidecar is written last: a directory without it is incomplete.
  tmp = os.path.join(path, TREE_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(info if extra is None else dict(info, extra=extra), f,
              indent=1)
  os.replace(tmp, os.path.join(path, TREE_FILE))
  return info


def read_description(path, fmt: str = FORMAT) -> dict:
  """The sidecar of the checkpoint directory `path` (ValueError naming the
  path if it is missing or unreadable, or not of format `fmt`)."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise ValueError(f"no decode-state checkpoint at path {path!r}: not a "
                     f"directory.")
  tree_file = os.path.join(path, TREE_FILE)
  try:
    with open(tree_file) as f:
      info = json.load(f)
  except FileNotFoundError:
    raise ValueError(f"no decode-state checkpoint at path {path!r}: "
                     f"{TREE_FILE} is missing (an incomplete save?).") from None
  except (OSError, ValueError) as e:
    raise ValueError(f"corrupt decode-state checkpoint: {tree_file!r} is "
                     f"not readable JSON ({e}).") from e
  if not isinstance(info, dict) or info.get("format") != fmt or (
      not isinstance(info.get("leaves"), list)):
    raise ValueError(f"corrupt decode-state checkpoint: {tree_file!r} is "
                     f"not a {fmt} description.")
  return info


def check_compatible(saved: dict, template: dict, where: str) -> None:
  """Raises a ValueError naming the first leaf whose path, shape or dtype
  differs between two descriptions, or the static metadata if only that
  differs. `where` names the checkpoint in the message."""
  sl, tl = saved["leaves"], template["leaves"]
  for i in range(max(len(sl), len(tl))):
    s = sl[i] if i < len(sl) else None
    t = tl[i] if i < len(tl) else None
    if s is None or t is None or s.get("path") != t["path"]:
      if t is None:
        what = f"leaf {s.get('path')} is saved but not in the template"
      elif s is None:
        what = f"template leaf {t['path']} is not saved"
      else:
        what = (f"leaf {i} is {s.get('path')} in the checkpoint but "
                f"{t['path']} in the template")
      raise ValueError(f"the template's structure does not match the "
                       f"checkpoint {where}: {what} (restore onto a state "
                       f"built like the saved one).")
    for field in ("shape", "dtype"):
      if s.get(field) != t[field]:
        raise ValueError(f"leaf {t['path']}: the checkpoint {where} holds "
                         f"{field} {s.get(field)} but the template "
                         f"{t[field]}.")
    if s.get("stored_dtype") != t["stored_dtype"]:
      raise ValueError(f"corrupt decode-state checkpoint {where}: leaf "
                       f"{t['path']} has stored dtype "
                       f"{s.get('stored_dtype')}, expected "
                       f"{t['stored_dtype']}.")
  if saved.get("static") != template["static"]:
    raise ValueError(
        f"the template's static metadata (precision policy, "
        f"pending_window, ...) does not match the checkpoint {where}: "
        f"saved {saved.get('static')}, template {template['static']}.")


def _placement(x):
  """The sharding a restored leaf takes from its template leaf `x`: its own
  if it is committed to devices (or an abstract leaf with a sharding);
  None for an uncommitted array (as `init_state` makes): the restored leaf
  is then uncommitted too, on the default device, so that a jitted
  function that took the template's arrays takes it without compiling
  again."""
  if isinstance(x, jax.Array):
    return x.sharding if x.committed else None
  return getattr(x, "sharding", None)


def restore_state(path, template: S.ModelState) -> S.ModelState:
  """The state saved at `path`, restored onto `template`.

  Args:
    path: a directory written by `save_state`.
    template: a ModelState (arrays or jax.ShapeDtypeStructs) with the saved
      state's layout and static metadata, e.g. `model.init_state(...)` with
      the same arguments (batch, max_len, ssm_mode, buffer_len, dtypes,
      precision). Its structure gives the result's static fields; each
      restored leaf takes the template leaf's sharding if that leaf is
      committed to devices (or is a ShapeDtypeStruct with a sharding), and
      is otherwise an uncommitted array on the default device, as
      `init_state` makes them. The template's arrays are not modified or
      deleted.

  Returns:
    A new ModelState whose every leaf equals the saved one bit for bit, in
    the same dtype.

  Raises:
    ValueError: naming the path if it holds no (readable) checkpoint, or
      the first leaf whose path, shape or dtype does not match the
      template.
  """
  _check_state("template", template)
  return restore_tree(path, template)


def restore_tree(path, template, fmt: str = FORMAT):
  """`restore_state` of any pytree saved by `save_tree` with format `fmt`,
  onto `template` (the same structure, shapes, dtypes)."""
  _check_leaves("template", template)
  ocp = _orbax()
  path = os.path.abspath(os.fspath(path))
  saved = read_description(path, fmt)
  info = describe(template, fmt)
  check_compatible(saved, info, repr(path))
  leaves, treedef = jax.tree.flatten(template)
  abstract, restore_args, placements = {}, {}, []
  for leaf, x in zip(info["leaves"], leaves):
    shape, dtype = tuple(leaf["shape"]), np.dtype(leaf["stored_dtype"])
    sharding = _placement(x)
    placements.append(sharding)
    if sharding is None:  # read to the host, then placed as jnp.asarray
      abstract[leaf["key"]] = np.zeros(0, dtype)
      restore_args[leaf["key"]] = ocp.RestoreArgs(restore_type=np.ndarray,
                                                  dtype=dtype)
    else:
      abstract[leaf["key"]] = jax.ShapeDtypeStruct(shape, dtype,
                                                   sharding=sharding)
      restore_args[leaf["key"]] = ocp.ArrayRestoreArgs(
          sharding=sharding, global_shape=shape, dtype=dtype)
  arrays_dir = os.path.join(path, ARRAYS_DIR)
  try:
    with ocp.PyTreeCheckpointer() as ckpt:
      arrays = ckpt.restore(arrays_dir, args=ocp.args.PyTreeRestore(
          item=abstract, restore_args=restore_args))
  except Exception as e:  # orbax / tensorstore raise many kinds
    raise ValueError(f"corrupt decode-state checkpoint: the arrays under "
                     f"{arrays_dir!r} could not be restored "
                     f"({type(e).__name__}: {e}).") from e
  out = []
  for leaf, sharding in zip(info["leaves"], placements):
    x = arrays.get(leaf["key"]) if isinstance(arrays, dict) else None
    if x is None or tuple(x.shape) != tuple(leaf["shape"]) or (
        np.dtype(x.dtype) != np.dtype(leaf["stored_dtype"])):
      raise ValueError(f"corrupt decode-state checkpoint at path {path!r}: "
                       f"leaf {leaf['path']} was not restored as "
                       f"{leaf['stored_dtype']}{leaf['shape']}.")
    if sharding is None:  # numpy: reinterpret the bits on the host
      x = jnp.asarray(x.view(np.dtype(leaf["dtype"])))
    elif leaf["dtype"] != leaf["stored_dtype"]:
      x = jax.lax.bitcast_convert_type(x, leaf["dtype"])
    out.append(x)
  return jax.tree.unflatten(treedef, out)
