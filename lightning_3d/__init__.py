"""lightning-3d: 3D (tensor x pipeline x data) parallel training as a PyTorch Lightning strategy.

``import lightning_3d`` registers ``Trainer(strategy="3d")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_3d import policies
from lightning_3d.parallel import ParallelConfig, ParallelConfigError, ParallelDims, RankCoords
from lightning_3d.strategies import ThreeDStrategy

# Lightning only registers the strategies of its own package; third-party ones register on import.
if ThreeDStrategy.strategy_name not in StrategyRegistry:
    ThreeDStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["ParallelConfig", "ParallelConfigError", "ParallelDims", "RankCoords", "ThreeDStrategy", "policies"]
