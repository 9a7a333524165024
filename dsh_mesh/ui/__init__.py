"""``dsh-mesh ui``: a live web view of a mesh (docs/ui.md). A thin gateway over the
control-plane RPCs of one node (:class:`~dsh_mesh.client.MeshClient`): the tree of agents
across nodes, each agent's transcript, a timeline, and the actions a person takes (prompt,
interrupt, stop a subtree, approve or deny a waiting call). Every request is signed in and acts
with that person's scope and name (ADR 0041)."""

from dsh_mesh.ui._answers import error_response
from dsh_mesh.ui._app import ROOTS_PAGE, create_app
from dsh_mesh.ui._guard import ViewPolicy
from dsh_mesh.ui._people import Person, SignedInBy, SignIns
from dsh_mesh.ui._server import ExposureRefused, ViewAddress, ViewTls, serving

__all__ = [
    "ROOTS_PAGE",
    "ExposureRefused",
    "Person",
    "SignIns",
    "SignedInBy",
    "ViewAddress",
    "ViewPolicy",
    "ViewTls",
    "create_app",
    "error_response",
    "serving",
]
