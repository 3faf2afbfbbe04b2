"""Tensor parallelism: an instance of N ranks (docs/parallelism.md). group: the process group and the message
pipes; messages: what rank 0 sends the others; layers: the parallel layers and the sharding of a loaded model;
features: what is refused; executor: rank 0 starts, watches and stops the other ranks; worker: a rank > 0."""
