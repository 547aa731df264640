# GPT-2 small (124M) with Muon + AdamW on OpenWebText: the paper's baseline.
out_dir = "out_small_muon_100k"
wandb_log = True
wandb_project = "mars"
wandb_run_name = "gpt2-small-muon-100k"
n_layer, n_head, n_embd = 12, 12, 768
batch_size = 15
gradient_accumulation_steps = 480 // batch_size  # global batch 480 x 1024 tokens on any number of GPUs
grad_multiplier = 4  # the paper's gradient scale: its code summed the 4 micro-batches each of its 8 GPUs ran
max_iters = lr_decay_iters = 100000  # 100k steps x 491,520 tokens = 49.2B tokens
warmup_iters = 2000
eval_interval, eval_iters, log_interval = 1000, 200, 10
optimizer_name = "muon"
muon_lr = 2e-2
learning_rate = muon_adamw_lr = 3e-3
weight_decay = 1e-1  # AdamW's (the 1-D tensors); Muon itself runs without weight decay
beta1, beta2 = 0.9, 0.95
# As the reference MARS/train_muon.py: Muon on every 2-D tensor (embeddings and tied head included),
# AdamW on the 1-D ones, both on the cosine schedule down to the same absolute min_lr.
muon_matrices = "all"
min_lr = 3e-5
