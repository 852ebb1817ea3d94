"""How large the attention paths' tiles, slabs and blocks are: every budget in one place.

A budget counts score entries of one call's tensors (B·H·rows·keys, 4 bytes each in float32)
unless it says otherwise. What each value was measured against is in ``docs/performance.md``
("Tile sizes"). The paths read these at call time (``policy.NAME``), so a test may patch them
here.
"""

from __future__ import annotations

# -- key tiles (`tiles.Grid`): element-wise and normalised maps, stick-breaking, entropy --------

#: entries per tile of a pass that makes a fresh tile each time: 1 MiB, about one core's L2
TILE_ELEMENTS = 2**18
#: entries per tile of a pass that writes its tiles into the grid's reused buffers (``reuse``)
BUFFERED_TILE_ELEMENTS = 2**20
#: on a device other than the CPU every budget is this many times larger (``SHARPATTN_DEVICE_TILES``
#: overrides it)
DEVICE_TILE_FACTOR = 16
#: entries per forward tile of whole rows (`tiles.row_tiles`), and their cap
ROW_TILE_MAX = 2**20
#: entries a row tile aims at while whole rows fit: as large as the cap
ROW_TILE_ELEMENTS = ROW_TILE_MAX
#: query rows per row tile at least (the q·kᵀ and p·v products need about 128 to run at speed)
ROW_TILE_ROWS = 128

# -- adaptive temperature's slabs of whole rows (`adaptive_tiled`) -----------------------------

#: entries per slab
ADAPTIVE_SLAB_ELEMENTS = 2**22
#: query rows per slab at least, while the slab stays within `ADAPTIVE_SLAB_MAX`
ADAPTIVE_MIN_ROWS = 128
#: the largest slab (32 MiB); larger calls are cut into groups of heads
ADAPTIVE_SLAB_MAX = 2**23
#: with fewer rows per slab than this the two-pass path is faster
ADAPTIVE_FEWEST_ROWS = 64
#: the backward's slabs have 1/this of the forward's rows (it holds two slab-sized buffers)
ADAPTIVE_BACKWARD_PARTS = 4 / 3

# -- the sparse maps' query blocks (`sparse_tiled`) ------------------------------------------

#: entries per query block of the entmax family and top-k
SPARSE_SLAB_ELEMENTS = 2**21
#: query rows per block at least, while the block stays within `SPARSE_SLAB_MAX`
SPARSE_MIN_ROWS = 64
#: the largest block the row minimum may make
SPARSE_SLAB_MAX = 2**22
#: the largest ``top_k`` whose rows keep only their selected keys (the C++ selection)
TOPK_SELECT_MAX_K = 64
#: query rows × kept keys per block of the selected top-k path's gathers (each ``[.., D]``)
TOPK_GATHER_ENTRIES = 2**15

# -- other paths -------------------------------------------------------------------------------

#: booleans per block when stick-breaking checks a user mask against the causal one
STICK_CHECK_ELEMENTS = 2**22
#: default entries per query block of the chunked path (32 MiB)
CHUNK_ELEMENTS = 2**23
#: ``impl="auto"`` makes the whole score matrix (the naive path) only up to this many entries
NAIVE_MAX_ELEMENTS = 2**24

# -- the flash kernel's range (`fast.scores_in_range`) ------------------------------------------

#: the row-scaled and adaptive fast paths (the flash kernel: CPU flash, SDPA, Triton; adaptive's
#: C++ slabs) run only while |β|·(a bound of |s|) stays below this; beyond, ``attend`` takes the
#: chunked path. The flash backward recomputes its weights as exp(β·s − lse) in float32, an
#: exponent with an absolute error of about ε·|β·s|, and both take D = dO·out, rounded apart from
#: dO·v_j by ε, a difference β multiplies into dq and dk (docs/performance.md, "Extreme β")
FUSED_SCALED_SCORE_MAX = 2.0**9
