"""The project's benchmark rig (not part of the installed package): ``python -m benchmarks`` from the repo root.

The parent process (:mod:`benchmarks.__main__`) runs one worker subprocess per workload (:mod:`benchmarks.worker`),
so every mode of a workload shares one process and one allocator state, and the workloads do not disturb each
other. It merges the workers' JSON files and writes a Markdown report with verdicts (:mod:`benchmarks.report`) and
a time-versus-memory plot. ``--capacity`` instead searches, under hard memory caps, the longest sequence each mode
trains (:mod:`benchmarks.capacity`, one process per model and cap; the search itself is :mod:`benchmarks.search`).

Full-size runs need ``transformers`` (and ``peft`` for LoRA): ``pip install -e ".[examples]"``. ``--tiny`` runs
on a CPU with the test extra alone (the repo's demo model stands in for Llama). The anchors (torchtune, TRL) are
optional imports (``benchmarks/fetch_anchors.sh``). Importing this package changes no environment variable and
no ``sys.path``.
"""
