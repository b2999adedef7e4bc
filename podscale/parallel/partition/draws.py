"""Random draws: this replica's rows of a batch-shaped threefry draw, the very bits of the
single device's draw (or, opted in, a per-replica stream)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from podscale._jax import prng, threefry2x32
from podscale.parallel.partition.layouts import Split

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner


def random_bits_rows(p: Partitioner, eqn, key):
    """This replica's rows of a threefry draw with the batch's leading size (a dropout mask):
    the very bits of the single-device draw (``jax_threefry_partitionable``: bit i is a function
    of the key and the flat index i), computed for the local rows only."""
    shape, bit_width = tuple(eqn.params["shape"]), eqn.params["bit_width"]
    if not shape or shape[0] != p.batch_rows or not p.divides(shape, 0) or np.shape(key) != ():
        return None
    local = (shape[0] // p.n, *shape[1:])
    if p.independent_rng:  # rng="independent": this replica's own stream
        mine = jax.random.fold_in(key, p.index())
        return [(jax.random.bits(mine, local, prng.UINT_DTYPES[bit_width]), Split(0))]
    if not jax.config.jax_threefry_partitionable or "threefry" not in str(jax.random.key_impl(key)):
        return None
    size = math.prod(local)
    offsets = np.arange(p.n, dtype=np.uint64) * np.uint64(size)  # each replica's first flat index
    hi_table = jnp.asarray((offsets >> np.uint64(32)).astype(np.uint32))
    lo_table = jnp.asarray((offsets & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    hi, lo = prng.iota_2x32_shape(local)
    off_hi, off_lo = hi_table[p.index()], lo_table[p.index()]
    lo2 = lo + off_lo
    hi = hi + off_hi + (lo2 < lo).astype(jnp.uint32)  # carry
    k1, k2 = jax.random.key_data(key)
    bits1, bits2 = threefry2x32.threefry2x32_p.bind(k1, k2, hi, lo2)
    dtype = prng.UINT_DTYPES[bit_width]
    if bit_width == 64:
        bits = lax.shift_left(bits1.astype(dtype), jnp.asarray(32, dtype)) | bits2.astype(dtype)
    elif bit_width == 32:
        bits = bits1 ^ bits2
    else:
        bits = (bits1 ^ bits2).astype(dtype)
    return [(bits, Split(0))]
