"""The process :class:`~dsh_mesh.testing.LlamaServer` starts: llama.cpp's own HTTP server, through
the ``xllamacpp`` wheel, serving one GGUF model on a loopback port the kernel picks.

``python -m dsh_mesh.testing._llama_child '<settings JSON>'``. Once the model is loaded and the
server listens it prints one JSON line, ``{"base_url": "http://127.0.0.1:PORT"}``, then serves
until its standard input closes (its parent ended it, or died) or it gets SIGTERM.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    """Serve as ``argv[1]`` (JSON: model, threads, slots, context_tokens) says."""
    settings = json.loads(argv[1])
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = settings["model"]
    params.model_alias = {"tiny"}
    params.n_ctx = settings["context_tokens"]  # shared by the slots (kv_unified)
    params.n_parallel = settings["slots"]
    params.kv_unified = True
    params.cpuparams.n_threads = settings["threads"]
    params.cpuparams_batch.n_threads = settings["threads"]
    params.n_threads_http = settings["http_threads"]
    params.use_jinja = True
    params.warmup = False
    params.hostnames = ["127.0.0.1"]
    params.port = 0
    params.verbosity = settings["verbosity"]
    server = xllamacpp.Server(params)  # returns once the model is loaded and the port bound
    print(json.dumps({"base_url": server.listening_address}), flush=True)
    sys.stdin.buffer.read()  # until the parent closes it
    # The server's threads hold no state worth a graceful stop; its destructor can take
    # seconds to drain the HTTP pool, so the process ends here.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
