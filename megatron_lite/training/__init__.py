"""The training loop and what watches it.

    loop.py                 initialize -> build model chunks -> optimizer -> data -> iterate, log, evaluate, save
    rerun_state_machine.py  NaN, spike and rerun checks of every loss
    logging.py              console lines, metrics JSONL, TensorBoard, W&B
    timers.py               where a step's time goes
    host_reads.py           counting host reads of tensor values (each a device sync)
    profiling.py            torch profiler traces (--profile)
    memory_snapshots.py     CUDA allocator history (--record-memory-history)
    output_paths.py         every location a run writes, probed at start-up
"""
