"""Training configurations: plain Python files for `python train.py config/<name>.py`. paper.py
composes the paper's GPT-2 runs; each train_gpt2_<size>_<optimizer>.py names one of them."""
