"""The Megatron-core training backend: GPTModel from HF configs, tensor parallelism under Ray,
NCCL weight sync."""
