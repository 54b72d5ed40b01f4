import sys, time, math, functools, json, os
import numpy as np, jax, jax.numpy as jnp
import replayssm_jax as R
from replayssm_jax import testing as T
from replayssm_jax.state import ReplayState
import pallas_kernels as PK
print("jax", jax.__version__, jax.devices(), flush=True)
OUT = os.environ.get("OUT", "/tmp")

def check_small():
  b,h,p,n,g=5,8,16,16,2
  k=jax.random.PRNGKey(0); prm=T.random_params(k,h)
  for dt_ in [jnp.float32, jnp.float16]:
    S=jax.random.normal(k,(b,h,p,n)).astype(dt_)
    inp=T.random_step_inputs(jax.random.PRNGKey(1),b,h,p,n,g)
    y0,S0=R.selective_state_update(S,**inp,**prm,dt_softplus=True,implementation="reference")
    y1,S1=R.selective_state_update(S,**inp,**prm,dt_softplus=True,implementation="pallas")
    print("ssu",dt_.__name__,T.max_rel_error(y1,y0),T.max_rel_error(S1,S0),flush=True)
    for L in [1,2,8,16]:
      counts=np.arange(b)%L; counts[-1]=L-1
      rs,full=T.random_replay_state(k,b,h,p,n,g,L,counts,prm["A"],checkpoint_dtype=dt_)
      y0,r0=R.replay_state_update(rs,**inp,**prm,dt_softplus=True,implementation="reference")
      y1,r1=R.replay_state_update(rs,**inp,**prm,dt_softplus=True,implementation="pallas")
      print(" replay",L,"y",T.max_rel_error(y1,y0),"ck",T.max_rel_error(r1.checkpoint,r0.checkpoint),"mat",T.max_rel_error(R.materialize(r1,prm["A"]),R.materialize(r0,prm["A"])),np.array_equal(r1.count,r0.count),flush=True)

def timeit(f, args, iters=10):
  for _ in range(2): args = f(args)
  jax.block_until_ready(args)
  ts=[]
  for _ in range(iters):
    t=time.perf_counter(); args=f(args); jax.block_until_ready(args); ts.append(time.perf_counter()-t)
  return float(np.median(ts)), args

def copy_bw():
  x=jax.random.normal(jax.random.PRNGKey(0),(1024*1024*1024//4,),jnp.float32)
  def g(a):
    for _ in range(8): a=jax.lax.optimization_barrier(a*1.0001)
    return a
  f=jax.jit(g, donate_argnums=0)
  t,_=timeit(f,x,10)
  return 8*2*x.nbytes/t

H,P,N,G=128,64,128,8
def bench(batch, ck_dtype, L, impl, hb=None, nw=4, bp=None, pre=False, allr=False):
  k=jax.random.PRNGKey(batch)
  prm=T.random_params(k,H)
  sbytes=batch*H*P*N*jnp.dtype(ck_dtype).itemsize
  K=max(2,math.ceil(256*2**20/sbytes)); 
  inps=[T.random_step_inputs(jax.random.PRNGKey(i),batch,H,P,N,G,jnp.bfloat16,with_z=False) for i in range(K)]
  kw={}
  if impl=="pallas": kw=dict(config=PK.ReplayConfig(heads_per_program=hb,num_warps=nw,block_p=bp,precompute_bc=pre,output_all_rows=allr) if L else PK.SSUConfig(num_warps=nw,block_p=bp))
  if L is None:
    states=[jax.random.normal(jax.random.PRNGKey(100+i),(batch,H,P,N),jnp.float32).astype(ck_dtype) for i in range(K)]
    nsteps=max(64,K)
    def run(states):
      states=list(states)
      for i in range(nsteps):
        y,s=R.selective_state_update(states[i%K],**inps[i%K],**prm,dt_softplus=True,implementation=impl,**kw)
        y,states[i%K]=jax.lax.optimization_barrier((y,s))
      return states, y
  else:
    states=[]
    for i in range(K):
      kk=jax.random.split(jax.random.PRNGKey(200+i),4)
      states.append(ReplayState(checkpoint=jax.random.normal(kk[0],(batch,H,P,N)).astype(ck_dtype),
        x_buf=jax.random.normal(kk[1],(batch,L,H,P)).astype(jnp.bfloat16),
        b_buf=jax.random.normal(kk[2],(batch,L,G,N)).astype(jnp.bfloat16),
        dt_buf=jax.random.uniform(kk[3],(batch,L,H),jnp.float32,0.01,0.2),
        count=(jnp.arange(batch)%L).astype(jnp.int32)))
    nsteps=K*L*max(1,math.ceil(64/(K*L)))
    def run(states):
      states=list(states)
      for i in range(nsteps):
        y,s=R.replay_state_update(states[i%K],**inps[i%K],**prm,dt_softplus=True,implementation=impl,**kw)
        y,states[i%K]=jax.lax.optimization_barrier((y,s))
      return states, y
  f=jax.jit(lambda s: run(s)[0], donate_argnums=0)
  t,_=timeit(f,states)
  return t/nsteps*1e6

bw=copy_bw(); print("copy GB/s", bw/1e9, flush=True)
res=[]
def rec(**kw):
  try: t=bench(**kw)
  except Exception as e: t=repr(e)[:300]
  kw={k:(v.__name__ if hasattr(v,'__name__') else v) for k,v in kw.items()}
  kw['us']=t; print(json.dumps(kw),flush=True); res.append(kw)
CF=[(64,1,4,False,False),(64,1,4,True,False),(64,1,4,False,True),(64,1,4,True,True),(32,1,2,True,True),(16,1,1,True,True),(16,1,2,True,True),(32,4,4,True,True),(64,4,4,True,True),(32,1,4,True,True)]
for ck in [jnp.float16, jnp.float32]:
  for bp,nw in [(16,1),(32,2),(64,4)]:
    rec(batch=256,ck_dtype=ck,L=None,impl="pallas",bp=bp,nw=nw)
  for bp,hb,nw,pre,allr in CF:
    rec(batch=256,ck_dtype=ck,L=16,impl="pallas",bp=bp,hb=hb,nw=nw,pre=pre,allr=allr)
  rec(batch=1,ck_dtype=ck,L=None,impl="pallas",bp=16,nw=1)
  for bp,hb,nw,pre,allr in [(16,1,1,True,True),(32,1,2,True,True),(16,1,4,False,False)]:
    rec(batch=1,ck_dtype=ck,L=16,impl="pallas",bp=bp,hb=hb,nw=nw,pre=pre,allr=allr)
json.dump(res,open(f"{OUT}/gpu_sweep.json","w"))
