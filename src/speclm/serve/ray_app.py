"""Scale-out on Ray Serve: the same FastAPI app, one model and one engine per replica.

Each replica builds the app with :func:`~speclm.serve.build.build_app` when it starts (so it
loads the model in its own process and runs its own engine thread, batching the requests Ray
routes to it); Ray's HTTP proxy spreads requests over the replicas. ``--ray-address`` (or
``$RAY_ADDRESS``) joins an existing cluster; without it a local single-node cluster is started.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..errors import SpeclmError
from .build import ServeOptions, build_app

APP_NAME = "speclm"


def make_deployment(opts: ServeOptions, replicas: int, num_cpus: float = 1.0, num_gpus: float = 0.0):
    """A bound Ray Serve application serving ``opts`` on ``replicas`` replicas."""
    from ray import serve

    @serve.deployment(
        name="SpeclmServer",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        # the replica's own bounded queue answers 429; Ray only has to let requests through
        max_ongoing_requests=opts.max_batch + opts.max_queue + 1,
        graceful_shutdown_timeout_s=opts.shutdown_grace_s,
        health_check_period_s=5,
    )
    @serve.ingress()
    class SpeclmServer:
        def __init__(self, options: ServeOptions) -> None:
            self.options = options

        def __serve_build_asgi_app__(self):
            return build_app(self.options)

    return SpeclmServer.bind(opts)


def run_ray(opts: ServeOptions, args: argparse.Namespace) -> int:
    """``speclm serve --ray``: deploy, print where it listens, serve until SIGINT/SIGTERM."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpeclmError("--ray needs Ray Serve: pip install 'speclm[ray]'") from None
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:  # a local single-node cluster, small: the model needs no object store
        ray.init(include_dashboard=False, log_to_driver=False,
                 object_store_memory=200 << 20, num_cpus=max(os.cpu_count() or 1,
                                                             int(args.replicas * args.num_cpus_per_replica)))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(make_deployment(opts, args.replicas, args.num_cpus_per_replica,
                                  args.num_gpus_per_replica),
                  name=APP_NAME, route_prefix="/", blocking=False)
        print(f"speclm: serving {opts.model_name()!r} on http://{args.host}:{args.port} with "
              f"{args.replicas} Ray Serve replica(s)", file=sys.stderr, flush=True)
        while not stop.wait(0.5):  # wake up now and then so signals are handled promptly
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
