"""Transfer and offload benches: a request's KV moved between pools, processes, hosts and tiers, checked.

    table.py          `pdserve-bench transfer`: the seed's KV transfer table from a paged cache, per length,
                      transport and mode; Child drives the two role processes
    table_report.py   its rows, targets and markdown
    roles.py          the prefill and decode processes (python -m pdserve.bench.transfer.roles)
    check.py          what lets the exact-match check fail: fresh prompts, poisoned blocks, a fault knob
    pools.py          methods beside the transports (zmq-curve, <transport>-fragmented), copy ceilings
    offload.py        `pdserve-bench offload`: recompute against reload per tier, its table
    offload_arms.py   its engine, tiers and arms, and the reload check
    multihost.py      `pdserve-bench multihost`: the transfer across network namespaces over a shaped link
"""
