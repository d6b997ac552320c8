"""KV dimensionality compression (ZACK/FDC): calibration, rank plans, folding, and the Palu baseline.

The package is ``compression`` so that ``kvjax.compress``, the public function, does not shadow it.
"""

from kvjax.compression.calibration import CalibrationStats, calibrate, calibration_tokens
from kvjax.compression.folding import fold
from kvjax.compression.pipeline import BASIS, compress, make_plan
from kvjax.compression.plan import RankPlan

__all__ = ["BASIS", "CalibrationStats", "RankPlan", "calibrate", "calibration_tokens", "compress", "fold", "make_plan"]
