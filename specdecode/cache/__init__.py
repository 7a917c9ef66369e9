"""KV caches, written by position: rollback is a length change.

* `contiguous.KVCache` -- one preallocated slab per row (the transformers adapter's models, drafter
  state that lives in per-row tensors).
* `paged.PagedKVCache` -- fixed-size blocks shared by all rows, a block table per row; what the
  engine core runs every native model on. Admission reserves blocks; prefix caching registers
  full committed blocks under chained hashes (`blocks.py`) and, with a directory, keeps them on
  disk across restarts and crashes (`disk.py`: copied when registered, written behind by a writer
  thread).
"""
