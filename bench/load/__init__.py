"""Load benches: an OpenAI-API load generator against live servers, the crossover atlas, the P:D planner.

    generator.py    `pdserve-bench load`: colocated vs disaggregated (or any arms) under the same load
    arms.py         the arms of a comparison, and a fresh server for each
    session.py      the runs of one invocation: what each sends, and in what order
    runner.py       sending the planned requests and timing every token
    workload.py     prompts with known token lengths (synthetic, ShareGPT, traces) and their send times
    multiturn.py    conversations replayed turn by turn, for prefix reuse
    capacity.py     a policy's capacity under its SLOs, the sweep around it, whether a run kept up
    metrics.py      per-request records and the numbers made from them (TTFT, TPOT, ITL, goodput)
    report.py       results.json and summary.md;  verdict.py  the verdict in words;  plots.py  the PNGs
    vllm_compat.py  `vllm bench serve`'s flag spellings, auth and result file
    fake_server.py  an OpenAI-compatible server with no model, for tests
    atlas.py        `pdserve-bench atlas`: prompt profiles x SLO pairs x rates, which arm wins each cell
    planner.py      `pdserve-bench plan`: colocated or xP:yD for N GPUs;  plan_sim.py  its simulation
"""
