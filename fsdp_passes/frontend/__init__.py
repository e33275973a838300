"""A SimpleFSDP frontend: ``data_parallel`` shards a model so that ``torch.compile`` traces its collectives.

>>> import fsdp_passes
>>> model = fsdp_passes.data_parallel(model, mesh, mp_policy=fsdp_passes.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
>>> model = torch.compile(model, fullgraph=True)

Uses torch only (no Inductor import): it runs eagerly as well as compiled.
"""

from ._gather import FSDP_PARAM_META_KEY
from .data_parallel import MODES, DataParallelModule, FSDPParam, MixedPrecisionPolicy, data_parallel, sharded_params

__all__ = ["FSDP_PARAM_META_KEY", "DataParallelModule", "FSDPParam", "MODES", "MixedPrecisionPolicy", "data_parallel",
           "sharded_params"]
