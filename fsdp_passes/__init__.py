"""fsdp_passes: bucketing and overlap scheduling of FSDP collectives inside torch.compile / Inductor."""

__version__ = "0.1.0"
