"""`pdserve-bench` (cli.py), grouped by what each bench measures:

    load/       live servers under load: the load generator, the crossover atlas, the P:D planner
    engine/     the engine's steps and kernels against their floors, alone and under an offline workload
    transfer/   KV moved between pools, processes, hosts (the transfer table, multihost) and tiers (offload)

and what they share: ab.py (paired, interleaved A/B runs), provenance.py (where and on what a result was
measured; bench/results/, where results go). The GPU scripts run_*_gpu.sh drive the load group on GPUs.
"""
