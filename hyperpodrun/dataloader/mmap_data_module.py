"""`MMAPDataModule` at the product note's path (the implementation: hyperpodrun/data/datamodule.py)."""
from hyperpodrun.data.datamodule import MMAPDataModule

__all__ = ["MMAPDataModule"]
