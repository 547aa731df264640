# Overlay: the same run on FineWeb-Edu (data/fineweb_edu), as the paper's FineWeb trainers. Give it after a run config.
dataset = "fineweb_edu"
out_dir = out_dir + "_fw"  # noqa: F821 (set by the run config given before this one)
wandb_run_name = wandb_run_name + "-fw"  # noqa: F821
