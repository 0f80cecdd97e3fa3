"""Write the Secrets the Kubernetes example mounts, from fresh `pdserve keygen` keys, as YAML on stdout:

    python deploy/k8s/make_secrets.py | kubectl apply -f -
    python deploy/k8s/make_secrets.py --namespace llm --api-key-file key.txt > secrets.yaml   # then keep it safe

pdserve-router-keys   DIR/router (router.key_secret, worker.key): mounted by the router only
pdserve-worker-keys   DIR/worker (worker.key_secret, router.key): mounted by every worker
pdserve-api-key       api-key: the router's PDSERVE_API_KEY (a fresh random one unless --api-key-file)

The keys never touch the disk beyond a private temporary folder, removed on exit.
"""

from __future__ import annotations

import argparse
import base64
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


def secret(name: str, files: dict[str, bytes], namespace: str | None, component: str) -> dict:
    meta = {"name": name, "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component}}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {k: base64.b64encode(v).decode() for k, v in sorted(files.items())}}


def manifests(namespace: str | None = None, api_key: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="pdserve-k8s-keys-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "keygen", f"{tmp}/keys"], capture_output=True,
                           text=True, cwd=Path(__file__).resolve().parents[2])
        if r.returncode != 0:
            raise SystemExit(f"pdserve keygen failed: {r.stderr.strip()}")
        folder = {d: {f.name: f.read_bytes() for f in Path(tmp, "keys", d).iterdir()} for d in ("router", "worker")}
    key = (api_key or secrets.token_hex(24)).encode()
    return [secret("pdserve-router-keys", folder["router"], namespace, "router"),
            secret("pdserve-worker-keys", folder["worker"], namespace, "worker"),
            secret("pdserve-api-key", {"api-key": key}, namespace, "router")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default=None)
    p.add_argument("--api-key-file", default=None, help="use this file's first line as the API key")
    args = p.parse_args()
    api_key = Path(args.api_key_file).read_text().splitlines()[0].strip() if args.api_key_file else None
    sys.stdout.write(yaml.safe_dump_all(manifests(args.namespace, api_key), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
