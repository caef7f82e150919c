"""fastagg's simulator: many clients batched on one device (``python -m fastagg.sim --help``).

    from fastagg.sim import Config, run
    history = run(Config(dataset="fedexp-linreg", algorithms=("fedexp", "fedavg"), server_lr=10))
"""
from .models import register_model
from .runner import Config, History, run

__all__ = ["Config", "History", "register_model", "run"]
