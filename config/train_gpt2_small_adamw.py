# GPT-2 small (124M) with AdamW on OpenWebText: the paper's baseline.
out_dir = "out_small_adamw_100k"
wandb_log = True
wandb_project = "mars"
wandb_run_name = "gpt2-small-adamw-100k"
n_layer, n_head, n_embd = 12, 12, 768
batch_size = 15
gradient_accumulation_steps = 480 // batch_size  # global batch 480 x 1024 tokens on any number of GPUs
grad_multiplier = 4  # the paper's gradient scale: its code summed the 4 micro-batches each of its 8 GPUs ran
max_iters = lr_decay_iters = 100000  # 100k steps x 491,520 tokens = 49.2B tokens
warmup_iters = 2000
eval_interval, eval_iters, log_interval = 1000, 200, 10
optimizer_name = "adamw"
learning_rate, min_lr = 6e-4, 3e-5
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
