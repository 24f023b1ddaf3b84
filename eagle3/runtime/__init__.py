"""What in-process decoding shares between the speculative decoder (:mod:`eagle3.spec`) and the
batched decoding of the hf engine (:mod:`eagle3.engines.hf.batch_decode`): CUDA graphs
(:mod:`eagle3.runtime.graphs`), the fixed-slot KV cache (:mod:`eagle3.runtime.slots`) and the
explicit attention masks (:mod:`eagle3.runtime.mask`). It imports neither of them."""

from __future__ import annotations

from eagle3.runtime.graphs import GraphedCall  # noqa: F401
from eagle3.runtime.mask import OUTSIDE_COMPILE, SDPA_OUTSIDE_COMPILE, explicit_mask  # noqa: F401
from eagle3.runtime.slots import SlotCache, kv_layout, prefix_mask, tree_mask_over_slots  # noqa: F401
