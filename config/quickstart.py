# Quickstart: a 0.45M-parameter character-level GPT trained with MARS on the offline stdlib_char corpus
# (python -m data.stdlib_char.prepare, no network), sized to end within 3 minutes on 2 CPU cores; the
# README's quickstart says what it measured, docs/training.md why this shape and these learning rates.
#     python train.py config/quickstart.py
out_dir = "out-quickstart"
dataset = "stdlib_char"
n_layer = 4
n_head = 4
n_embd = 96
block_size = 64
bias = False
dropout = 0.0
batch_size = 12
gradient_accumulation_steps = 1  # 768 tokens per step
max_iters = 7000
# Five evaluations of 100 x 768 tokens (train and val); a train line every 250 steps.
eval_interval = 1750
eval_iters = 100
log_interval = 250
# MARS-AdamW with the paper's GPT-2 small learning rates, a 5% warmup and cosine decay to a tenth.
optimizer = "mars-adamw"
learning_rate = 6e-3
lr_1d = 3e-3
weight_decay = 1e-2
warmup_iters = 350
lr_decay_iters = 7000
min_lr = 6e-4
# device 'auto': a GPU when there is one. There, this model is too small to keep the GPU busy: each step's time is
# the host's, launching kernels. So float32 (no autocast cast before each matmul; on the CPU, float32 is what
# dtype 'auto' means) and torch.compile on CUDA only, its default (each block one call of one graph); the CPU
# runs uncompiled: its compile would outlast this short run.
dtype = "float32"
