"""What the router and the workers share that is not wire, torch-free: how a deployment is set up.

    worker.py    the engine, transfer and worker configs; each field carries its command-line flag
    router.py    the router's settings, declared the same way
    flags.py     argparse options derived from a config dataclass, and the config built back from them
    cli.py       command-line conventions of pdserve and pdserve-worker (help, --config, logging, exit)
    keys.py      the deployment's CURVE keys and their files (protocol/auth.py checks them on the sockets)
    models.py    the model names, where their files and tokenizers live, SmolLM2's converted cache
"""
