"""moonep_ops: balanced expert-parallel MoE ops for PyTorch that compile end to end.

    cfg = EPConfig(S=..., H=..., K=..., E=..., F=..., R=world_size)
    ep = EPGroup(cfg)                      # after torch.distributed.init_process_group
    layer = MoELayer(ep)                   # router -> plan -> dispatch -> prefetch -> GEMMs -> combine
    y = layer(x)                           # x [S, H] on every rank
"""

from . import autograd, ops, planning  # noqa: F401  (registers the moonep ops and their autograd)
from .config import EPConfig
from .dense import dense_moe
from .functional import moe_experts, precompile
from .group import EPGroup
from .layers import MoEBlock, MoEExperts, MoELayer, MoEModel
from .routers import DeepSeekV3Router, Router, RouterOutput, SoftmaxTopKRouter, TopKSoftmaxRouter
from .routing import route
from .shared import SharedExperts
from .status import MoEStatusError, check_status

__all__ = ["EPConfig", "EPGroup", "MoEBlock", "MoEExperts", "MoELayer", "MoEModel", "dense_moe", "moe_experts", "precompile", "route", "Router", "RouterOutput", "SoftmaxTopKRouter",
           "TopKSoftmaxRouter", "DeepSeekV3Router", "SharedExperts", "check_status", "MoEStatusError", "ops", "planning", "autograd"]
