"""``tether sweep``: a grid of training runs over seeds, run in lanes, and its statistical report.

    spec.py     the spec (YAML): base config, axes, extra arms, seeds, metric; checked, every arm resolved
                with `tether.resolve.load_config` before any run starts; shards
    layout.py   the sweep directory: DIR/sweep.json, DIR/runs/<arm>/seed-<s>/ (the run) and its record
    runner.py   ``tether train`` subprocesses in lanes, one thread each; resume after a kill; records
    results.py  reading one or more sweep directories back: runs, curves, final values
    stats.py    the statistics (their formulas in its docstring; rliable's estimators)
    report.py   ``tether sweep report``: markdown, PNG, JSON
    cli.py      the two command lines

docs/sweeps.md is the user's guide.
"""
