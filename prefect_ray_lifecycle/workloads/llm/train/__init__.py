"""A causal-LM fine-tune on Ray Train and Ray Data (no Prefect): settings, the tokenizer's
packing of text into fixed-length blocks, the per-worker training loop, its checkpoints, the
run's history and the just-in-time checkpoint decision on preemption."""
