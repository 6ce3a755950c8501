"""The model: loading it, the runner that executes each step's forward over the paged KV cache, the
step's inputs, CUDA graphs, and the start-up sizing and warm-up."""
