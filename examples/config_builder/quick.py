"""A variant composed on config.py: a narrower model, a shorter run, no checkpoints.

cfgx merges the mappings in order; ``final`` references in config.py (the layer widths, the
schedule's length) follow the new values.
"""

from cfgx import replace

config = (
    "config.py",
    {
        "hidden_dim": 32,
        "trainer": {
            "max_steps": 100,
            "workspace": None,
            "hooks": replace([{"type": "progress", "interval": 50}]),
        },
    },
)
