# GPT-2 large (774M) with Muon + AdamW on OpenWebText: the paper's baseline, as its reference trainer runs it.
# Its numbers live in config/paper.py (model size, the 100k-step recipe, the optimizer's lrs);
# `python -m marsgpt.config config/train_gpt2_large_muon.py` prints every key.
from config.paper import paper_run

globals().update(paper_run("large", "muon"))
