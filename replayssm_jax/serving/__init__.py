"""Serving helpers on the hybrid LM's decode state.

  Pool / init_pool   a fixed-capacity ModelState, one request per batch row
                     ("slot").
  insert             prefill a prompt into one slot (jitted, traced slot).
  insert_many        prefill k prompts into k slots in one batched call.
  model_parts        a model's nnx.split, its graph hashed once and its
                     parameters flat, kept to skip the split, the hash and
                     the State's flattening per call (parts= of the insert
                     and step functions).
  evict / evict_many free a slot / several slots in one op.
  step / step_n      one / n decode steps over all slots (dense batch;
                     inactive slots' states left unspecified).
  PrefixCache        an LRU map of decode states at block-aligned prompt
                     prefixes (keyed by a block hash chain).
  insert_cached      insert through a PrefixCache (insert_cached_many:
                     k prompts, batched as insert_many).
  Engine / Request   continuous batching: a request queue admitted into
                     free slots, several steps per dispatch with stopping
                     on the device, streamed tokens.
  controls           the engine's per-slot budgets, eos ids, temperatures
                     and key streams on the device (its overlap of host
                     and device rests on them).
  rows               admitted rows written into their slots, and
                     compaction: a decode call over some slots' rows
                     gathered into a smaller batch, scattered back in the
                     same call (Engine's compact_below).
  snapshot           Engine.save / Engine.restore: an engine written
                     between dispatches and resumed exactly.
  Speculation        Engine(speculative=...): speculative decoding rounds
                     (a proposer's drafts, one verify of the pool, per-row
                     acceptance and commit) inside the engine's dispatch.
"""

from replayssm_jax.serving.engine import Engine
from replayssm_jax.serving.pool import (Pool, bucket_len, evict, evict_many,
                                        init_pool, insert, insert_many,
                                        model_parts, step, step_n)
from replayssm_jax.serving.prefix_cache import (PrefixCache, insert_cached,
                                                insert_cached_many)
from replayssm_jax.serving.requests import EngineStats, Request
from replayssm_jax.serving.spec import Speculation

__all__ = ["Engine", "EngineStats", "Pool", "PrefixCache", "Request",
           "Speculation", "bucket_len", "evict", "evict_many", "init_pool",
           "insert", "insert_cached", "insert_cached_many", "insert_many",
           "model_parts", "step", "step_n"]
