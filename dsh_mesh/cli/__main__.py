"""``python -m dsh_mesh.cli``: the same as the ``dsh-mesh`` command."""

from dsh_mesh.cli import main

raise SystemExit(main())
