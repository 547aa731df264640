"""The machinery behind train.py, one module per idea; train.py, model.py, mars.py and sample.py at the
repository's top level are what a user runs or copies.

    config        the typed configuration: every key, config files, --key=value, one-line errors
    optimizers    the optimizer registry: one entry per optimizer; parameter groups, the schedule, ZeRO-1
    run_dir       out_dir: its lock, what init_from means there, when a checkpoint is written, copies,
                  integrity, stop signals, failed writes; the parts a checkpoint holds
    launch        the resume check; the model and the other parts a run is built from
    checkpoint    checkpoint files: checksummed background saves, verified loads, the RNG part
    files         atomic file writes, the JSON-lines reader
    runtime       device, process group, precision, determinism, decisions all ranks take together
    tokens        token files, the window sampler, the offline GPT-2 tokenizer
    metrics       metrics.jsonl and wandb
    memory_plan   the per-GPU memory plan and --dry_run
    hellaswag, export_hf, plot   tools for a trained run: python -m marsgpt.<tool> --help
"""
