"""The compiled sampler's Triton decode kernels, each a ``torch.library`` op with a plain-PyTorch
reference (run off CUDA unless ``TRITON_INTERPRET=1``):

- :mod:`~logitless.generation.kernels.decode_attention`: split-K (flash-decoding) attention of one new
  token per row over a static KV cache (op ``logitless::decode_attention`` and its shared-prefix and
  new-token variants);
- :mod:`~logitless.generation.kernels.decode_rotary`: a decode step's rotary embedding and KV-cache
  write in one launch (op ``logitless::decode_rotary_cache``);
- :mod:`~logitless.generation.kernels.counter_sampling`: the counter-based draw of the next token and
  its log-prob in two launches (op ``logitless::counter_draw``).

Nothing is imported here: importing a module imports Triton and registers its op, which the
compiled sampler does only where it runs the kernel.
"""
