"""The machinery behind train.py, one module per idea; train.py, model.py, mars.py and sample.py at the
repository's top level are what a user runs or copies.

    config            train.py's keys (TrainConfig); config_schema: key(), config files, --key=value, one-line errors
    optimizers        the optimizer catalogue, torch-free: one registry entry per optimizer, the schedule
    training_optimizer  the optimizer a run holds: built from its entry, owning the GradScaler and the look-ahead
    optim_protocol    torch.optim's closure, and torch optimizers chained as one
    parallel          DDP, ZeRO-1 (zero) and FSDP2 / HSDP (fsdp): how a run is spread over its ranks
    launch            setup: the run built before its first step; resume: what a resume keeps and may change
    run_dir           out_dir: its layout, what init_from means there, the requests that stop a run, copies
    run_lock          one run per out_dir: the lock, its heartbeat, takeovers, the guard before each write
    checkpointer      the run's checkpoints: when, from which state, copies, records, restore
    stop_signals      the signals that stop a run
    exits             how a run ends: its one line and exit status
    checkpoint        checkpoint files: checksummed background saves, verified loads through one open file
    shards            sharded checkpoints written and read; checkpoint_parts: the model, GradScaler and RNG parts
    compile_cache     what a compiled run compiled, loaded only when user_key's key signed it
    files             atomic file writes, checksums, the JSON-lines reader
    runtime           device, process group, precision, determinism, decisions all ranks take together
    tokens            token files, the window sampler, the offline GPT-2 tokenizer
    metrics           metrics.jsonl, wandb, the train line
    memory_plan       the per-GPU memory plan and --dry_run
    trained_model     a trained model for the tools: hellaswag, export_hf, plot (python -m marsgpt.<tool> --help)
"""
