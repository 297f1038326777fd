"""PyTorch DDP communication hook: gradient buckets all-reduced through homagg.

    from homagg.host_agent import Agent, AgentConfig
    from homagg.host_agent.torch_hook import homagg_hook
    agent = Agent(AgentConfig(job=1, worker=rank, workers=world, ...))
    ddp_model.register_comm_hook(state=agent, hook=homagg_hook)

That is all a user adds: no patched PyTorch. The hook returns the *mean* over workers, as DDP's
default all-reduce does; the sum behind it is exact on the quantized gradients. torch is an
optional dependency (the CPU build is enough); only this module imports it.
"""

import numpy as np
import torch

from homagg.host_agent.allreduce import Agent


def homagg_hook(agent: Agent, bucket: torch.distributed.GradBucket
                ) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    arr = buf.detach().to("cpu", torch.float32).numpy()
    summed = agent.allreduce(np.ascontiguousarray(arr).reshape(-1), key=("ddp", bucket.index()))
    out = torch.from_numpy(summed).to(buf.device, buf.dtype).div_(agent.cfg.workers)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out.reshape(buf.shape))
    return fut
