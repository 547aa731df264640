# GPT-2 small (124M) with MARS-M (approximate) on OpenWebText: the MARS-M paper's run.
# Its numbers live in config/paper.py (model size, the 100k-step recipe, the optimizer's lrs);
# `python -m marsgpt.config config/train_gpt2_small_mars_m.py` prints every key.
from config.paper import paper_run

globals().update(paper_run("small", "mars_m"))
