"""The memory-budget planner's pure core: plain numbers and dataclasses in, plans out.

Nothing here imports torch or the datapath: the engine's driver (:mod:`lightning_offload.budget`) reads the device's
counters, hands them over, and applies the plans.
"""
