"""A run directory, ``RUN/``: everything tether does with one, in one package.

    guard.py       the trainer's hold on it (RunDirectory: create, lock, check, overwrite, resume, write errors)
    reader.py      reading one (RunDir: its config.yaml and the checkpoint to use), for --resume, eval and export
    checkpoint.py  RUN/checkpoints/step-N in safetensors, written atomically and verified by a manifest
    owned.py       what tether wrote (the .tether.json marker), and the one rule --overwrite follows
    stop.py        a graceful stop on SIGINT / SIGTERM: the step finishes, a checkpoint is saved

The modules are imported by name (``tether.rundir.checkpoint``...): this face imports none, so ``reader`` and
``owned`` stay free of torch (``tether eval`` reads a run while its parser is built). Nothing here reads the
config's schema: a run's config is written from its sections (`guard.write_config`) and resolved in
`tether.resolve.saved`.
"""
