"""Dataset preparation: one data/<name>/prepare.py script per dataset, and prepare_common.py, what they share."""
