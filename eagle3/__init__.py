"""eagle3: train EAGLE-3 drafters on the served target's own numerics."""

from eagle3.config import register_configs

register_configs()

__version__ = "0.1.0"
