"""The peers the ``peers`` section measures dsh-mesh against: AutoGen's gRPC runtime and Ray
actors, each driven by a script of this package run in the bench's own virtualenv
(``.venv-peers``, ``scripts/install_peers.sh``, pinned in ``requirements.txt``), never with the
project's dependencies. The scripts import nothing of ``dsh_mesh``; what they share is
``_harness`` (the standard library only)."""
