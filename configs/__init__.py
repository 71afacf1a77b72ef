"""Named presets: models (``configs.models``) and hardware (``configs.hardware``)."""

from configs.hardware import CPU, H200, HARDWARE_PRESETS
from configs.models import (GLM_5_2, H200_GLM, H200_MLA, KIMI_K2_6, MINI_MLA, MODEL_PRESETS,
                            SMALL_MLA, TINY_GLM, TINY_GQA, TINY_MLA)

__all__ = ["CPU", "H200", "HARDWARE_PRESETS", "GLM_5_2", "H200_GLM", "H200_MLA", "KIMI_K2_6", "MINI_MLA",
           "MODEL_PRESETS", "SMALL_MLA", "TINY_GLM", "TINY_GQA", "TINY_MLA"]
