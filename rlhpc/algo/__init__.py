"""The algorithms: policy losses with off-policy corrections (loss) and group advantages (advantage).

Importing this package registers their config checks with rlhpc.config.schema.validate.
"""

from rlhpc.algo import advantage, loss
from rlhpc.config import schema as _config

_config.register_check("algo.loss", lambda cfg: loss.check(cfg.algo))
_config.register_check("algo.advantage", lambda cfg: advantage.check(cfg.algo))
