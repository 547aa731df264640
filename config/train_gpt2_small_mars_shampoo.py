# GPT-2 small (124M) with MARS-Shampoo on OpenWebText, otherwise the paper's MARS run (untuned lrs).
# Its numbers live in config/paper.py (model size, the 100k-step recipe, the optimizer's lrs);
# `python -m marsgpt.config config/train_gpt2_small_mars_shampoo.py` prints every key.
from config.paper import paper_run

globals().update(paper_run("small", "mars_shampoo"))
