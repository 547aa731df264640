# GPT-2 large (774M) with Moonlight (Muon + AdamW) on OpenWebText: the MARS-M paper's baseline.
# Its numbers live in config/paper.py (model size, the 100k-step recipe, the optimizer's lrs);
# `python -m marsgpt.config config/train_gpt2_large_moonlight.py` prints every key.
from config.paper import paper_run

globals().update(paper_run("large", "moonlight"))
