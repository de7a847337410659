"""The runtime: what runs one step's forward pass for the engine's loop.

The engine (``minillm/engine/``) decides *what* runs each step — which requests, which tokens,
which blocks. The runtime decides *how*: it turns plain ``StepInputs`` into logits.

- ``runner.py`` — the contract: ``StepInputs``/``ChunkInput`` in, logits out (``ModelRunner``);
- ``naive_runner.py``, ``contiguous_runner.py``, ``paged_runner.py`` — one runner per rung of the
  ladder (recompute everything; a contiguous cache per static batch; the paged pool);
- ``fast_path.py`` — the decode fast-path protocol and the one input builder that pads a decode
  batch to a static shape; ``cuda_graphs.py`` (CUDA + Triton) and ``compiled_decode.py``
  (AOTInductor on the CPU) implement it;
- ``block_table_rows.py`` — block tables kept as persistent tensor rows;
- ``weight_methods.py`` — how each linear layer stores and multiplies its weights (prepacking,
  quantization, sparsity, offload), applied once when the model is built.

Compiled code (decode packages, the C++ kernel) loads only from a private folder and only if its
hash is the one recorded when it was built: ``minillm/trusted_cache.py``.

Nothing here imports the engine: the step loop calls down into the runtime, never the reverse.
The package's ``__init__`` imports nothing, so importing one runtime module loads only what it needs.
"""
