"""lm-evaluation-harness's own HellaSwag rendering, for hellaswag_local.yaml beside this file: lm-eval 0.4.x
resolves a task's `!function module.name` against the task's folder, so the harness's function is named here."""

from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401
