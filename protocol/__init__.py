"""Everything the router and the workers share, torch-free: the one package `server/` imports from
the worker side (a test holds it to that, tests/test_walls.py).

    wire.py      the protocol version (one, for every frame), ProtocolError, msgpack
    enums.py     Role, Transport, Mode, Policy, FailureKind
    control.py   router <-> worker messages: Register, Heartbeat, Generate, Reserve, Prefill, Tokens, ...
    kv.py        KV sender <-> receiver messages: Hello, Welcome, Begin, Done, the pools' TransportInfo
    sampling.py  sampling parameters and their bounds, defined once (HTTP API, wire, engine)
    phases.py    the phases of a request's time to first token
    timings.py   a request's `timings` object, one typed struct from the router to the client
    blocks.py    KV block names (a hash chained over tokens): the engine's prefix cache and the router's index
    config.py    the engine, transfer and worker configs; each field carries its command-line flag
    flags.py     argparse options derived from a config dataclass, and the config built back from them
    auth.py      the deployment's CURVE keys (every control and KV socket)
    models.py    the model names and where their files and tokenizers live
    shm.py       the /dev/shm files of KV pools on the CPU: their names, private creation, safe sweep
    cli.py       command-line conventions of pdserve and pdserve-worker (help, --config, logging, exit)
"""
