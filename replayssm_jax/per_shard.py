"""Dispatched ops per shard: each op's PartitionSpecs on a ("data",
"model") mesh, and running an implementation under `jax.shard_map`.

Under `jax.set_mesh(mesh)` with a mesh of more than one device whose axes
include "data" and "model" (`sharding.make_mesh`), `dispatch.dispatch`
runs the chosen implementation of an op listed in `RULES` under
`jax.shard_map`: each device runs it (a Pallas kernel, or the reference) on
its own rows (split over "data") and heads (split over "model"), with no
communication inside the op. Without that context the op runs as written
and XLA's SPMD partitioner places it: right for the pure-JAX references,
but a Pallas kernel is an opaque custom call that the partitioner can only
run whole, on gathered operands.

The splits follow the placement rules of `replayssm_jax.sharding` (which
builds its state specs from the layouts below), so a state placed by
`shard_state` enters and leaves an op without moving:

  Mamba-2 ops    heads over "model" when `mamba_heads(H, G, m)`: H % m == 0
                 and the B/C groups either one (replicated) or split with
                 the heads (G % m == 0), so every shard holds the groups of
                 its heads; else replicated.
  GDN, KDA ops   value and key heads over "model" when HV % m == 0 and
                 HK % m == 0.
                 Under a stochastic-rounding policy both keep their heads
                 whole (rows only): the rounding bits are keyed by the
                 element's index in the whole row, so a split op would
                 round differently from one device.
  decode attention  KV heads (and their query heads) over "model" when
                 kv_heads % m == 0.
  gated norm     channels over "model" when its groups split (each shard
                 holds whole groups, its heads' own; the gate is cut from
                 the replicated in_proj output locally); else rows only:
                 the groups span shards, so its input is gathered over
                 "model" (one [b, d_inner] all-gather per Mamba layer).
  conv ops       rows, and channels over "model" when they run on a whole
                 conv input (the shard-major Mamba layout's joined xBC:
                 `models.shard_layout`); else rows only.
  add-norm       rows only.

Rows split over "data" when the batch divides; an axis the mesh does not
divide is replicated. Per-row and per-head ops compute the same numbers on
a shard as on the whole batch, so sharded == single device exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

AXES = ("data", "model")


def splits(n: int, m: int) -> bool:
  """Whether an axis of size n is split over a mesh axis of size m."""
  return m > 1 and n % m == 0


def mamba_heads(nheads: int, ngroups: int, m: int) -> bool:
  """Whether a Mamba-2 layer's heads split over m "model" shards: H % m ==
  0 with one (replicated) B/C group or groups split with the heads."""
  return splits(nheads, m) and (ngroups == 1 or splits(ngroups, m))


def gdn_heads(hv: int, hk: int, m: int) -> bool:
  """Whether a GDN layer's heads split: both HV and HK over m shards."""
  return splits(hv, m) and splits(hk, m)


def leaf_spec(x, layout, d: int, m: int):
  """P for an array with `layout`, a tuple naming its leading dims: "b"
  (rows, over "data"), "h" (heads, over "model") or None; an axis the mesh
  does not divide stays replicated. None for x None."""
  if x is None:
    return None
  out = []
  for n, a in zip(np.shape(x), layout):
    if a == "b" and splits(n, d):
      out.append("data")
    elif a == "h" and splits(n, m):
      out.append("model")
    else:
      out.append(None)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def fields_spec(state, layouts: dict, d: int, m: int):
  """A spec pytree shaped like the dataclass `state`: field f gets
  layouts.get(f, ("b",)) (static fields kept)."""
  return state.replace(**{
      f.name: leaf_spec(getattr(state, f.name),
                        layouts.get(f.name, ("b",)), d, m)
      for f in dataclasses.fields(state) if not f.metadata.get("static")})


def replay_layouts(heads: bool, groups: bool) -> dict:
  """Field layouts of a Mamba-2 `ReplayState` (heads / groups split)."""
  h, g = ("h" if heads else None), ("h" if groups else None)
  return dict(checkpoint=("b", h), x_buf=("b", None, h),
              b_buf=("b", None, g), dt_buf=("b", None, h),
              read_copy=("b", h), read_scale=("b", h))


def gdn_replay_layouts(heads: bool) -> dict:
  """Field layouts of a `GDNReplayState` or `KDAReplayState` (value and key
  heads split; g_buf is GDN's log-decay ring, g_sum KDA's decay sum)."""
  h = "h" if heads else None
  return dict(checkpoint=("b", h), d_buf=("b", None, h), k_buf=("b", None, h),
              g_buf=("b", None, h), g_sum=("b", h), read_copy=("b", h),
              read_scale=("b", h))


# ------------------------------------------------------------- op rules
# A rule maps (args, d, m) to ({arg name: spec tree}, out) or ({...}, out,
# local): out maps the op's output (abstract shapes) to its spec tree;
# local(args) rewrites the arguments on each shard (inside the shard_map).
# Array arguments a rule does not name are replicated; other arguments are
# passed as they are.
def _batch(x) -> int:
  return np.shape(x)[0]


def _sr(args) -> bool:
  """Stochastic rounding: its bits are keyed by an element's index in the
  whole row, which a shard holding some of the heads cannot form, so such
  an op keeps its heads whole (split by rows only)."""
  return bool(getattr(args.get("policy"), "stochastic_rounding", False))


def _rows_only(*names):
  """Every named argument and every output split by rows only."""
  def rule(args, d, m):
    rows = lambda t: jax.tree.map(lambda x: leaf_spec(x, ("b",), d, m), t)
    return {k: rows(args[k]) for k in names if args.get(k) is not None}, rows
  return rule


def _mamba(state_arg: str, window: bool):
  """selective_state_update / replay_state_update (window=False),
  baseline_verify / replay_verify (window=True)."""
  t = (None,) if window else ()

  def rule(args, d, m):
    G = np.shape(args["B"])[-2]
    heads = mamba_heads(np.shape(args["x"])[-2], G, m) and not _sr(args)
    h, g = ("h" if heads else None), ("h" if heads and G > 1 else None)
    tok = ("b",) + t + (h,)
    specs = {k: leaf_spec(args[k], tok, d, m) for k in ("x", "dt", "z")}
    specs.update({k: leaf_spec(args[k], ("b",) + t + (g,), d, m)
                  for k in ("B", "C")})
    specs.update({k: leaf_spec(args[k], (h,), d, m)
                  for k in ("A", "D", "dt_bias")})
    lay = replay_layouts(heads, g is not None)
    state = args[state_arg]
    specs[state_arg] = (fields_spec(state, lay, d, m)
                        if state_arg == "rstate"
                        else leaf_spec(state, ("b", h), d, m))

    def out(shapes):
      y, second = shapes
      if state_arg == "rstate":
        second = fields_spec(second, lay, d, m)
      else:  # the new state [b, H, P, N] or the snapshots [b, T, H, P, N]
        second = leaf_spec(second, ("b",) + t + (h,), d, m)
      return leaf_spec(y, tok, d, m), second
    return specs, out
  return rule


def _gdn(state_arg: str | None, window: bool):
  """gdn_step / gdn_replay_step / the KDA steps (window=False),
  gdn_baseline_verify / gdn_replay_verify / the KDA verifies / the chunked
  prefills (window=True; state_arg None: the prefill's initial_state).
  KDA's g [.., HV, K] is laid out as GDN's [.., HV]; kda_replay_verify's
  third output, its `KDAWindow`, as the window's tokens."""
  t = (None,) if window else ()

  def rule(args, d, m):
    heads = (gdn_heads(np.shape(args["v"])[-2], np.shape(args["q"])[-2], m)
             and not _sr(args))
    h = "h" if heads else None
    tok = ("b",) + t + (h,)
    specs = {k: leaf_spec(args[k], tok, d, m)
             for k in ("q", "k", "v", "g", "beta")}
    lay = gdn_replay_layouts(heads)
    if state_arg == "rstate":
      specs["rstate"] = fields_spec(args["rstate"], lay, d, m)
    else:
      name = state_arg or "initial_state"
      specs[name] = leaf_spec(args.get(name), ("b", h), d, m)
      specs["valid"] = leaf_spec(args.get("valid"), ("b",), d, m)

    def out(shapes):
      o, second, *third = shapes
      if state_arg == "rstate":
        second = fields_spec(second, lay, d, m)
      elif state_arg is None or not window:  # final / new state
        second = leaf_spec(second, ("b", h), d, m)
      else:  # the baseline verify's snapshots [b, T, HV, K, V]
        second = leaf_spec(second, tok, d, m)
      third = [jax.tree.map(lambda x: leaf_spec(x, tok[:x.ndim], d, m), w)
               for w in third]  # a KDAWindow: [b, T, HV, ..] and [b]
      return (leaf_spec(o, tok, d, m), second, *third)
    return specs, out
  return rule


def _gated_norm(args, d, m):
  """Mamba-2's gated norm: the channel axis split over "model" when its
  groups do (each shard then holds whole groups: its heads' own). The gate
  splits with it when it is a [.., dim] array of its own (the shard-major
  layout's joined z); inside the replicated in_proj output (z_offset) each
  shard cuts its columns. Else rows only (the channels gathered)."""
  y, z = args["y"], args["z"]
  dim = np.shape(y)[-1]
  if not splits(dim // args["group_size"], m):
    return _rows_only("y", "z")(args, d, m)
  lay = ("b",) + (None,) * (np.ndim(y) - 2) + ("h",)
  specs = dict(y=leaf_spec(y, lay, d, m),
               weight=leaf_spec(args["weight"], ("h",), d, m))
  out = lambda o: leaf_spec(o, lay, d, m)
  if np.shape(z)[-1] == dim and args["z_offset"] == 0:
    return dict(specs, z=leaf_spec(z, lay, d, m)), out
  width = dim // m

  def local(a):
    start = a["z_offset"] + jax.lax.axis_index("model") * width
    z = jax.lax.dynamic_slice_in_dim(a["z"], start, width, axis=-1)
    return dict(a, z=z, z_offset=0)
  return dict(specs, z=leaf_spec(z, ("b",), d, m)), out, local


def _conv(args, d, m):
  """The conv ops: channels over "model" too when the op runs on a whole
  conv input (one piece, x_offset 0: the shard-major Mamba layout's joined
  xBC, each shard's own channels) that m divides; else rows only (the
  input read inside a replicated in_proj output)."""
  chans = np.shape(args["conv_state"])[-1]
  if not (args.get("split") is None and args.get("x_offset", 0) == 0
          and np.shape(args["x"])[-1] == chans and splits(chans, m)):
    return _rows_only("x", "conv_state", "start")(args, d, m)
  x_lay = ("b",) + (None,) * (np.ndim(args["x"]) - 2) + ("h",)
  specs = dict(x=leaf_spec(args["x"], x_lay, d, m),
               conv_state=leaf_spec(args["conv_state"], ("b", None, "h"), d,
                                    m),
               start=leaf_spec(args["start"], ("b",), d, m),
               weight=leaf_spec(args["weight"], ("h",), d, m),
               bias=leaf_spec(args.get("bias"), ("h",), d, m))

  def out(shapes):
    if len(shapes) == 1:  # the window: (pieces,)
      return (leaf_spec(shapes[0], x_lay, d, m),)
    (piece,), _, _ = shapes
    return ((leaf_spec(piece, x_lay, d, m),), specs["conv_state"],
            specs["start"])
  return specs, out


def _attention(args, d, m):
  heads = splits(np.shape(args["k_cache"])[1], m)
  h = "h" if heads else None
  q = ("b", h) if np.ndim(args["q"]) == 3 else ("b", None, h)
  specs = dict(q=leaf_spec(args["q"], q, d, m),
               k_cache=leaf_spec(args["k_cache"], ("b", h), d, m),
               v_cache=leaf_spec(args["v_cache"], ("b", h), d, m),
               lengths=leaf_spec(args["lengths"], ("b",), d, m))
  return specs, lambda o: leaf_spec(o, q, d, m)


RULES = {
    "selective_state_update": _mamba("ssm_state", False),
    "replay_state_update": _mamba("rstate", False),
    "baseline_verify": _mamba("ssm_state", True),
    "replay_verify": _mamba("rstate", True),
    "decode_attention": _attention,
    "causal_conv1d_step": _conv,
    "causal_conv1d_window": _conv,
    "gated_rms_norm": _gated_norm,
    "add_rms_norm": _rows_only("x", "y"),
    "gdn_step": _gdn("state", False),
    "gdn_replay_step": _gdn("rstate", False),
    "gdn_baseline_verify": _gdn("state", True),
    "gdn_replay_verify": _gdn("rstate", True),
    "gdn_chunked_prefill": _gdn(None, True),
    "kda_step": _gdn("state", False),
    "kda_replay_step": _gdn("rstate", False),
    "kda_baseline_verify": _gdn("state", True),
    "kda_replay_verify": _gdn("rstate", True),
    "kda_chunked_prefill": _gdn(None, True),
}


# ------------------------------------------------------------- running
def active_mesh():
  """The context mesh (`jax.set_mesh`) when ops run per shard on it: more
  than one device, axes "data" and "model" both automatic (not already
  inside a shard_map over them); else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or not set(AXES) <= set(mesh.axis_names):
    return None
  manual = getattr(mesh, "manual_axes", ())
  if any(a in manual for a in AXES):
    return None
  return mesh


def _is_array(x) -> bool:
  """An array, or a pytree (a state) whose leaves all are."""
  leaves = jax.tree.leaves(x)
  return bool(leaves) and all(isinstance(v, (jax.Array, np.ndarray))
                              for v in leaves)


def call(op: str, fn, args: dict):
  """fn(**args), per shard under jax.shard_map when a mesh is active (see
  the module docstring) and `op` has a rule; else as is."""
  mesh = active_mesh()
  rule = RULES.get(op)
  if mesh is None or rule is None:
    return fn(**args)
  d, m = int(mesh.shape["data"]), int(mesh.shape["model"])
  specs, out, *local = rule(args, d, m)
  local = local[0] if local else (lambda a: a)
  arrays = {k: v for k, v in args.items() if _is_array(v)}
  static = {k: v for k, v in args.items() if k not in arrays}
  in_specs = {k: specs.get(k) or P() for k in arrays}
  out_specs = out(jax.eval_shape(lambda a: fn(**a, **static), arrays))
  body = lambda a: fn(**local(dict(a, **static)))
  return jax.shard_map(body, mesh=mesh, in_specs=(in_specs,),
                       out_specs=out_specs, check_vma=False)(arrays)
