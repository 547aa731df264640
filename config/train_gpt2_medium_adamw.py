# GPT-2 medium (355M) with AdamW on OpenWebText: the paper's baseline.
# Its numbers live in config/paper.py (model size, the 100k-step recipe, the optimizer's lrs);
# `python -m marsgpt.config config/train_gpt2_medium_adamw.py` prints every key.
from config.paper import paper_run

globals().update(paper_run("medium", "adamw"))
