"""The replay step's plan (`replay.plan_replay_step`): the defaults it picks
for each state and device, that each default is filled on its own (setting
a field to its planned value changes nothing, setting another field leaves
the other defaults as they are), and the register-cap hook."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import replay as rk
from pallas_kernels import triton_utils as tu
from replayssm_jax import precision as P
from replayssm_jax.state import ReplayState

TF32X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
F16_INT8 = P.PrecisionPolicy(checkpoint_dtype="float16", read_dtype="int8")


def _state(batch, policy=None, ckpt=None, h=128, p=64, n=128, g=8, L=16,
           b_dtype=jnp.bfloat16):
  """A ReplayState of shapes only (the plan reads no values) with the
  fields of `policy` (None: a plain state of dtype ckpt, default f32)."""
  sds = jax.ShapeDtypeStruct
  ckpt = jnp.dtype(policy.checkpoint_dtype if policy else ckpt or "float32")
  fields = dict(checkpoint=sds((batch, h, p, n), ckpt),
                x_buf=sds((batch, L, h, p), jnp.bfloat16),
                b_buf=sds((batch, L, g, n), b_dtype),
                dt_buf=sds((batch, L, h), jnp.float32),
                count=sds((batch,), jnp.int32))
  if policy is not None and policy.read_dtype is not None:
    copy = jnp.dtype(policy.read_dtype)
    fields["read_copy"] = sds((batch, h, p, n), copy)
    if copy.itemsize == 1:
      fields["read_scale"] = sds((batch, h, p), jnp.float32)
  if policy is not None and policy.stochastic_rounding:
    fields["row_id"] = sds((batch,), jnp.int32)
    fields["step"] = sds((batch,), jnp.int32)
  return ReplayState(**fields)


def _policy(name):
  if name in (None, "f32", "f16", "bf16"):
    return None
  return F16_INT8 if name == "f16+int8" else P.PrecisionPolicy.preset(name)


def _plan(config, name, batch, interpret=False, cc=(9, 0), cores=132, **kw):
  pol = _policy(name)
  ckpt = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(name)
  return rk.plan_replay_step(config, _state(batch, pol, ckpt, **kw), pol,
                             None, interpret, cc, cores)


# (state, batch, interpret, compute capability) -> the launches the default
# config made at the start of this layout (read from their pallas_calls):
# output route, block_p, warps; flush route, grid, warps, cap, programs,
# fold; fused.
_DEFAULTS = [
    ("f32", 256, False, (9, 0), "triton", 64, 4, "mosaic_gpu", "persistent",
     None, None, 264, "dot_bf16x3", False),
    ("f32", 256, False, (8, 9), "triton", 64, 4, "triton", "persistent", 4,
     128, 528, "dot_bf16x3", False),
    ("f32", 256, True, None, "triton", 64, 4, "triton", "persistent", 4, 128,
     8, "dot_bf16x3", False),
    ("f32", 64, False, (9, 0), "triton", 64, 4, "triton", "persistent", 4,
     128, 528, "dot_bf16x3", False),
    ("f32", 1, False, (9, 0), "triton", 16, 4, "triton", "rows", None, None,
     None, "dot_tf32x3", True),
    ("f16", 256, False, (9, 0), "triton", 64, 2, "triton", "persistent", 4,
     128, 528, "dot_bf16x2", False),
    ("f16", 1, False, (9, 0), "triton", 16, 4, "triton", "persistent", None,
     None, 528, "dot_bf16x2", True),
    ("bf16", 64, False, (9, 0), "triton", 64, 2, "triton", "persistent", 4,
     128, 528, "dot_bf16x2", False),
    ("f16+fp8", 256, False, (9, 0), "split", 64, 2, "triton", "persistent",
     4, 120, 528, "dot_bf16x2", False),
    ("f16+fp8", 64, False, (9, 0), "triton", 64, 2, "triton", "persistent",
     4, 120, 528, "dot_bf16x2", False),
    ("f32+fp8", 256, False, (9, 0), "split", 64, 2, "triton", "persistent",
     4, 128, 528, "dot_bf16x3", False),
    ("f32+int8", 256, True, None, "split", 64, 2, "triton", "persistent", 4,
     128, 8, "dot_bf16x3", False),
    ("f32+int8", 1, False, (9, 0), "triton", 16, 2, "triton", "persistent",
     4, 128, 528, "dot_bf16x3", False),
    ("f32+bf16", 256, False, (9, 0), "triton", 64, 2, "triton", "persistent",
     4, 168, 396, "dot_bf16x3", False),
    ("f16+fp8+sr", 256, False, (9, 0), "split", 64, 2, "triton",
     "persistent", 4, None, 528, "dot_bf16x2", False),
    ("f16+sr", 256, False, (9, 0), "triton", 64, 2, "triton", "persistent",
     2, None, 528, "dot_bf16x2", False),
    ("bf16+sr", 1, True, None, "triton", 16, 2, "triton", "persistent", 2,
     None, 8, "dot_bf16x2", False),
]


@pytest.mark.parametrize("case", _DEFAULTS, ids=lambda c: str(c[:4]))
def test_default_plans_are_the_measured_launches(case):
  name, batch, interpret, cc, *want = case
  plan = _plan(pk.ReplayConfig(), name, batch, interpret, cc)
  got = (plan.output_route, plan.block_p, plan.num_warps, plan.flush_route,
         plan.flush_grid, plan.flush_num_warps, plan.flush_max_registers,
         plan.flush_programs, plan.flush_fold, plan.fused_launch)
  assert got == tuple(want)
  assert plan.max_registers is None and plan.heads_per_program == 1
  if plan.flush_route == "mosaic_gpu":
    assert (plan.flush_heads_per_program, plan.mosaic_store_from_input,
            plan.mosaic_fold_pieces, plan.mosaic_stages) == (4, True, 3, 2)
  else:
    assert not plan.mosaic_store_from_input
  if plan.flush_fold == "dot_tf32x3":
    assert plan.fold_dot == (TF32X3 if not interpret else (
        jax.lax.Precision.HIGHEST,) * 2)


_STATES = ["f32", "f16", "bf16", "f32+fp8", "f32+int8", "f16+fp8",
           "f16+int8", "f16+fp8+sr", "f32+int8+sr", "f32+bf16", "bf16+sr"]
_DEVICES = [(True, None, 132), (False, (9, 0), 132), (False, (9, 0), 78),
            (False, (8, 9), 132)]


@pytest.mark.parametrize("device", _DEVICES, ids=str)
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_each_default_is_filled_on_its_own(batch, device):
  """For every state and device, setting any one field to the value the
  default plan gives it leaves the whole plan as it was (no default
  depends on whether another field was set)."""
  interpret, cc, cores = device
  for name in _STATES:
    plan = _plan(pk.ReplayConfig(), name, batch, interpret, cc, cores)
    for field in dataclasses.fields(pk.ReplayConfig):
      config = dataclasses.replace(pk.ReplayConfig(),
                                   **{field.name: getattr(plan, field.name)})
      assert _plan(config, name, batch, interpret, cc, cores) == plan, (
          name, field.name)


@pytest.mark.parametrize("name,batch,cc,change", [
    # The split route stays with any of the Triton route's launch fields.
    ("f16+fp8", 256, (9, 0), dict(block_p=32)),
    ("f16+fp8", 256, (9, 0), dict(num_warps=4)),
    ("f16+fp8", 256, (9, 0), dict(max_registers=96)),
    ("f32+int8", 256, (9, 0), dict(num_stages=2)),
    # The Mosaic flush stays with the output route's fields and its own.
    ("f32", 256, (9, 0), dict(block_p=32, num_warps=8)),
    ("f32", 256, (9, 0), dict(heads_per_program=2)),
    ("f32", 256, (9, 0), dict(flush_fold="rank1")),
    ("f32", 256, (9, 0), dict(flush_grid="rows")),
    # The fused launch stays with the output route's fields.
    ("f16", 1, (9, 0), dict(block_p=64, heads_per_program=2)),
    ("f32", 1, (9, 0), dict(max_registers=128)),
    # The flush launch defaults stay with the output route's fields.
    ("f16+fp8", 64, (9, 0), dict(block_p=16, num_warps=4)),
])
def test_setting_a_field_keeps_the_other_defaults(name, batch, cc, change):
  """Only the fields set (and what is computed from their values: the
  fold from block_p, the program count from the flush grid) differ from the
  default plan."""
  base = _plan(pk.ReplayConfig(), name, batch, False, cc)
  plan = _plan(pk.ReplayConfig(**change), name, batch, False, cc)
  for field in ("output_route", "flush_route", "fused_launch",
                "flush_num_warps", "flush_max_registers", "flush_programs",
                "mosaic_store_from_input"):
    if field not in change and not (field == "flush_programs"
                                    and "flush_grid" in change):
      assert getattr(plan, field) == getattr(base, field), field
  for field, value in change.items():
    assert getattr(plan, field) == value, field


def test_fields_that_do_not_apply_are_refused():
  for name, batch, config, match in (
      ("f32", 256, pk.ReplayConfig(flush_num_warps=2), "Mosaic GPU flush"),
      ("f32", 256, pk.ReplayConfig(flush_max_registers=128),
       "flush_route='triton'"),
      ("f16", 1, pk.ReplayConfig(flush_num_warps=4), "set fused_launch=False"),
      ("f16+fp8", 256, pk.ReplayConfig(heads_per_program=2),
       "set output_route='triton'"),
      ("f16+fp8", 1, pk.ReplayConfig(fused_launch=True), "a read copy")):
    with pytest.raises(NotImplementedError, match=match):
      _plan(config, name, batch)
  # With the route set explicitly, the same fields apply.
  plan = _plan(pk.ReplayConfig(flush_route="triton", flush_num_warps=2),
               "f32", 256)
  assert (plan.flush_num_warps, plan.flush_max_registers) == (2, None)
  plan = _plan(pk.ReplayConfig(output_route="triton", heads_per_program=2),
               "f16+fp8", 256)
  assert plan.heads_per_program == 2


def test_default_output_route_where_measured_faster():
  """"split" only for an 8-bit read copy at >= 256 x 128 (row, head) pairs
  with power-of-two windows; everything else "triton"."""
  fp8 = P.PrecisionPolicy.preset("f16+fp8")
  assert rk.default_output_route(_state(256, fp8)) == "split"
  assert rk.default_output_route(
      _state(512, P.PrecisionPolicy.preset("f32+int8"))) == "split"
  for rstate in (_state(128, fp8), _state(256, _policy("f32+bf16")),
                 _state(256, None, "float16"), _state(256, fp8, h=96)):
    assert rk.default_output_route(rstate) == "triton"


def test_default_flush_route_picks_mosaic_where_measured_faster():
  """"mosaic_gpu" only for a plain f32 checkpoint at batch >= 128 (whole
  128-byte counter granules) with a bf16 B buffer of a multiple of 16
  tokens on a Hopper-or-later GPU beside the Triton output route;
  everything else (and interpret mode) "triton"."""
  def route(rstate=None, plain=True, output="triton", interpret=False,
            cc=(9, 0)):
    return rk.default_flush_route(rstate or _state(256, h=8, g=2), plain,
                                  output, interpret, cc)

  assert route() == "mosaic_gpu"
  assert route(_state(128, h=8, g=2)) == "mosaic_gpu"
  for kw in (dict(rstate=_state(64, h=8, g=2)),
             dict(rstate=_state(144, h=8, g=2)),
             dict(rstate=_state(256, None, "float16", h=8, g=2)),
             dict(rstate=_state(256, h=8, g=2, L=8)),
             dict(rstate=_state(256, h=8, g=2, b_dtype=jnp.float32)),
             dict(rstate=_state(256, h=8, g=2, p=32)),  # headdim not 64k
             dict(plain=False), dict(output="split"), dict(interpret=True),
             dict(cc=(8, 0)), dict(cc=None)):
    assert route(**kw) == "triton", kw


def test_default_fold_mode():
  """The bf16 split for bf16 B (two pieces for a 16-bit checkpoint, three
  for f32 in a flush launch of its own), 3xTF32 otherwise, rank-1 below
  Triton's dot tiles; `fold_dot` turns a mode into the kernel's form."""
  bf, f32 = jnp.bfloat16, jnp.float32
  mode = rk.default_fold_mode
  assert mode(16, 16, (bf, bf), f32) == "dot_bf16x3"
  for ck in (jnp.float16, bf):
    assert mode(16, 16, (bf, bf), ck) == "dot_bf16x2"
    assert mode(16, 16, (bf, bf), ck, fused=True) == "dot_bf16x2"
  assert mode(16, 16, (bf, f32), f32) == "dot_tf32x3"
  assert mode(16, 16, (bf, bf), f32, fused=True) == "dot_tf32x3"
  assert mode(8, 16, (bf, bf), f32) == mode(16, 8, (bf, bf), f32) == "rank1"
  dot = rk.fold_dot
  assert dot(None, 16, 16, False, field="f", tile="t", b_dtypes=(bf, bf),
             ck_dtype=f32) == "bf16x3"
  assert dot("dot_tf32x3", 16, 16, False, field="f", tile="t",
             b_dtypes=(bf,), ck_dtype=f32) == TF32X3
  assert dot(None, 8, 16, False, field="f", tile="t", b_dtypes=(bf,),
             ck_dtype=f32) is None


@pytest.mark.parametrize("batch,fused", [(1, True), (4, True), (5, False),
                                         (66, False)])
def test_default_fused_launch_by_batch(batch, fused):
  """Fused below 4 (row, head) pairs per SM (528 at 132 SMs)."""
  assert rk.default_fused_launch(batch, 128) == fused


def test_flush_programs_fit_the_register_file():
  """Persistent flush programs per SM: as many as 64K registers hold at
  the cap (at most 4), 4 uncapped; 8 in all in interpret mode."""
  sms = 132  # the CPU device reports no core_count
  flush_programs = rk.flush_programs
  assert flush_programs(False, 4, 128) == 4 * sms
  assert flush_programs(False, 4, 168) == 3 * sms
  assert flush_programs(False, 4, 120) == 4 * sms
  assert flush_programs(False, 8, 256) == 1 * sms
  assert flush_programs(False, 2, None) == 4 * sms
  assert flush_programs(True, 4, 168) == 8
  assert flush_programs(False, 4, 168, core_count=78) == 3 * 78


def test_register_caps_without_the_lowering_hook(monkeypatch):
  """Where jax lacks the lowering hook (`triton_utils.capped_name`), the
  default flush launch is uncapped at 2 warps on a plain state and an
  explicit cap is refused by name, not dropped."""
  monkeypatch.setattr(tu, "_cap_hook_error", "AttributeError('x')")
  assert not tu.register_caps_supported()
  launch = rk.default_flush_launch
  assert launch(None, jnp.float16) == (2, None)
  assert launch(None, jnp.float32, num_warps=4) == (4, None)
  assert launch(None, jnp.float32, 4, 128) == (4, 128)
  with pytest.raises(NotImplementedError, match="register cap"):
    tu.capped_name("k", 128)
  assert tu.capped_name("k", None) == "k"


def test_importing_the_kernels_patches_nothing():
  """Importing pallas_kernels leaves Pallas' Triton lowering as it is; the
  register-cap hook is installed by the first capped kernel name, once."""
  code = (
      "import pallas_kernels\n"
      "from jax._src.pallas.triton import lowering as l\n"
      "f = l.lower_jaxpr_to_triton_module\n"
      "assert not getattr(f, 'replayssm_register_cap', False)\n"
      "from pallas_kernels import triton_utils as tu\n"
      "assert tu.capped_name('k', 128) == 'k__maxnreg128'\n"
      "g = l.lower_jaxpr_to_triton_module\n"
      "assert g.replayssm_register_cap and g is not f\n"
      "tu.install_register_cap_hook()\n"
      "assert l.lower_jaxpr_to_triton_module is g\n")
  subprocess.run([sys.executable, "-c", code], check=True)


_LAUNCHES = {
    # (state, batch) on a (9, 0) GPU with 132 SMs -> the step's launches:
    # (pallas_call name, grid, warps, stages), or the Mosaic flush's
    # arguments.
    ("f32", 256): [("mosaic_flush", 3, 264, True, 4, 2),
                   ("replayssm_replay_output_route", (16, 8, 256), 4, 1)],
    ("f16", 256): [("replayssm_replay_output_route", (16, 8, 256), 2, 1),
                   ("replayssm_replay_flush_route__maxnreg128", (528,), 4,
                    1)],
    ("f32+bf16", 256): [
        ("replayssm_replay_output_route", (16, 8, 256), 2, 1),
        ("replayssm_replay_flush_route__maxnreg168", (396,), 4, 1)],
    ("f16+fp8", 256): [
        ("replayssm_replay_readout", (16, 8, 256), 2, None),
        ("replayssm_replay_window", (8, 1, 256), 4, None),
        ("replayssm_replay_flush_route__maxnreg120", (528,), 4, 1)],
    ("f16", 1): [("replayssm_replay_fused_routes", (1040,), 4, 1)],
    ("f32", 1): [("replayssm_replay_fused_routes_rows", (64, 8, 1), 4, 1)],
}


@pytest.mark.parametrize("case", sorted(_LAUNCHES), ids=str)
def test_default_step_launches(case, monkeypatch):
  """The launches replay_state_update makes with the default config on an
  H200-like device (traced, not run): names (with the register caps),
  grids, warps and stages; the Mosaic flush's fold, CTAs, store and
  heads per CTA."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from pallas_kernels.replay import step  # pylint: disable=g-import-not-at-top
  name, batch = case
  launches, real = [], pl.pallas_call

  def pallas_call(kernel, **kw):
    cp = kw["compiler_params"]
    launches.append((kw["name"], kw["grid"], cp.num_warps, cp.num_stages))
    return real(kernel, **kw)

  def mosaic_flush(checkpoint, x_buf, b_buf, dt_buf, count, x, *args, **kw):
    launches.append(("mosaic_flush", kw["fold_pieces"], kw["num_ctas"],
                     kw["store_from_input"], kw["config"].heads_per_program,
                     kw["config"].max_concurrent_steps))
    return jnp.zeros(x.shape, x.dtype), checkpoint

  monkeypatch.setattr(pl, "pallas_call", pallas_call)
  monkeypatch.setattr(step, "mosaic_flush", mosaic_flush)
  monkeypatch.setattr(tu, "compute_capability", lambda: (9, 0))
  pol = _policy(name)
  rstate = _state(batch, pol, {"f32": "float32", "f16": "float16"}.get(name))
  sds = jax.ShapeDtypeStruct
  h, p, n, g = 128, 64, 128, 8
  update = step.replay_state_update.__wrapped__  # untraced: no jit cache
  jax.eval_shape(
      lambda r, x, dt, A, B, C, D, bias: update(
          r, x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True,
          policy=pol),
      rstate, sds((batch, h, p), jnp.bfloat16), sds((batch, h), jnp.float32),
      sds((h,), jnp.float32), sds((batch, g, n), jnp.bfloat16),
      sds((batch, g, n), jnp.bfloat16), sds((h,), jnp.float32),
      sds((h,), jnp.float32))
  assert launches == _LAUNCHES[case]
