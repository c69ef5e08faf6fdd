"""Triton kernels for the GPU path (run on the CPU under `TRITON_INTERPRET=1`):
`kv_store.store_kv` and `paged_attention.paged_attention` (with its parts
`paged_decode` and `paged_prefill`).

Triton decides whether a kernel is compiled or interpreted when it is
decorated: set `TRITON_INTERPRET=1` before `triton` and these modules are
first imported to interpret them. Nothing here is imported by `import ferrox`.
"""
