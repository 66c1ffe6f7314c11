"""Runs a scheduled step on the device: packs the step's inputs into preallocated buffers,
owns the weights and KV tensors, replays CUDA graphs for decode steps."""
