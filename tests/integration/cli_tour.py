"""The scenario of the CLI's end-to-end test (``--scenario tests.integration.cli_tour:CLI_TOUR``):
the demo's tour, ``dsh-mesh up``'s default, with alpha's slow model call long enough that an
interrupt sent once alpha's progress is seen always finds that call running, however busy the
machine (the demo's four seconds are a few command starts on a loaded one). A module of its
own: the demo's code is more than the other scenarios' nodes need to load."""

from __future__ import annotations

import dataclasses

from dsh_mesh.demo import SCENARIO as DEMO
from dsh_mesh.models import Call

_ALPHA = tuple(DEMO.programs["alpha"])
_SLOW = _ALPHA[1]
assert isinstance(_SLOW, Call) and _SLOW.delay > 0, "alpha's second step is its slow call"

CLI_TOUR = dataclasses.replace(
    DEMO,
    programs={
        **DEMO.programs,
        "alpha": (_ALPHA[0], dataclasses.replace(_SLOW, delay=120.0), *_ALPHA[2:]),
    },
)
