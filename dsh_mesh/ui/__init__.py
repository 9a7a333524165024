"""``dsh-mesh ui``: a live web view of a mesh (docs/ui.md). A thin, stateless gateway over the
control-plane RPCs of one node (:class:`~dsh_mesh.client.MeshClient`, the CLI's credentials):
the tree of agents across nodes, each agent's transcript, a timeline, and the actions a person
takes (prompt, interrupt, stop a subtree, approve or deny a waiting call)."""

from dsh_mesh.ui._app import create_app, error_response
from dsh_mesh.ui._server import ViewAddress, serving

__all__ = ["ViewAddress", "create_app", "error_response", "serving"]
