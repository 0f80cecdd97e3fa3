"""Engine and kernel benches: the engine's steps against their floors, alone and under a workload.

    steps.py            `pdserve-bench engine`: decode steps against the memory roofline, prefill against
                        transformers' (paired), the decodes' gaps while a long prompt prefills
    decode.py           decode points from reserved + adopted requests, the copy roofline, the chunked scenario
    mixed.py            a mixed step's wall against GPU-busy time; the offline workload and its floor
    report.py           the engine bench's targets and markdown
    offline.py          `pdserve-bench offline`: an offline workload beside its floor and transformers' batching
    paged_attention.py  `pdserve-bench attention`: one layer's paged decode attention, kernel alone
    start.py            `pdserve-bench start`: a worker's start by parts, each graph's capture, compiles
    kernel_variants.py  `pdserve-bench variants`: the paged-attention kernels' Triton variants, keyed on the CPU
    compile_watch.py    what a stretch of code compiled (torch.compile, Triton), a profile of one call
"""
