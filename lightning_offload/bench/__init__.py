"""Benchmark of activation offloading on random-init Llama shapes: ``python -m lightning_offload.bench``.

The parent process (:mod:`lightning_offload.bench.__main__`) runs one worker subprocess per workload
(:mod:`lightning_offload.bench.worker`), so every mode of a workload shares one process and one allocator state,
and the workloads do not disturb each other. It merges the workers' JSON files and writes a Markdown report with
verdicts (:mod:`lightning_offload.bench.report`) and a time-versus-memory plot.

Needs ``transformers`` and ``peft`` (the ``examples`` extra); the anchors (torchtune, TRL) are optional imports.
"""
