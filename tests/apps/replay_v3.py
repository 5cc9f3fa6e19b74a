"""Release 3 of the app of tests/integration/test_replay_cli.py (see replay_flows)."""

from __future__ import annotations

import kestrel
from tests.apps import replay_flows

flow = kestrel.workflow(name="replay_app.flow")(replay_flows.flow_v3)
