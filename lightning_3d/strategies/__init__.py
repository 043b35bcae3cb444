from lightning_3d.strategies.three_d import ThreeDStrategy

__all__ = ["ThreeDStrategy"]
