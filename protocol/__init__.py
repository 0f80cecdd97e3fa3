"""The wire: every message the router and the workers exchange, torch-free, importing nothing else of
pdserve's (tests/test_house.py holds it to that). What they share that is not wire: settings/.

    wire.py      the protocol version (one, for every frame), ProtocolError, msgpack
    enums.py     Role, Transport, Mode, Policy, FailureKind
    control.py   router <-> worker messages: Register, Heartbeat, Generate, Reserve, Prefill, Tokens, ...
    kv.py        KV sender <-> receiver messages: Hello, Welcome, Begin, Done, the pools' TransportInfo
    sampling.py  sampling parameters and their bounds, defined once (HTTP API, wire, engine)
    phases.py    the phases of a request's time to first token
    timings.py   a request's `timings` object, one typed struct from the router to the client
    blocks.py    KV block names (a hash chained over tokens): the engine's prefix cache and the router's index
    auth.py      CURVE key pairs on every control and KV socket, the ZAP gate, throttled logs
    shm.py       the /dev/shm files of KV pools on the CPU: their names, private creation, safe sweep
"""
