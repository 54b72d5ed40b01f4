"""Bad inputs raise ValueError/TypeError naming the argument and what was
expected; every public entry point, every argument."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import testing

B_, H, P, N, G, L, T, DIM, K = 2, 4, 4, 8, 2, 4, 9, 6, 4
LAYOUT_STEP = r"\[batch, nheads, headdim\]"
FLOAT_MSG = r"must have a floating dtype"
STATE_DTYPES_MSG = r"\(float32, bfloat16, float16\)"


@pytest.fixture(scope="module")
def v():
  """Valid arguments of every op (fresh random values)."""
  k = jax.random.split(jax.random.PRNGKey(11), 8)
  params = testing.random_params(k[0], H)
  step = testing.random_step_inputs(k[1], B_, H, P, N, G)
  seq = testing.random_step_inputs(k[2], B_, H, P, N, G, seqlen=T)
  rstate, full = testing.random_replay_state(k[3], B_, H, P, N, G, L, [1, 3],
                                             params["A"])
  conv_x = jax.random.normal(k[4], (B_, T, DIM))
  conv_w = jax.random.normal(k[5], (DIM, K))
  conv_b = jax.random.normal(k[6], (DIM,))
  conv_st = jax.random.normal(k[7], (B_, K - 1, DIM))
  return types.SimpleNamespace(params=params, step=step, seq=seq,
                               rstate=rstate, full=full, conv_x=conv_x,
                               conv_w=conv_w, conv_b=conv_b, conv_st=conv_st)


def _f64(a):
  return np.asarray(a, np.float64)


def _i32(a):
  return np.asarray(a).astype(np.int32)


def _step_kwargs(v):
  return dict(x=v.step["x"], dt=v.step["dt"], A=v.params["A"],
              B=v.step["B"], C=v.step["C"], D=v.params["D"], z=v.step["z"],
              dt_bias=v.params["dt_bias"], dt_softplus=True)


def _shape(name, layout, expected, got):
  return (rf"{re.escape(name)} must have shape {re.escape(layout)} = "
          rf"{re.escape(str(expected))}, got {re.escape(str(got))}")


def _ndim(name, nd, layout):
  return rf"{re.escape(name)} must be {nd}-D {re.escape(layout)}"


def _groups(ng, where):
  return (rf"nheads \({H}\) must be divisible by ngroups \({ng}, read from "
          rf"{re.escape(where)}\)")


# Step arguments shared by selective_state_update and replay_state_update:
# (id, argument, bad value builder, exception, message regex).
STEP_ARG_CASES = [
    ("x-shape", "x", lambda v: v.step["x"][..., :-1], ValueError,
     _shape("x", "[batch, nheads, headdim]", (B_, H, P), (B_, H, P - 1))),
    ("x-int", "x", lambda v: _i32(v.step["x"]), TypeError, "x " + FLOAT_MSG),
    ("x-list", "x", lambda v: [[1.0]], TypeError, r"x must be an array"),
    ("dt-shape", "dt", lambda v: v.step["dt"][:1], ValueError,
     _shape("dt", "[batch, nheads]", (B_, H), (1, H))),
    ("dt-int", "dt", lambda v: _i32(v.step["dt"]), TypeError,
     "dt " + FLOAT_MSG),
    ("A-shape", "A", lambda v: v.params["A"][:-1], ValueError,
     _shape("A", "[nheads]", (H,), (H - 1,))),
    ("A-int", "A", lambda v: _i32(v.params["A"]), TypeError,
     "A " + FLOAT_MSG),
    ("B-ndim", "B", lambda v: v.step["B"][:, 0], ValueError,
     _ndim("B", 3, "[batch, ngroups, dstate]")),
    ("B-dstate", "B", lambda v: v.step["B"][..., :-1], ValueError,
     _shape("B", "[batch, ngroups, dstate]", (B_, G, N), (B_, G, N - 1))),
    ("B-int", "B", lambda v: _i32(v.step["B"]), TypeError, "B " + FLOAT_MSG),
    ("C-groups", "C", lambda v: v.step["C"][:, :1], ValueError,
     _shape("C", "[batch, ngroups, dstate]", (B_, G, N), (B_, 1, N))),
    ("C-int", "C", lambda v: _i32(v.step["C"]), TypeError, "C " + FLOAT_MSG),
    ("D-shape", "D", lambda v: v.params["D"][:2], ValueError,
     _shape("D", "[nheads]", (H,), (2,))),
    ("D-int", "D", lambda v: _i32(v.params["D"]), TypeError,
     "D " + FLOAT_MSG),
    ("z-shape", "z", lambda v: v.step["z"][:, :1], ValueError,
     _shape("z", "[batch, nheads, headdim]", (B_, H, P), (B_, 1, P))),
    ("z-int", "z", lambda v: _i32(v.step["z"]), TypeError, "z " + FLOAT_MSG),
    ("dt_bias-shape", "dt_bias", lambda v: v.params["dt_bias"][None],
     ValueError, _shape("dt_bias", "[nheads]", (H,), (1, H))),
    ("dt_bias-int", "dt_bias", lambda v: _i32(v.params["dt_bias"]),
     TypeError, "dt_bias " + FLOAT_MSG),
]


def _ids(cases):
  return [c[0] for c in cases]


# ------------------------------------------------------ selective_state_update
SSU_CASES = STEP_ARG_CASES + [
    ("ssm_state-ndim", "ssm_state", lambda v: v.full[0], ValueError,
     _ndim("ssm_state", 4, "[batch, nheads, headdim, dstate]")),
    ("ssm_state-int", "ssm_state", lambda v: _i32(v.full), TypeError,
     "ssm_state " + FLOAT_MSG + r" in " + STATE_DTYPES_MSG + ", got int32"),
    ("ssm_state-f64", "ssm_state", lambda v: _f64(v.full), TypeError,
     "ssm_state " + FLOAT_MSG + r" in " + STATE_DTYPES_MSG +
     ", got float64"),
    ("ssm_state-batch", "ssm_state", lambda v: v.full[:1], ValueError,
     _shape("x", "[batch, nheads, headdim]", (1, H, P), (B_, H, P))),
    ("B-groups-not-dividing", "B",
     lambda v: jnp.concatenate([v.step["B"], v.step["B"][:, :1]], 1),
     ValueError, _groups(3, "B")),
]


@pytest.mark.parametrize("case", SSU_CASES, ids=_ids(SSU_CASES))
def test_selective_state_update_rejects(v, case):
  _, arg, bad, exc, msg = case
  kw = dict(_step_kwargs(v), ssm_state=v.full)
  kw[arg] = bad(v)
  with pytest.raises(exc, match=msg):
    rs.selective_state_update(**kw)


# -------------------------------------------------------- replay_state_update
def _rs(field, fn):
  """Builds a bad rstate: rstate with `field` replaced by fn(old value)."""
  return lambda v: v.rstate.replace(**{field: fn(getattr(v.rstate, field))})


RSTATE_CASES = [
    ("not-a-ReplayState", lambda v: v.full, TypeError,
     r"rstate must be a ReplayState, got "),
    ("checkpoint-ndim", _rs("checkpoint", lambda a: a[0]), ValueError,
     _ndim("rstate.checkpoint", 4, "[batch, nheads, headdim, dstate]")),
    ("checkpoint-int", _rs("checkpoint", _i32), TypeError,
     r"rstate\.checkpoint " + FLOAT_MSG + " in " + STATE_DTYPES_MSG +
     ", got int32"),
    ("checkpoint-f64", _rs("checkpoint", _f64), TypeError,
     r"rstate\.checkpoint " + FLOAT_MSG + " in " + STATE_DTYPES_MSG +
     ", got float64"),
    ("x_buf-headdim", _rs("x_buf", lambda a: a[..., :-1]), ValueError,
     _shape("rstate.x_buf", "[batch, L, nheads, headdim]", (B_, L, H, P),
            (B_, L, H, P - 1))),
    ("x_buf-ndim", _rs("x_buf", lambda a: a[0]), ValueError,
     _ndim("rstate.x_buf", 4, "[batch, L, nheads, headdim]")),
    ("x_buf-int", _rs("x_buf", _i32), TypeError,
     r"rstate\.x_buf " + FLOAT_MSG),
    ("x_buf-f64", _rs("x_buf", _f64), TypeError,
     r"rstate\.x_buf " + FLOAT_MSG + " in " + STATE_DTYPES_MSG +
     ", got float64"),
    ("buffer_len-0", lambda v: v.rstate.replace(
        x_buf=v.rstate.x_buf[:, :0], b_buf=v.rstate.b_buf[:, :0],
        dt_buf=v.rstate.dt_buf[:, :0]), ValueError,
     r"rstate\.x_buf: buffer_len must be >= 1, got 0"),
    ("b_buf-L", _rs("b_buf", lambda a: a[:, :-1]), ValueError,
     _shape("rstate.b_buf", "[batch, L, ngroups, dstate]", (B_, L, G, N),
            (B_, L - 1, G, N))),
    ("b_buf-dstate", _rs("b_buf", lambda a: a[..., :-1]), ValueError,
     _shape("rstate.b_buf", "[batch, L, ngroups, dstate]", (B_, L, G, N),
            (B_, L, G, N - 1))),
    ("b_buf-groups-not-dividing",
     _rs("b_buf", lambda a: jnp.concatenate([a, a[:, :, :1]], 2)),
     ValueError, _groups(3, "rstate.b_buf")),
    ("b_buf-int", _rs("b_buf", _i32), TypeError,
     r"rstate\.b_buf " + FLOAT_MSG),
    ("dt_buf-bf16", _rs("dt_buf", lambda a: a.astype(jnp.bfloat16)),
     TypeError, r"rstate\.dt_buf " + FLOAT_MSG +
     r" in \(float32\), got bfloat16"),
    ("dt_buf-shape", _rs("dt_buf", lambda a: a[..., :-1]), ValueError,
     _shape("rstate.dt_buf", "[batch, L, nheads]", (B_, L, H),
            (B_, L, H - 1))),
    ("count-float", _rs("count", lambda a: a.astype(jnp.float32)),
     TypeError, r"rstate\.count must have an integer dtype \(int32\), got "
     r"float32"),
    ("count-int16", _rs("count", lambda a: a.astype(jnp.int16)), TypeError,
     r"rstate\.count must be int32, got int16"),
    ("count-int64", _rs("count", lambda a: np.asarray(a, np.int64)),
     TypeError, r"rstate\.count must be int32, got int64"),
    ("count-shape", _rs("count", lambda a: jnp.concatenate([a, a])),
     ValueError, _shape("rstate.count", "[batch]", (B_,), (2 * B_,))),
    ("count-eq-L", _rs("count", lambda a: a.at[1].set(L)), ValueError,
     rf"rstate\.count must lie in \[0, buffer_len\) = \[0, {L}\) for every "
     rf"row; rows \[1\] hold \[{L}\]"),
    ("count-negative", _rs("count", lambda a: a.at[0].set(-1)), ValueError,
     rf"rstate\.count must lie in \[0, buffer_len\) = \[0, {L}\) for every "
     r"row; rows \[0\] hold \[-1\]"),
]

REPLAY_STEP_CASES = STEP_ARG_CASES + [
    ("B-groups-vs-rstate", "B", lambda v: v.step["B"][:, :1], ValueError,
     _shape("B", "[batch, ngroups, dstate]", (B_, G, N), (B_, 1, N))),
]


@pytest.mark.parametrize("case", RSTATE_CASES, ids=_ids(RSTATE_CASES))
def test_replay_state_update_rejects_bad_rstate(v, case):
  _, bad, exc, msg = case
  with pytest.raises(exc, match=msg):
    rs.replay_state_update(bad(v), **_step_kwargs(v))


@pytest.mark.parametrize("case", REPLAY_STEP_CASES,
                         ids=_ids(REPLAY_STEP_CASES))
def test_replay_state_update_rejects_bad_step_input(v, case):
  _, arg, bad, exc, msg = case
  kw = _step_kwargs(v)
  kw[arg] = bad(v)
  with pytest.raises(exc, match=msg):
    rs.replay_state_update(v.rstate, **kw)


@pytest.mark.parametrize("op", ["selective_state_update",
                                "replay_state_update"])
def test_dispatcher_rejects_unknown_implementation_and_stray_config(v, op):
  first = v.full if op == "selective_state_update" else v.rstate
  fn = getattr(rs, op)
  with pytest.raises(ValueError, match=r"implementation must be None or one "
                     r"of \(.*'reference'.*\), got 'nope'"):
    fn(first, **_step_kwargs(v), implementation="nope")
  with pytest.raises(ValueError, match=r"config can only be given with a "
                     r"named implementation"):
    fn(first, **_step_kwargs(v), config={"block": 1})


# ---------------------------------------------------------------- materialize
MATERIALIZE_CASES = [
    ("not-a-ReplayState", lambda v: dict(rstate=v.full), TypeError,
     r"rstate must be a ReplayState"),
    ("A-shape", lambda v: dict(A=v.params["A"][:1]), ValueError,
     _shape("A", "[nheads]", (H,), (1,))),
    ("A-int", lambda v: dict(A=_i32(v.params["A"])), TypeError,
     "A " + FLOAT_MSG),
    ("count-out-of-range",
     lambda v: dict(rstate=v.rstate.replace(count=v.rstate.count.at[0].set(
         L + 2))), ValueError, r"rstate\.count must lie in \[0, buffer_len\)"),
    ("dt_buf-f16", lambda v: dict(rstate=v.rstate.replace(
        dt_buf=v.rstate.dt_buf.astype(jnp.float16))), TypeError,
     r"rstate\.dt_buf " + FLOAT_MSG),
    ("dtype-int", lambda v: dict(dtype=jnp.int32), TypeError,
     r"dtype must be one of " + STATE_DTYPES_MSG + ", got int32"),
]


@pytest.mark.parametrize("case", MATERIALIZE_CASES,
                         ids=_ids(MATERIALIZE_CASES))
def test_materialize_rejects(v, case):
  _, change, exc, msg = case
  kw = dict(rstate=v.rstate, A=v.params["A"])
  kw.update(change(v))
  with pytest.raises(exc, match=msg):
    rs.materialize(**kw)


# -------------------------------------------------------- ReplayState ctors
CREATE_OK = dict(batch=B_, nheads=H, headdim=P, dstate=N, ngroups=G,
                 buffer_len=L)
CREATE_CASES = [
    ("batch-0", dict(batch=0), ValueError,
     r"batch must be a positive int, got 0"),
    ("nheads-str", dict(nheads="4"), ValueError,
     r"nheads must be a positive int, got '4'"),
    ("headdim-negative", dict(headdim=-1), ValueError,
     r"headdim must be a positive int, got -1"),
    ("dstate-0", dict(dstate=0), ValueError,
     r"dstate must be a positive int, got 0"),
    ("ngroups-0", dict(ngroups=0), ValueError,
     r"ngroups must be a positive int, got 0"),
    ("ngroups-not-dividing", dict(ngroups=3), ValueError,
     _groups(3, "ngroups")),
    ("buffer_len-0", dict(buffer_len=0), ValueError,
     r"buffer_len must be a positive int, got 0"),
    ("buffer_len-float", dict(buffer_len=2.0), ValueError,
     r"buffer_len must be a positive int, got 2\.0"),
    ("checkpoint_dtype-int", dict(checkpoint_dtype=jnp.int32), TypeError,
     r"checkpoint_dtype must be one of " + STATE_DTYPES_MSG + ", got int32"),
    ("checkpoint_dtype-f64", dict(checkpoint_dtype=np.float64), TypeError,
     r"checkpoint_dtype must be one of " + STATE_DTYPES_MSG +
     ", got float64"),
    ("buffer_dtype-int", dict(buffer_dtype=jnp.int8), TypeError,
     r"buffer_dtype must be one of " + STATE_DTYPES_MSG + ", got int8"),
    ("buffer_dtype-f64", dict(buffer_dtype=np.float64), TypeError,
     r"buffer_dtype must be one of " + STATE_DTYPES_MSG + ", got float64"),
]


@pytest.mark.parametrize("case", CREATE_CASES, ids=_ids(CREATE_CASES))
def test_replay_state_create_rejects(case):
  _, change, exc, msg = case
  with pytest.raises(exc, match=msg):
    rs.ReplayState.create(**{**CREATE_OK, **change})


FROM_SSM_CASES = [
    ("ssm_state-list", dict(ssm_state=[[1.0]]), TypeError,
     r"ssm_state must be an array"),
    ("ssm_state-ndim", "ndim", ValueError,
     _ndim("ssm_state", 4, "[batch, nheads, headdim, dstate]")),
    ("ssm_state-int", "int", TypeError, r"ssm_state " + FLOAT_MSG),
    ("ssm_state-f64", "f64", TypeError,
     r"ssm_state " + FLOAT_MSG + " in " + STATE_DTYPES_MSG +
     ", got float64"),
    ("ngroups-not-dividing", dict(ngroups=3), ValueError,
     _groups(3, "ngroups")),
    ("ngroups-0", dict(ngroups=0), ValueError,
     r"ngroups must be a positive int, got 0"),
    ("ngroups-str", dict(ngroups="2"), ValueError,
     r"ngroups must be a positive int, got '2'"),
    ("buffer_len-0", dict(buffer_len=0), ValueError,
     r"buffer_len must be a positive int, got 0"),
    ("buffer_dtype-int", dict(buffer_dtype=jnp.int32), TypeError,
     r"buffer_dtype must be one of " + STATE_DTYPES_MSG + ", got int32"),
    ("checkpoint_dtype-int", dict(checkpoint_dtype=jnp.int8), TypeError,
     r"checkpoint_dtype must be one of " + STATE_DTYPES_MSG + ", got int8"),
]


@pytest.mark.parametrize("case", FROM_SSM_CASES, ids=_ids(FROM_SSM_CASES))
def test_replay_state_from_ssm_state_rejects(v, case):
  _, change, exc, msg = case
  kw = dict(ssm_state=v.full, ngroups=G, buffer_len=L)
  if change == "ndim":
    kw["ssm_state"] = v.full[0]
  elif change == "int":
    kw["ssm_state"] = _i32(v.full)
  elif change == "f64":
    kw["ssm_state"] = _f64(v.full)
  else:
    kw.update(change)
  with pytest.raises(exc, match=msg):
    rs.ReplayState.from_ssm_state(**kw)


def test_from_ssm_state_accepts_f64_with_explicit_checkpoint_dtype(v):
  st = rs.ReplayState.from_ssm_state(_f64(v.full), G, L,
                                     checkpoint_dtype=jnp.float32)
  assert st.checkpoint.dtype == jnp.float32


@pytest.mark.parametrize("case", RSTATE_CASES[1:], ids=_ids(RSTATE_CASES[1:]))
def test_replay_state_validate_rejects(v, case):
  _, bad, exc, msg = case
  with pytest.raises(exc, match=msg):
    bad(v).validate()


# ---------------------------------------------------------- ssd_chunked_scan
def _seq_kwargs(v):
  return dict(x=v.seq["x"], dt=v.seq["dt"], A=v.params["A"], B=v.seq["B"],
              C=v.seq["C"], chunk_size=4, D=v.params["D"], z=v.seq["z"],
              dt_bias=v.params["dt_bias"], dt_softplus=True,
              initial_state=v.full)


SEQ4 = "[batch, seqlen, ngroups, dstate]"
SSD_CASES = [
    ("chunk_size-0", "chunk_size", lambda v: 0, ValueError,
     r"chunk_size must be a positive int, got 0"),
    ("chunk_size-float", "chunk_size", lambda v: 2.5, ValueError,
     r"chunk_size must be a positive int, got 2\.5"),
    ("x-ndim", "x", lambda v: v.seq["x"][0], ValueError,
     _ndim("x", 4, "[batch, seqlen, nheads, headdim]")),
    ("x-int", "x", lambda v: _i32(v.seq["x"]), TypeError, "x " + FLOAT_MSG),
    ("dt-shape", "dt", lambda v: v.seq["dt"][:, 1:], ValueError,
     _shape("dt", "[batch, seqlen, nheads]", (B_, T, H), (B_, T - 1, H))),
    ("dt-int", "dt", lambda v: _i32(v.seq["dt"]), TypeError,
     "dt " + FLOAT_MSG),
    ("A-shape", "A", lambda v: v.params["A"][:3], ValueError,
     _shape("A", "[nheads]", (H,), (3,))),
    ("A-int", "A", lambda v: _i32(v.params["A"]), TypeError,
     "A " + FLOAT_MSG),
    ("B-ndim", "B", lambda v: v.seq["B"][:, 0], ValueError,
     _ndim("B", 4, SEQ4)),
    ("B-seqlen", "B", lambda v: v.seq["B"][:, 1:], ValueError,
     _shape("B", SEQ4, (B_, T, G, N), (B_, T - 1, G, N))),
    ("B-groups-not-dividing", "B",
     lambda v: jnp.concatenate([v.seq["B"], v.seq["B"][:, :, :1]], 2),
     ValueError, _groups(3, "B")),
    ("B-int", "B", lambda v: _i32(v.seq["B"]), TypeError, "B " + FLOAT_MSG),
    ("C-groups", "C", lambda v: v.seq["C"][:, :, :1], ValueError,
     _shape("C", SEQ4, (B_, T, G, N), (B_, T, 1, N))),
    ("C-int", "C", lambda v: _i32(v.seq["C"]), TypeError, "C " + FLOAT_MSG),
    ("D-shape", "D", lambda v: v.params["D"][:1], ValueError,
     _shape("D", "[nheads]", (H,), (1,))),
    ("D-int", "D", lambda v: _i32(v.params["D"]), TypeError,
     "D " + FLOAT_MSG),
    ("z-shape", "z", lambda v: v.seq["z"][:, :-1], ValueError,
     _shape("z", "[batch, seqlen, nheads, headdim]", (B_, T, H, P),
            (B_, T - 1, H, P))),
    ("z-int", "z", lambda v: _i32(v.seq["z"]), TypeError, "z " + FLOAT_MSG),
    ("dt_bias-shape", "dt_bias", lambda v: v.params["dt_bias"][:2],
     ValueError, _shape("dt_bias", "[nheads]", (H,), (2,))),
    ("dt_bias-int", "dt_bias", lambda v: _i32(v.params["dt_bias"]),
     TypeError, "dt_bias " + FLOAT_MSG),
    ("initial_state-shape", "initial_state", lambda v: v.full[..., :-1],
     ValueError, _shape("initial_state", "[batch, nheads, headdim, dstate]",
                        (B_, H, P, N), (B_, H, P, N - 1))),
    ("initial_state-int", "initial_state", lambda v: _i32(v.full),
     TypeError, "initial_state " + FLOAT_MSG),
]


@pytest.mark.parametrize("case", SSD_CASES, ids=_ids(SSD_CASES))
def test_ssd_chunked_scan_rejects(v, case):
  _, arg, bad, exc, msg = case
  kw = _seq_kwargs(v)
  kw[arg] = bad(v)
  with pytest.raises(exc, match=msg):
    rs.ssd_chunked_scan(**kw)


# ---------------------------------------------------------------------- conv
CONV_COMMON = [
    ("weight-ndim", "weight", lambda v: v.conv_w[:, 0], ValueError,
     _ndim("weight", 2, "[dim, kernel_size]")),
    ("weight-dim", "weight", lambda v: v.conv_w[:-1], ValueError,
     rf"weight must have shape \[dim, kernel_size\] with dim = {DIM}, got "
     rf"\({DIM - 1}, {K}\)"),
    ("weight-kernel-0", "weight", lambda v: v.conv_w[:, :0], ValueError,
     r"weight must have shape \[dim, kernel_size\] with kernel_size >= 1"),
    ("weight-int", "weight", lambda v: _i32(v.conv_w), TypeError,
     "weight " + FLOAT_MSG),
    ("bias-shape", "bias", lambda v: v.conv_b[:-1], ValueError,
     _shape("bias", "[dim]", (DIM,), (DIM - 1,))),
    ("bias-int", "bias", lambda v: _i32(v.conv_b), TypeError,
     "bias " + FLOAT_MSG),
    ("activation", "activation", lambda v: "relu", ValueError,
     r"activation must be one of \(None, 'silu', 'swish'\), got 'relu'"),
]

CONV_CASES = CONV_COMMON + [
    ("x-ndim", "x", lambda v: v.conv_x[:, 0], ValueError,
     _ndim("x", 3, "[batch, seqlen, dim]")),
    ("x-int", "x", lambda v: _i32(v.conv_x), TypeError, "x " + FLOAT_MSG),
    ("initial_state-shape", "initial_state", lambda v: v.conv_st[:, 1:],
     ValueError, _shape("initial_state", "[batch, kernel_size - 1, dim]",
                        (B_, K - 1, DIM), (B_, K - 2, DIM))),
    ("initial_state-int", "initial_state", lambda v: _i32(v.conv_st),
     TypeError, "initial_state " + FLOAT_MSG),
]

CONV_UPDATE_CASES = CONV_COMMON + [
    ("x-ndim", "x", lambda v: v.conv_x, ValueError,
     _ndim("x", 2, "[batch, dim]")),
    ("x-int", "x", lambda v: _i32(v.conv_x[:, 0]), TypeError,
     "x " + FLOAT_MSG),
    ("conv_state-shape", "conv_state", lambda v: v.conv_st[:1], ValueError,
     _shape("conv_state", "[batch, kernel_size - 1, dim]", (B_, K - 1, DIM),
            (1, K - 1, DIM))),
    ("conv_state-int", "conv_state", lambda v: _i32(v.conv_st), TypeError,
     "conv_state " + FLOAT_MSG),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=_ids(CONV_CASES))
def test_causal_conv1d_rejects(v, case):
  _, arg, bad, exc, msg = case
  kw = dict(x=v.conv_x, weight=v.conv_w, bias=v.conv_b,
            initial_state=v.conv_st, activation="silu")
  kw[arg] = bad(v)
  with pytest.raises(exc, match=msg):
    rs.causal_conv1d(**kw)


@pytest.mark.parametrize("case", CONV_UPDATE_CASES,
                         ids=_ids(CONV_UPDATE_CASES))
def test_causal_conv1d_update_rejects(v, case):
  _, arg, bad, exc, msg = case
  kw = dict(x=v.conv_x[:, 0], conv_state=v.conv_st, weight=v.conv_w,
            bias=v.conv_b, activation="silu")
  kw[arg] = bad(v)
  with pytest.raises(exc, match=msg):
    rs.causal_conv1d_update(**kw)


def test_valid_arguments_are_accepted(v):
  """The unmodified arguments of every case above do run."""
  rs.selective_state_update(v.full, **_step_kwargs(v))
  rs.replay_state_update(v.rstate, **_step_kwargs(v))
  rs.materialize(v.rstate, v.params["A"], dtype=jnp.bfloat16)
  rs.ReplayState.create(**CREATE_OK)
  rs.ReplayState.from_ssm_state(v.full, G, L)
  kw = _seq_kwargs(v)
  rs.ssd_chunked_scan(**kw)
  rs.causal_conv1d(v.conv_x, v.conv_w, v.conv_b, v.conv_st)
  rs.causal_conv1d_update(v.conv_x[:, 0], v.conv_st, v.conv_w, v.conv_b)
