"""Hardware presets for capacity and roofline math."""

from mlkit.config import HardwareConfig

# NVIDIA H200 SXM: 141 GB HBM3e at 4.8 TB/s; dense peaks from the spec sheet. The
# measured ceilings (docs/measuring.md) are what a kernel can actually reach.
H200 = HardwareConfig(
    name="NVIDIA H200",
    hbm_bytes=141 * 10**9,
    hbm_bandwidth=4.8e12,
    bf16_flops=989e12,
    fp8_flops=1979e12,
    measured_bandwidth=4.3e12,
    measured_bf16_flops=790e12,
)

# The local development CPU (2 cores, 24 GB). Throughput figures are rough
# placeholders for roofline plots only; CPU results are always quoted as ratios.
CPU = HardwareConfig(
    name="cpu",
    hbm_bytes=24 * 2**30,
    hbm_bandwidth=20e9,
    bf16_flops=100e9,
)

HARDWARE_PRESETS = {h.name: h for h in (H200, CPU)}
