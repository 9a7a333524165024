"""``python -m dsh_mesh.node``: run one node."""

from dsh_mesh.node._main import main

raise SystemExit(main())
