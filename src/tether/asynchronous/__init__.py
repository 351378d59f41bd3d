"""Asynchronous RL (``train.async.max_staleness`` K >= 1, docs/async.md): rollout workers sample while the trainer
updates, each batch from weights at most K updates old.

    feed.py     the trainer's side: jobs out, version-tagged batches back, staleness bounded and counted
    workers.py  the local worker processes (each builds its sampler with ``tether.agents.build``) and their pool
    remote.py   workers on other nodes (``tether worker HOST:PORT``), over channel.py's authenticated TCP
    weights.py  weights per version: shared memory, checksums, the vLLM probe
    partial.py  partial rollouts: a response sampled in segments, newer weights taken between them
"""
