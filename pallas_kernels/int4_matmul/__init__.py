"""INT4 weight-only (W4A16) matmuls, dense and grouped (MoE), for Hopper."""

# The weight layout whose kernels are right on an H200, and so the one the engine runs:
# the packed kernels ("kn"). The [N, K] kernels ("nk", nk.py) pass in interpret mode
# but returned NaN or wrong outputs on an H200 (every group-32 case, some group-128
# ones; docs/int4_matmul.md, "On hardware").
HARDWARE_LAYOUT = "kn"

from pallas_kernels.int4_matmul.block_sizes import BlockSizes
from pallas_kernels.int4_matmul.int4_matmul import BACKENDS
from pallas_kernels.int4_matmul.int4_matmul import grouped_schedule_spec
from pallas_kernels.int4_matmul.int4_matmul import int4_grouped_matmul
from pallas_kernels.int4_matmul.int4_matmul import int4_matmul
from pallas_kernels.int4_matmul.int4_matmul import resolve_backend
from pallas_kernels.int4_matmul.nk import from_nk
from pallas_kernels.int4_matmul.nk import int4_grouped_matmul_nk
from pallas_kernels.int4_matmul.nk import int4_matmul_nk
from pallas_kernels.int4_matmul.nk import to_nk
from pallas_kernels.int4_matmul.reference import dequantize_int4
from pallas_kernels.int4_matmul.reference import int4_grouped_matmul_reference
from pallas_kernels.int4_matmul.reference import int4_matmul_reference
from pallas_kernels.int4_matmul.reference import pack_int4
from pallas_kernels.int4_matmul.reference import unpack_int4
from pallas_kernels.int4_matmul.schedule_kernel import GroupedSchedule
from pallas_kernels.int4_matmul.schedule_kernel import ScheduleTable
