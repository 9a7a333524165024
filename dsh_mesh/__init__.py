"""dsh-mesh: a multi-host runtime for cooperating LLM agents.

The public surface is re-exported from the layer packages: :mod:`dsh_mesh.core` (semantics),
:mod:`dsh_mesh.models` (providers), :mod:`dsh_mesh.tools`, :mod:`dsh_mesh.agent` and
:mod:`dsh_mesh.runtime` (the continuation manager).
"""
