"""The replay kernels' shared pieces: a work item and its token window, the
refs' order, the flush stores of a state with a read copy or stochastic
rounding, and the counters padded for the persistent grids."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from replayssm_jax import precision as P
from replayssm_jax.reference import process_dt

F32 = jnp.float32


class Program:
  """One (row, heads, headdim block) work item and its token window."""

  def __init__(self, cnt_ref, dt_ref, a_ref, bias_ref, *, b, g, pblk, head0,
               buffer_len, block_p, dt_softplus, pid=None, count=None,
               rows_ref=None, **_):
    """count: the row's counter when known at trace time (then it is not
    loaded and the slot masks are constants), else read from cnt_ref.

    rows_ref: [batch] slots of the state's rows (`replayssm_jax.slots`,
    -1 for a padding row) or None. Token refs are read at row `b`, state
    refs at `sb`: b's slot, or b itself without rows_ref. A padding row
    reads state row 0, appends and flushes nothing and outputs NaN."""
    self.L = buffer_len
    self.b, self.g, self.pblk, self.head0, self.pid = b, g, pblk, head0, pid
    live = True
    self.sb = b
    if rows_ref is not None:
      slot = rows_ref[b]
      live, self.sb = slot >= 0, jnp.maximum(slot, 0)
    self.ps = pl.ds(pblk * block_p, block_p)
    self.c = cnt_ref[self.sb] if count is None else jnp.int32(count)
    # A counter outside [0, L) (possible only under jit) must not write out
    # of bounds: such a row appends nothing, keeps its count, outputs NaN.
    self.valid = (self.c >= 0) & (self.c < self.L) & live
    self.flush = (self.c == self.L - 1) & live
    self.j = jnp.arange(self.L)
    self.hist = self.j < self.c  # buffered slots
    self.cur = self.j == self.c  # the current token's logical slot
    self._dt, self._a, self._bias = dt_ref, a_ref, bias_ref
    self._softplus = dt_softplus

  @classmethod
  def from_grid(cls, *refs, **kw):
    """Grid (headdim blocks x head blocks of a group, ngroups, batch)."""
    return cls.from_ids(*refs, pid=pl.program_id(0), g=pl.program_id(1),
                        b=pl.program_id(2), **kw)

  @classmethod
  def from_ids(cls, *refs, pid, g, b, heads_per_program, heads_per_group,
               block_p, headdim, **kw):
    """The item of program (pid, g, b) of the output route's grid."""
    nblk_p = headdim // block_p
    return cls(*refs, b=b, g=g, pblk=pid % nblk_p, block_p=block_p,
               head0=g * heads_per_group + (pid // nblk_p) * heads_per_program,
               pid=pid, **kw)

  def window_loads(self, h, dtb_ref):
    """The global loads of window_from for head h (a dict)."""
    d_hist = plgpu.load(dtb_ref.at[self.sb, :, h], mask=self.hist,
                        other=0.0)
    ld = dict(dt=self._dt[self.b, h], a=self._a[h], d_hist=d_hist)
    if self._bias is not None:
      ld["bias"] = self._bias[h]
    return ld

  def window_from(self, ld):
    """dt' of the current token, the weights s_j and the decay, from
    window_loads."""
    d_cur = process_dt(ld["dt"], ld.get("bias"), self._softplus)
    dw = jnp.where(self.cur, d_cur, ld["d_hist"])  # zero past the current slot
    a = ld["a"].astype(F32)
    # s_j = d_j exp(A sum_{i>j} d_i)
    s = dw * jnp.exp(a * tu.suffix_sums(dw, self.j))
    return d_cur, s, jnp.exp(a * jnp.sum(dw))

  def window_weights(self, h, dtb_ref):
    """dt' of the current token, the weights s_j and the decay of head h."""
    return self.window_from(self.window_loads(h, dtb_ref))


def window_load(ref, hist, shape):
  """A buffer window [L, ...] (ref, of that shape) in f32: the filled
  slots (hist [L] bool), zeros past them."""
  m = jnp.broadcast_to(hist.reshape(hist.shape + (1,) * (len(shape) - 1)),
                       shape)
  return plgpu.load(ref, mask=m, other=0.0).astype(F32)


def unpack(refs, n_in, n_out, has_D, has_z, has_bias, has_rows=False):
  """(n_in inputs, [D, z, dt_bias] refs or None, n_out outputs, the slots
  ref after the optional ones or None without has_rows) of a kernel's
  refs."""
  it = iter(refs)
  ins = [next(it) for _ in range(n_in)]
  opt = [next(it) if flag else None for flag in (has_D, has_z, has_bias)]
  rows = next(it) if has_rows else None
  outs = [next(it) for _ in range(n_out)]
  return ins, opt, outs, rows


@dataclasses.dataclass(frozen=True)
class CopySpec:
  """What a flush stores besides the master of a state with a read copy
  and/or stochastic rounding (None for the plain state).

  Attributes:
    copy: the state has a read copy (an extra aliased input and output).
    scaled: the copy is 8-bit with [batch, nheads, headdim] f32 scales
      (another aliased input and output).
    sr_master, sr_copy: round the master / the copy stochastically; the
      threefry key data of each row and site come in one [batch, sites, 2]
      uint32 input (master first), see `precision.row_keys`.
    nheads, headdim, dstate: row shape (element indices of the random
      bits).
    rng: the per-element hash of the random bits (`precision.SR_RNGS`).
    reload: interpret mode: derive the copy from the master tile read back
      after its store. XLA:CPU recomputes the fold's last update (an
      elementwise a + b * c) inside each fusion that consumes it and
      contracts it to an FMA in some only, so the copy could round a value
      one f32 ulp away from the stored master (seen on f16 ties); an
      optimization barrier does not survive its fusion passes. Triton
      computes the tile once, so the GPU code keeps it in registers.
  """
  copy: bool
  scaled: bool
  sr_master: bool
  sr_copy: bool
  nheads: int
  headdim: int
  dstate: int
  reload: bool = False
  rng: str = "threefry"

  @property
  def n_in(self) -> int:
    return self.copy + self.scaled + (self.sr_master or self.sr_copy)

  @property
  def n_out(self) -> int:
    return self.copy + self.scaled


class WholeTile:
  """The item `FlushStores.store` takes for a whole [rows, columns] tile of
  state row b (the Gated DeltaNet kernels: key rows by the whole value
  row)."""

  def __init__(self, b, rows):
    self.b = self.sb = b
    self.pblk, self.ps = 0, pl.ds(0, rows)


def copy_counts(spec):
  """(extra inputs, extra outputs) of the flush kernels for a CopySpec."""
  return (0, 0) if spec is None else (spec.n_in, spec.n_out)


class FlushStores:
  """The flush outputs (after y): master, then read copy and its scales;
  and the extra inputs (read copy, scales, SR keys) that come after y."""

  def __init__(self, outs, extra_ins, spec):
    self.spec = spec
    self.ck_out = outs[0]
    self.rc_out = outs[1] if spec is not None and spec.copy else None
    self.rs_out = outs[2] if spec is not None and spec.scaled else None
    nk = 0 if spec is None else spec.copy + spec.scaled
    self.keys_ref = (extra_ins[nk] if spec is not None
                     and (spec.sr_master or spec.sr_copy) else None)

  def _bits(self, b, site, index):
    k0, k1 = self.keys_ref[b, site, 0], self.keys_ref[b, site, 1]
    spec = self.spec
    return P.element_bits(k0, k1, index,
                          spec.nheads * spec.headdim * spec.dstate, spec.rng)

  def store(self, p, h, st):
    """Stores the master tile rounded to its dtype (maybe stochastically)
    and the read copy re-stored from it, like the reference's flush (a
    plain state: the checkpoint tile alone)."""
    b, ps, spec = p.sb, p.ps, self.spec  # the state row
    if spec is None:
      plgpu.store(self.ck_out.at[b, h, ps], st.astype(self.ck_out.dtype))
      return
    index = None
    if spec.sr_master or spec.sr_copy:
      # Flat element indices (h, p, n) of the tile within the row.
      block_p, n = st.shape
      rows = (jnp.arange(block_p, dtype=jnp.int32) + p.pblk * block_p
              + h * spec.headdim)
      index = (rows[:, None] * n + jnp.arange(n, dtype=jnp.int32)[None, :]
               ).astype(jnp.uint32)
    master = P.round_to(st, self.ck_out.dtype,
                        self._bits(b, 0, index) if spec.sr_master else None)
    plgpu.store(self.ck_out.at[b, h, ps], master)
    if spec.reload:  # interpret mode only, see CopySpec.reload
      master = plgpu.load(self.ck_out.at[b, h, ps])
    if self.rc_out is None:
      return
    bits = self._bits(b, int(spec.sr_master), index) if spec.sr_copy else None
    mf = master.astype(F32)
    if self.rs_out is not None:
      q, scale = tu.quantize_rows(mf, self.rc_out.dtype, bits)
      plgpu.store(self.rc_out.at[b, h, ps], q)
      self.rs_out[b, h, ps] = scale
    else:
      plgpu.store(self.rc_out.at[b, h, ps],
                  P.round_to(mf, self.rc_out.dtype, bits))


def copy_spec(rstate, policy, interpret):
  """The CopySpec of a state and policy (None: the plain state)."""
  sr = policy is not None and policy.stochastic_rounding
  if rstate.read_copy is None and not sr:
    return None
  if sr and rstate.step is None:
    raise ValueError(
        f"policy {policy.name!r} rounds stochastically, which needs "
        f"rstate.row_id and rstate.step ([batch] int32).")
  copy = rstate.read_copy is not None
  scaled = rstate.read_scale is not None
  if copy and scaled != (jnp.dtype(rstate.read_copy.dtype).name
                         in P.QUANTIZED_DTYPES):
    raise ValueError(
        f"rstate.read_scale must be given exactly with an 8-bit read copy "
        f"(float8_e4m3fn/int8), got a {rstate.read_copy.dtype} copy and "
        f"read_scale={'None' if rstate.read_scale is None else 'array'}.")
  _, nheads, headdim, dstate = rstate.checkpoint.shape
  return CopySpec(
      copy=copy, scaled=scaled,
      sr_master=sr and jnp.dtype(rstate.checkpoint.dtype) != jnp.dtype(F32),
      sr_copy=sr and copy, nheads=nheads, headdim=headdim, dstate=dstate,
      reload=interpret and copy, rng=policy.sr_rng if sr else "threefry")


def copy_operands(spec, policy, layer, rstate, first_in: int,
                  first_out: int):
  """The extra operands of a flush kernel for a CopySpec (none without):
  (inputs: the read copy, its scales, the SR keys; {input: output} aliases
  of the copy and scales, numbered from first_in / first_out, so only the
  flushing rows' tiles are stored and the others keep their bits; their
  output shapes)."""
  ins, aliases, shapes = [], {}, ()
  if spec is None:
    return ins, aliases, shapes
  for v in (rstate.read_copy, rstate.read_scale):
    if v is not None:
      aliases[first_in + len(ins)] = first_out + len(ins)
      shapes += (jax.ShapeDtypeStruct(v.shape, v.dtype),)
      ins.append(v)
  keys = _sr_keys(spec, policy, layer, rstate)
  if keys is not None:
    ins.append(keys)
  return ins, aliases, shapes


def _sr_keys(spec, policy, layer, rstate):
  """[batch, sites, 2] uint32 key data of the stochastic stores (master
  first, then the read copy), or None."""
  sites = ([P.SITE_MASTER] if spec.sr_master else []) + (
      [P.SITE_READ_COPY] if spec.sr_copy else [])
  if not sites:
    return None
  return jnp.stack([P.row_keys(policy.seed, layer, rstate.row_id,
                               rstate.step, site) for site in sites], axis=1)


def pad_pow2(count):
  """[batch] counters padded with -1 (no route) to a power of two: the
  persistent kernels load them as one Triton vector."""
  batch = count.shape[0]
  pad = (1 << (batch - 1).bit_length()) - batch
  return jnp.pad(count, (0, pad), constant_values=-1) if pad else count


def step_fields(rstate, rows=None):
  """row_id / step of the new state: as the reference, step +1 per
  in-range row (none without stochastic-rounding counters); with rows
  (effective slots), per stepped row."""
  if rstate.step is None:
    return {}
  c = rstate.count
  stepped = (c >= 0) & (c < rstate.buffer_len)
  if rows is not None:
    idx = jnp.where(rows < 0, c.shape[0], rows)  # padding: dropped
    stepped &= jnp.zeros(c.shape, bool).at[idx].set(True, mode="drop")
  return dict(row_id=rstate.row_id,
              step=jnp.where(stepped, rstate.step + 1,
                             rstate.step).astype(jnp.int32))
