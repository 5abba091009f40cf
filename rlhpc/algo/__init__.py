"""The algorithms: policy losses with off-policy corrections (loss) and group advantages (advantage).

Importing this package registers their config checks with rlhpc.config.schema.validate. The checks (checks.py) need
no torch, so neither does importing this package: the launcher validates a config without it.
"""

from rlhpc.algo import checks
from rlhpc.config import schema as _config

_config.register_check("algo.loss", lambda cfg: checks.loss_keys(cfg.algo))
_config.register_check("algo.advantage", lambda cfg: checks.advantage_keys(cfg.algo))
