import jax, jax.numpy as jnp, numpy as np
import replayssm_jax as R
from replayssm_jax import testing as T
from replayssm_jax.state import ReplayState
b,H,P,N,G,L=256,128,64,128,8,16
prm=T.random_params(jax.random.PRNGKey(0),H)
inp=T.random_step_inputs(jax.random.PRNGKey(1),b,H,P,N,G,jnp.bfloat16,with_z=False)
kk=jax.random.split(jax.random.PRNGKey(2),5)
S=jax.random.normal(kk[4],(b,H,P,N)).astype(jnp.float16)
rs=ReplayState(checkpoint=jax.random.normal(kk[0],(b,H,P,N)).astype(jnp.float16),
  x_buf=jax.random.normal(kk[1],(b,L,H,P)).astype(jnp.bfloat16),
  b_buf=jax.random.normal(kk[2],(b,L,G,N)).astype(jnp.bfloat16),
  dt_buf=jax.random.uniform(kk[3],(b,L,H),jnp.float32,0.01,0.2),
  count=(jnp.arange(b)%L).astype(jnp.int32))
fb=jax.jit(lambda s: R.selective_state_update(s,**inp,**prm,dt_softplus=True,implementation="pallas"),donate_argnums=0)
fr=jax.jit(lambda r: R.replay_state_update(r,**inp,**prm,dt_softplus=True,implementation="pallas"),donate_argnums=0)
y,S=fb(S); jax.block_until_ready(S)
for _ in range(2):
  y,rs=fr(rs); jax.block_until_ready(rs)
print("done", rs.count[:4])
