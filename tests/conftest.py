"""Suite-wide settings.

One torch thread: the tiny models' ops are too small to split, and on a shared 2-core box
spinning intra-op threads make timings erratic (a decode step went from 6 ms to 400 ms).
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
