# Quickstart: a 0.45M-parameter character-level GPT trained with MARS on the offline stdlib_char corpus
# (python -m data.stdlib_char.prepare, no network), sized to end within 3 minutes on 2 CPU cores.
# Measured with `time bash scripts/quickstart.sh` (prepare + train + sample, 2 CPU cores, Python 3.11.7's
# stdlib): 2 min 28 s (2 min 39 s and 2 min 45 s with other work on the cores); ~20 ms a step; val loss
# 4.42 -> 1.96 (step 1,750) -> 1.79 (3,500) -> 1.68 (5,250) -> 1.63 (7,000), the training split's to 1.01.
# The sample that ends it is Python (def, self., import lines) with invented names.
#     python train.py config/quickstart.py
#
# Why this shape: at equal time on 2 cores, small models taking many small steps beat bigger ones (final
# val loss, 100k-token evaluation). With ~140 s of steps: 4 x 96 wide, 12 x 64 tokens, 7,100 steps 1.64;
# 4 x 64 (16 x 64 tokens) 1.65; 3 x 128 1.65; 4 x 128 1.69. With ~95 s: 4 x 96 1.71; 4 x 128 1.74;
# 6 x 128 1.82; 4 x 192 1.88; the former 4 x 256 with 8 x 256 tokens (333 steps) 2.68. Learning rates 3e-3,
# 6e-3, 1e-2 and 2e-2 ended within 0.03 of each other (two seeds differ by 0.01), so MARS keeps the paper's
# GPT-2 small rates. The validation split holds other modules than the training split (the corpus is split
# by position), hence its loss stays well above the training split's. Two torch threads ran a step 1.6x
# faster than one here, so the thread count stays torch's default.
out_dir = "out-quickstart"
dataset = "stdlib_char"
n_layer = 4
n_head = 4
n_embd = 96
block_size = 64
bias = False
dropout = 0.0
batch_size = 12
gradient_accumulation_steps = 1  # 768 tokens per step, ~20 ms on 2 cores
max_iters = 7000
# Five evaluations of 100 x 768 tokens (train and val) cost ~5 s in all; a train line every 250 steps.
eval_interval = 1750
eval_iters = 100
log_interval = 250
# MARS-AdamW with the paper's GPT-2 small learning rates, a 5% warmup and cosine decay to a tenth.
optimizer_name = "mars"
learning_rate = 6e-3
lr_1d = 3e-3
weight_decay = 1e-2
warmup_iters = 350
lr_decay_iters = 7000
min_lr = 6e-4
# device 'auto': a GPU when there is one. No torch.compile: its start-up would outlast this short run.
compile = False
